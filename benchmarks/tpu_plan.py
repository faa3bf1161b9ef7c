"""A TPU plan of the experiments: every training program compiled for a TPU topology, on a machine with no TPU.

    pip install -e '.[tpu]'       # libtpu, at the installed jax's version (or: tools/install_libtpu.sh DIR)
    python -m benchmarks.tpu_plan --topology v5e:2x2 [--experiment NAME,...|all] [--size quick|default|full|paper]
                                  [--out runs/tpu_plan/v5e-2x2-default.json]

libtpu compiles for TPU topologies without a device (``jax.experimental.topologies.get_topology_desc``; MaxText's
``train_compile.py`` does the same). These are compile-time ESTIMATES, not measured times: nothing here ran on a
TPU.

How an experiment is planned. Its ``run(config)`` is called, at the size asked, with a :class:`Plan` installed
(``resjax.train.planning``): every ``Trainer.sweep`` and ``ImageTrainer.fit`` the experiment makes (through its
cells, grids and packing, as it would run them) hands the plan its programs instead of training, and gets back an
untrained stand-in (NaN metrics) so the experiment goes on to its next cell. Layout rules that depend on the
platform (``scan='auto'``, the host feeder's ``seed_axis='auto'``, ``pack='auto'``) choose what they would on a
TPU (``planning.backend()``). What is not training (the analyses) runs on the CPU as usual and is not in the plan.
Each program is compiled for the topology's chips, laid out as the feeders lay them out on devices:

- on-device feeder (``make_train``): the seeds (every run of the cell) sharded over the chips (one mesh axis
  ``'seeds'``, padded to a multiple of the chip count as ``Trainer.sweep`` pads them); two programs: the
  initialisation and the whole run (``train_epochs``: every epoch, its minibatch steps and evaluations, one
  program whose trip count is the number of epochs);
- host feeder (``make_image_train``): data-parallel over every chip (the batch's example axis sharded on
  ``'data'``, the state replicated, as ``make_data_mesh()`` does), several hosts where the topology has them;
  the initialisation, the training step (run ``epochs x steps_per_epoch`` times) and the evaluation step (run
  ``evaluations x ceil(test examples / eval batch)`` times).

Per program (``ProgramPlan``): whether it compiled (or the error); HBM per chip (``memory_analysis``:
arguments, outputs, temporaries, less what outputs alias) against the chip's HBM; dense FLOPs (``benchmarks.flops``
over the program as lowered: the same count on every backend, loops by their trip counts) per chip; HBM bytes per
chip (every top-level instruction of the compiled TPU program reads its operands and writes its result in HBM:
fusions as a whole, loops by their trip counts; tensors the compiler put in on-chip memory, ``S(1)``, left out);
the MXU lane fill (the FLOP-weighted share of the 128 lanes, 256 on v6e, that the output features of each dot and
convolution fill: a width-64 layer fills half); and three times per call: ``compute_s`` = FLOPs / peak,
``memory_s`` = bytes / HBM bandwidth, and the roofline ``roofline_s`` = the larger, with ``bound`` saying which.
``padded_s`` is the roofline with the compute at the lane fill (FLOPs / (fill x peak)): what the matrix unit does
when narrow layers leave lanes empty, the estimate to plan with. An experiment's total is the sum over its programs
of calls x ``padded_s``.

What these estimates leave out: the host (input pipeline, the Python between steps, checkpoints), collectives'
latency (counted as bytes only), the vector units' work (normalisation, activations: bytes only), and the
compile time on the TPU host itself. A float32 model on a TPU runs its matmuls at the default precision, one
bfloat16 pass: the bfloat16 peak is the ceiling. ``--size paper`` runs each experiment's ``full`` config (its
``default`` where it has no other) on synthetic data of the real data's shapes (CIFAR: 50,000 training images).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # this process computes on the CPU (the TPU is a compile target): JAX's backend the CPU's
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import ast
import dataclasses
import importlib
import json
import math
import pathlib
import re
import tempfile
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flops, print_table
from resjax.train import planning

# ---- the chips --------------------------------------------------------------------------------------------


#: the chips' published figures (bfloat16 peak, HBM, bandwidth, lanes; their sources): the library's table, which
#: ``seed_axis='auto'`` on a TPU times its layouts by
CHIPS = planning.CHIPS
Chip = planning.Chip

#: How the topologies of a TPU VM's name are written for ``get_topology_desc`` (v4-8 = 4 chips, 2x2x1; v5e-8 =
#: 8 chips, 2x4).
VM_TOPOLOGIES = {"v4-8": "v4:2x2x1", "v5e-8": "v5e:2x4", "v5e-4": "v5e:2x2", "v5p-8": "v5p:2x2x1",
                 "v6e-8": "v6e:2x4"}


def chip_of(topology: str) -> Chip:
    kind = topology.split(":")[0].lower()
    if kind not in CHIPS:
        raise ValueError(f"topology: {topology!r} is not a TPU topology this plan knows (KIND:SHAPE with KIND one of "
                         f"{', '.join(CHIPS)}, e.g. v5e:2x2 or v4:2x2x1)")
    return CHIPS[kind]


def libtpu_available() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


_TOPOLOGIES: dict[str, Any] = {}


#: The VMs whose chips are all on one host, where libtpu's topology of the same shape spreads them over several
#: (``v5e:2x4`` alone is 2 hosts of 4 chips; a v5e-8 VM is one host of 8): their chips per host.
VM_HOST_BOUNDS = {"v5e-8": (2, 4, 1), "v6e-8": (2, 4, 1)}


def topology_devices(topology: str) -> list:
    """The TPU devices of ``topology`` (``'v5e:2x2'``, or a VM name such as ``'v5e-8'``: its chips on as many
    hosts as the VM has, :data:`VM_HOST_BOUNDS`), compile-only."""
    bounds = VM_HOST_BOUNDS.get(topology)
    key, topology = topology, VM_TOPOLOGIES.get(topology, topology)
    chip_of(topology)
    if key not in _TOPOLOGIES:
        if not libtpu_available():
            raise RuntimeError("libtpu is not installed: pip install -e '.[tpu]' (jax[tpu] at the installed jax's "
                               "version), then run again")
        from jax.experimental import topologies

        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU metadata server to ask: compile only
        # libtpu takes a machine-wide lock file (/tmp/libtpu_lockfile) for a process that drives TPUs; compiling
        # drives none, so several plans (the test suite's workers) may run at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            _TOPOLOGIES[key] = topologies.get_topology_desc(
                topology_name=topology, platform="tpu", **({"chips_per_host_bounds": bounds} if bounds else {}))
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"topology: libtpu does not know {topology!r} ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); e.g. v5e:2x2, v5e:4x4, v4:2x2x1 "
                             "(v5e:1x1 is refused: one chip of v5e:2x2 is the same chip)") from None
    return list(_TOPOLOGIES[key].devices)


# ---- costs of a program's HLO -----------------------------------------------------------------------------

_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
#: instructions that move no data of their own (or whose called computations are counted instead)
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "while", "conditional", "call", "opt-barrier", "add-dependency"}
_SLICES = ("dynamic-slice", "slice", "gather")
#: A nested fusion whose output is its first operand's buffer (XLA:TPU's copy fusion under a dynamic-update-slice,
#: which changes the tiling in place): what is written into it is only the update (XLA's own cycle estimate agrees).
_ALIASED = "output_to_operand_aliasing={{}: (0, {})}"


def hbm_bytes(shape: str) -> int:
    """Bytes of an HLO shape (an array or a tuple) held in HBM: arrays in on-chip memory (``S(1)``) left out."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if layout and "S(1)" in layout:
            continue
        size = _BYTES.get(dtype)
        if size is None:
            continue
        total += size * math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
    return total


def _users(comp: flops.Computation) -> dict[str, list]:
    """``{name: [instructions that take it as an operand]}`` of a computation."""
    users: dict[str, list] = {}
    for ins in comp.instrs.values():
        for o in ins.operands:
            users.setdefault(o, []).append(ins)
    return users


class HbmBytes(flops.Program):
    """HBM bytes of a compiled program per device: each top-level instruction reads its operands and writes its
    result (a fusion as a whole), loops by their trip counts; ``*-done`` halves of asynchronous pairs count
    nothing (their ``*-start`` did); a dynamic-update-slice writes only its update (in place)."""

    DESCEND = ("call",)
    DESCEND_ASYNC = False

    def own(self, comp: flops.Computation, ins: flops.Instr) -> float:
        op = ins.opcode
        if op in _NO_TRAFFIC or op.endswith("-done"):
            return 0
        shape = lambda name: comp.instrs[name].shape if name in comp.instrs else ""  # noqa: E731
        if op == "dynamic-update-slice":
            return 2 * hbm_bytes(shape(ins.operands[1]))
        if op in _SLICES:  # reads the slice it returns
            return 2 * hbm_bytes(ins.shape)
        if op == "copy-start":  # (destination, source, context): the end in HBM is what moves
            return hbm_bytes(ins.shape)
        reads = [hbm_bytes(shape(o)) for o in ins.operands]
        written = hbm_bytes(ins.shape)
        if op == "fusion":
            fused = self.comps.get(ins.called().get("calls", [None])[0])
            if fused is not None:
                reads, written = self._fused_traffic(fused, reads, written, ins.shape)
        return written + sum(reads)

    def _sliced_bytes(self, comp: flops.Computation, name: str, users: dict) -> int | None:
        """The bytes of ``name`` (a parameter of the fused computation ``comp``) read when every use of it slices it:
        a slicing instruction's result, a nested fusion whose own parameter is only sliced (a scan's loop body reads
        one layer of a stacked array that way), or an in-place relayout (:data:`_ALIASED`) whose uses slice it; None
        when some use reads it whole."""
        uses, total = users.get(name, []), 0
        for u in uses:
            if u.opcode in _SLICES and u.operands[0] == name:
                total += hbm_bytes(u.shape)
                continue
            if _ALIASED in u.attrs and u.operands[0] == name:  # relaid out in place: what its uses read of it
                read = self._sliced_bytes(comp, u.name, users)
                if read is None:
                    return None
                total += read
                continue
            inner = self.comps.get(u.called().get("calls", [None])[0]) if u.opcode == "fusion" else None
            if inner is None or u.operands.count(name) != 1:
                return None
            index = str(u.operands.index(name))
            param = next((i.name for i in inner.instrs.values() if i.opcode == "parameter" and i.operands
                          and i.operands[0] == index), None)
            read = None if param is None else self._sliced_bytes(inner, param, _users(inner))
            if read is None:
                return None
            total += read
        return total if uses else None

    def _fused_traffic(self, fused: flops.Computation, reads: list, written: int,
                       outer_shape: str = "") -> tuple[list, int]:
        """A fusion reads only the slices of a parameter that only slicing instructions use, and writes only the
        update of a dynamic-update-slice into a parameter (in place) at its root, or at an element of its root
        tuple (a multi-output fusion; ``outer_shape``: the fusion's own shape, whose layouts say what is in HBM)."""
        users = _users(fused)
        params = {i.name: i for i in fused.instrs.values() if i.opcode == "parameter"}
        reads = list(reads)
        for name, p in params.items():
            k = int(p.operands[0]) if p.operands and p.operands[0].isdigit() else None
            sliced = self._sliced_bytes(fused, name, users)
            if k is not None and k < len(reads) and sliced is not None:
                reads[k] = sliced
        root = fused.instrs.get(fused.root)
        if root is None:
            return reads, written

        def in_place(ins) -> int | None:  # the update's bytes of a dynamic-update-slice into a parameter, read too
            while ins is not None and ins.opcode == "bitcast" and ins.operands:  # a bitcast of it moves nothing
                ins = fused.instrs.get(ins.operands[0])
            if ins is None or ins.opcode != "dynamic-update-slice":
                return None
            into = fused.instrs.get(ins.operands[0])
            while into is not None and into.operands and (  # into a bitcast of a parameter, or a relayout of it that
                    into.opcode == "bitcast" or _ALIASED in into.attrs):  # aliases it (written in place: its update)
                into = fused.instrs.get(into.operands[0])
            if into is None or into.name not in params:
                return None
            p = params[into.name]
            k = int(p.operands[0]) if p.operands and p.operands[0].isdigit() else None
            update = hbm_bytes(fused.instrs[ins.operands[1]].shape) if ins.operands[1] in fused.instrs else 0
            if k is not None and k < len(reads):
                reads[k] = update
            return update

        if root.opcode == "tuple":  # a multi-output fusion: each output a dynamic-update-slice writes its update
            outs = [m.group(0) for m in _ARRAY.finditer(outer_shape)] if outer_shape else []
            if len(outs) == len(root.operands):
                written = sum(hbm_bytes(out) if (u := in_place(fused.instrs.get(o))) is None else u
                              for o, out in zip(root.operands, outs))
            return reads, written
        update = in_place(root)
        return reads, (written if update is None else update)


class LaneFlops(flops.Program):
    """Dense FLOPs divided by each op's lane fill: a dot's or a convolution's output features ``N`` fill
    ``N / (lanes * ceil(N / lanes))`` of the matrix unit (per feature group of a grouped convolution). The program's
    lane fill is its dense FLOPs over this count."""

    def __init__(self, text: str, lanes: int):
        self.lanes = lanes
        super().__init__(text)

    def fill(self, n: int) -> float:
        return n / (self.lanes * math.ceil(n / self.lanes)) if n else 1.0

    def own(self, comp: flops.Computation, ins: flops.Instr) -> float:
        if ins.opcode == "dot":
            rhs = flops.dims(comp.instrs[ins.operands[1]].shape)
            skip = set()
            for key in ("rhs_contracting_dims", "rhs_batch_dims"):
                m = re.search(rf"{key}=\{{([^}}]*)\}}", ins.attrs)
                skip |= {int(d) for d in m.group(1).split(",") if d.strip()} if m else set()
            n = math.prod(d for i, d in enumerate(rhs) if i not in skip)
            return flops.dot_flops(comp, ins) / self.fill(n)
        if ins.opcode == "convolution":
            kernel = flops.dims(comp.instrs[ins.operands[1]].shape)
            labels = re.search(r"dim_labels=([^,\s]+)", ins.attrs).group(1)
            out = kernel[labels.split("_")[1].split("->")[0].index("o")]
            groups = max(ins.attr_int("feature_group_count") or 1, ins.attr_int("batch_group_count") or 1)
            return flops.conv_flops(comp, ins) / self.fill(out // groups)
        return 0


class OpCount(flops.Program):
    """The instructions a call executes one after another on the chip, loops by their trip counts: each top-level
    instruction that does work (a fusion as one; ``*-done`` halves and bookkeeping not counted). A program of many
    small ops (a depth-1000 MLP at width 128) is bound by each op's launch latency, which the roofline does not
    count: its estimate is then a lower bound, and this count says how many such latencies a call holds."""

    DESCEND = ("call",)
    DESCEND_ASYNC = False

    def own(self, comp: flops.Computation, ins: flops.Instr) -> float:
        return 0 if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith("-done") else 1


# ---- one program ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProgramPlan:
    """One program compiled for the topology (see the module docstring)."""

    cell: str
    name: str
    calls: int
    compiled: bool
    error: str | None = None
    compile_s: float = 0.0
    hbm_per_chip: float = math.nan  # bytes: arguments + outputs + temporaries - aliased (+ resident_bytes)
    hbm_fraction: float = math.nan
    fits: bool = False
    argument_bytes: float = math.nan
    output_bytes: float = math.nan
    temp_bytes: float = math.nan
    flops_per_chip: float = math.nan  # one call
    bytes_per_chip: float = math.nan  # one call
    lane_fill: float = math.nan
    compute_s: float = math.nan
    memory_s: float = math.nan
    roofline_s: float = math.nan
    padded_s: float = math.nan
    bound: str = ""
    collectives: int = 0
    unresolved_loops: int = 0
    xla_flops: float = math.nan  # XLA's cost analysis of the compiled program (a loop's body once)
    xla_bytes: float = math.nan
    layout: str = ""
    flops: float = math.nan  # one call, every chip (the program as lowered: global shapes)
    cpu_flops: float = math.nan  # the same program as the CPU runs it (with ``Plan(check_cpu=True)``)
    chosen: bool = True  # False: a layout planned beside the one chosen (seed_axis='auto'), not in the totals
    resident_bytes: float = 0.0  # held beside the program meanwhile (a looped seed axis: the other seeds' states)
    ops: float = math.nan  # instructions one call executes in sequence (OpCount: each a launch latency)

    @property
    def total_s(self) -> float:
        return self.calls * self.padded_s if self.compiled else math.nan


def _as_float(d: Any, key: str) -> float:
    if isinstance(d, (list, tuple)):
        d = d[0] if d else {}
    try:
        return float((d or {}).get(key, math.nan))
    except (TypeError, ValueError):
        return math.nan


def _dense_flops(lowered, values: dict[int, int] | None, count: int) -> tuple[float, int, list]:
    """(dense FLOPs of the program as lowered, loops counted once, the arguments its trip counts read)."""
    flat = [None] * count
    for i, v in (values or {}).items():
        flat[i] = v
    kept = lowered._lowering.compile_args.get("kept_var_idx")
    argv = [x for i, x in enumerate(flat) if kept is None or i in kept]
    dense, misses = flops.Program(lowered.as_text(dialect="hlo")).flops(argv)
    return dense, misses, argv


def plan_program(cell: str, name: str, fn, args: tuple, chip: Chip, chips: int, calls: int = 1,
                 values: dict[int, int] | None = None, layout: str = "", twin=None) -> ProgramPlan:
    """Compile the jitted ``fn`` for ``args`` (``jax.ShapeDtypeStruct`` with the topology's shardings) and cost
    one call of it. ``values``: the values of integer scalar arguments a loop's trip count reads (by their index
    among the flattened arguments); ``calls``: how many times the run calls it. ``twin``: the same program as the
    CPU runs it (no TPU shardings), lowered on the same shapes for ``cpu_flops`` (the same work, counted alike)."""
    start = time.perf_counter()
    try:
        lowered = fn.lower(*args)
        compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001  (recorded: the plan says what does not compile)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return ProgramPlan(cell, name, calls, False, f"{type(err).__name__}: {first[:400]}",
                           time.perf_counter() - start, layout=layout)
    seconds = time.perf_counter() - start
    count = len(jax.tree_util.tree_leaves(args))
    dense, misses, argv = _dense_flops(lowered, values, count)
    padded, _ = LaneFlops(lowered.as_text(dialect="hlo"), chip.lanes).flops(argv)
    cpu_flops = math.nan
    if twin is not None:
        plain = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        cpu_flops = _dense_flops(twin.lower(*plain), values, count)[0]
    tpu_text = compiled.as_text()
    moved, bmisses = HbmBytes(tpu_text).flops(argv)
    ops = OpCount(tpu_text).flops(argv)[0]
    mem = compiled.memory_analysis()
    arg_b, out_b, tmp_b = (float(getattr(mem, f"{k}_size_in_bytes", math.nan)) for k in ("argument", "output", "temp"))
    alias = float(getattr(mem, "alias_size_in_bytes", 0) or 0)
    hbm = arg_b + out_b + tmp_b - alias
    per_chip = dense / chips
    compute, memory = per_chip / chip.peak_flops, moved / chip.hbm_bandwidth
    fill = dense / padded if padded else 1.0
    padded_compute = per_chip / max(fill, 1e-12) / chip.peak_flops
    cost = compiled.cost_analysis()
    return ProgramPlan(
        cell, name, calls, True, None, seconds, hbm, hbm / chip.hbm_bytes, hbm <= chip.hbm_bytes, arg_b, out_b, tmp_b,
        per_chip, moved, fill, compute, memory, max(compute, memory), max(padded_compute, memory),
        "compute" if padded_compute >= memory else "memory",
        len(re.findall(r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                       tpu_text)),
        misses + bmisses, _as_float(cost, "flops"), _as_float(cost, "bytes accessed"), layout, dense, cpu_flops,
        ops=ops)


def _with_seed_axis(config, mode: str):
    """``config`` with ``train.seed_axis`` set to ``mode``."""
    import ml_collections

    c = ml_collections.ConfigDict(config.to_dict())
    c.train.seed_axis = mode
    return c


def abstract(tree: Any, sharding, rows: int | None = None) -> Any:
    """``jax.ShapeDtypeStruct`` of every leaf of ``tree`` placed by ``sharding``; with ``rows``, the leading (seed)
    axis resized to ``rows``."""
    def one(a):
        shape = tuple(np.shape(a)) if rows is None else (rows, *np.shape(a)[1:])
        return jax.ShapeDtypeStruct(shape, jnp.result_type(a) if not hasattr(a, "dtype") else a.dtype, sharding=sharding)
    return jax.tree_util.tree_map(one, tree)


# ---- the plan: what the feeders hand it -------------------------------------------------------------------


class Plan:
    """The programs of the runs made while it is installed (``resjax.train.planning.installed(plan)``), compiled for
    ``topology``. ``cell`` names the runs that follow (an experiment's name by default). ``programs``: one
    :class:`ProgramPlan` each, in order."""

    platform = "tpu"

    def __init__(self, topology: str = "v5e:2x2", check_cpu: bool = False, verbose: bool = False):
        self.check_cpu, self.verbose = check_cpu, verbose  # verbose: a line per program as it is compiled  # lower each program's CPU twin too (ProgramPlan.cpu_flops)
        self.topology = VM_TOPOLOGIES.get(topology, topology)
        self.chip = chip_of(self.topology)
        self.devices = topology_devices(topology)
        # libtpu compiles a v4 topology for each TensorCore as a device (2 a chip, each with half its HBM): each
        # device is costed with its share of the chip's figures
        cores = len(self.devices) // max(1, len({tuple(getattr(d, "coords", (i,))) for i, d in enumerate(self.devices)}))
        if cores > 1:
            c = self.chip
            self.chip = dataclasses.replace(c, name=f"{c.name} TensorCore (1/{cores} of a chip)",
                                            peak_flops=c.peak_flops / cores, hbm_bytes=c.hbm_bytes / cores,
                                            hbm_bandwidth=c.hbm_bandwidth / cores)
        self.chips = len(self.devices)  # devices: chips, or a v4's TensorCores
        self.hosts = len({d.process_index for d in self.devices})
        self.cell = "run"
        self.programs: list[ProgramPlan] = []
        self.refusals: list[str] = []  # what the trainer would refuse before training on the chip, and why
        self._lock = threading.Lock()  # an experiment's cells may run side by side, in threads
        self._runs = 0

    def mesh(self, axis: str) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(np.asarray(self.devices), (axis,))

    def _name(self, label: str | None = None) -> str:
        self._runs += 1
        return f"{self.cell} {label}" if label else f"{self.cell} #{self._runs}"

    def _add(self, *args, twin=None, resident: int = 0, **kwargs) -> ProgramPlan:
        """Plan one program; ``resident``: bytes a chip holds beside it meanwhile (counted in its HBM)."""
        p = plan_program(*args, chip=self.chip, chips=self.chips, twin=twin if self.check_cpu else None, **kwargs)
        if resident and p.compiled:
            p.resident_bytes = float(resident)
            p.hbm_per_chip += resident
            p.hbm_fraction, p.fits = p.hbm_per_chip / self.chip.hbm_bytes, p.hbm_per_chip <= self.chip.hbm_bytes
        self.programs.append(p)
        if self.verbose:
            what = (f"{p.hbm_per_chip / 2**30:.2f} GiB of HBM a chip, {p.calls} x {_fmt_s(p.padded_s)}" if p.compiled
                    else f"FAILED: {p.error}")
            print(f"tpu_plan: [{p.cell}] {p.name}: compiled in {p.compile_s:.0f} s, {what}", flush=True)
        return p

    # the on-device feeder: Trainer.sweep
    def sweep(self, trainer, keys, hparams: dict, epochs: int, label: str | None = None):
        from resjax.train.planning import untrained

        num = int(keys.shape[0])
        rows = -(-num // self.chips) * self.chips  # Trainer.sweep repeats the last run to fill the devices
        mesh = self.mesh("seeds")
        seeds = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("seeds"))
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        run = jax.eval_shape(trainer._init_fn(), keys, hparams)  # the initial state's shapes: nothing initialised
        a_keys, a_hp, a_run = abstract(keys, seeds, rows), abstract(hparams, seeds, rows), abstract(run, seeds, rows)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        hooks = trainer.step_hook is not None or trainer.epoch_hook is not None
        layout = f"{num} runs ({rows // self.chips} per chip) over {self.chips} chips"
        with self._lock:
            cell = self._name(label)
            self._add(cell, "init", trainer._init_fn(seeds), (a_keys, a_hp), layout=layout, twin=trainer._init_fn())
            offset = len(jax.tree_util.tree_leaves((a_run, a_hp)))
            if hooks:
                program, args, values = trainer._chunk_fn(epochs), (a_run, a_hp, scalar), {offset: 0}
            else:
                program, args, values = trainer._chunk_fn(), (a_run, a_hp, scalar, scalar), {offset: 0,
                                                                                              offset + 1: epochs}
            self._add(cell, f"train ({epochs} epochs x {trainer.steps_per_epoch} steps)", program, args,
                      values=values, layout=layout, twin=program)
        run = untrained(run, epochs)
        metrics = {k: v[:num] if np.ndim(v) else v for k, v in trainer.history(run).items()}
        if hooks:
            out = jax.eval_shape(program, *args)[1]
            for name in ("step_records", "epoch_records"):
                if name in out:
                    metrics[name] = jax.tree_util.tree_map(lambda s: np.full((num, *s.shape[1:]), np.nan, s.dtype)
                                                           if jnp.issubdtype(s.dtype, jnp.floating)
                                                           else np.zeros((num, *s.shape[1:]), s.dtype), out[name])
        return run, metrics

    # the host feeder: ImageTrainer.fit
    def fit(self, trainer, keys_or_state, hparams: dict | None, epochs: int, label: str | None = None):
        from resjax.train import host
        from resjax.train.planning import untrained
        from resjax.train.state import RunState

        if isinstance(keys_or_state, RunState):  # a state to continue
            run = trainer.extend_history(keys_or_state)
            hparams = trainer.run_hparams(run, hparams)
        else:  # the initial state's shapes: nothing initialised
            from resjax.train.core import seed_handles

            keys, data_seeds, seeded = seed_handles(keys_or_state, None, trainer.config.train.get("seed", 0))
            hparams = trainer.check_hparams(hparams, keys.shape[0] if seeded else None)
            run = jax.eval_shape(trainer._compiled("init", seeded), keys, jnp.asarray(data_seeds, jnp.int32), hparams)
        mesh = self.mesh("data")
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        seeded = np.ndim(run.epoch) > 0
        num = int(np.shape(run.epoch)[0]) if seeded else 1
        done = 0 if isinstance(run.epoch, jax.ShapeDtypeStruct) else int(np.max(np.asarray(run.epoch)))
        tpu = dataclasses.replace(trainer, mesh=mesh)
        # seed_axis='auto' with several seeds: both layouts are planned and the cheaper one that fits is chosen
        auto = seeded and trainer.config.train.get("seed_axis", "auto") == "auto"
        modes = ("vmap", "loop") if auto else (host.seed_axis_mode(trainer.config) if seeded else "one seed",)
        with self._lock:
            cell = self._name(label)
            keys = jax.ShapeDtypeStruct((num,) if seeded else (), jax.random.key(0).dtype, sharding=rep)
            self._add(cell, "init", tpu._compiled("init", seeded),
                      (keys, jax.ShapeDtypeStruct((num,) if seeded else (), jnp.int32, sharding=rep),
                       abstract(hparams, rep)), layout=f"{num} seed{'s' if num > 1 else ''}",
                      twin=trainer._compiled("init", seeded))
            layouts = [self._host_steps(cell, trainer, tpu, run, hparams, epochs - done, m, num) for m in modes]
            if len(layouts) > 1:  # the rule the trainer applies on a chip (ImageTrainer.laid_out), on this plan's costs
                costs = {m: planning.LayoutCost(max(p.hbm_per_chip if p.compiled else math.inf for p in ps),
                                                self.chip.hbm_bytes, sum(p.total_s for p in ps))
                         for m, ps in zip(modes, layouts)}
                try:
                    best = layouts[modes.index(planning.choose_layout(costs, f"{cell}: the training step"))]
                except planning.NoLayoutFits as err:
                    best = layouts[0]
                    self.refusals.append(str(err))
                for ps in layouts:
                    for p in ps:
                        p.chosen = ps is best
        run = untrained(run, epochs)
        return run, trainer.history(run)

    def _host_steps(self, cell, trainer, tpu, run, hparams, epochs: int, mode: str, num: int) -> list[ProgramPlan]:
        """The training and evaluation steps of a host-fed run of ``epochs`` more epochs, its seeds stepped as
        ``mode`` says ('vmap' / 'unroll': one program for every seed; 'loop': the single-seed program per seed)."""
        from resjax.train import host

        mesh = tpu.mesh
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        seeded = mode not in ("one seed", "loop")
        if mode != "one seed":
            tpu = dataclasses.replace(tpu, config=_with_seed_axis(tpu.config, mode))
            trainer = dataclasses.replace(trainer, config=_with_seed_axis(trainer.config, mode))
        t = trainer.config.train
        lead = (num,) if seeded else ()
        one = lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], jnp.result_type(a), sharding=rep)  # noqa: E731
        state = abstract(run, rep) if seeded or mode == "one seed" else jax.tree_util.tree_map(one, run)
        call_hp = trainer._call_hparams(hparams)
        a_hp = abstract(call_hp, rep) if seeded or mode == "one seed" else jax.tree_util.tree_map(one, call_hp)
        targets = host._source_targets(trainer.train_source)
        target = np.zeros((), np.int32) if targets is None else np.asarray(targets)[0]

        def examples(n, leading):
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * len(leading)), "data"))
            return (jax.ShapeDtypeStruct((*leading, n, *trainer.example_shape), jnp.float32, sharding=sharding),
                    jax.ShapeDtypeStruct((*leading, n, *np.shape(target)), target.dtype, sharding=sharding))

        steps = epochs * trainer.steps_per_epoch
        evaluations = (sum(1 for e in range(trainer.num_epochs - epochs + 1, trainer.num_epochs + 1)
                           if trainer.evaluated(e)) if trainer.test_source is not None else 0)
        e = t.eval_batch_size
        eval_calls = evaluations * -(-trainer.test_source.num_examples // e) if evaluations else 0
        per = num if mode == "loop" else 1
        layout = (f"{num} seed{'s' if num > 1 else ''} ({mode}), batch {t.batch_size} data-parallel over "
                  f"{self.chips} chips, {self.hosts} host{'s' if self.hosts > 1 else ''}")
        x, y = examples(t.batch_size, lead)
        # looped, the other seeds' states wait in HBM beside the one stepped (as ImageTrainer.step_cost counts them)
        resident = (num - 1) * host._nbytes(state) if mode == "loop" else 0
        out = [self._add(cell, f"train step (x {steps}{f' x {num} seeds' if per > 1 else ''})",
                         tpu._compiled("step", seeded), (state, x, y, a_hp), calls=steps * per, layout=layout,
                         twin=trainer._compiled("step", seeded), resident=resident)]
        if eval_calls:
            ex, ey = examples(e, ())
            mask = jax.ShapeDtypeStruct((e,), jnp.bool_, sharding=ex.sharding)
            out.append(self._add(cell, f"eval step (x {eval_calls}{f' x {num} seeds' if per > 1 else ''})",
                                 tpu._compiled("eval", seeded), (state, a_hp, ex, ey, mask), calls=eval_calls * per,
                                 layout=layout, twin=trainer._compiled("eval", seeded), resident=resident))
        return out

    # a program of one's own
    def program(self, name: str, fn, *args, calls: int = 1, values: dict[int, int] | None = None,
                twin=None) -> ProgramPlan:
        """Plan the jitted ``fn`` on ``args`` (arrays or ``jax.ShapeDtypeStruct``; placed as given, replicated
        where they carry no sharding of the topology's)."""
        rep = jax.sharding.NamedSharding(self.mesh("x"), jax.sharding.PartitionSpec())
        args = jax.tree_util.tree_map(
            lambda a: a if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)
            and a.sharding.mesh.devices.flat[0].platform == "tpu" else abstract(a, rep), args)
        with self._lock:
            return self._add(self.cell, name, fn, args, calls=calls, values=values, twin=twin or fn)

    # the report
    def total_s(self, cell_prefix: str | None = None) -> float:
        return sum(p.total_s for p in self.programs if p.compiled and p.chosen
                   and (cell_prefix is None or p.cell.startswith(cell_prefix)))

    def rows(self) -> list[dict]:
        return [{**dataclasses.asdict(p), "total_s": p.total_s} for p in self.programs]


# ---- the experiments --------------------------------------------------------------------------------------

SIZES = ("quick", "default", "full", "paper")
#: the experiments that train (the others are analyses on the CPU: no program of theirs is a TPU's work)
TRAINING = ("degradation", "mnist1d_models", "tau_training", "path_lengths", "batchnorm_loss_surface",
            "scale_invariance", "cifar_tau", "taki_cifar")
#: the training set of the real data an experiment's synthetic stand-in takes the shape of at ``--size paper``
PAPER_EXAMPLES = {"cifar_tau": 50_000, "taki_cifar": 50_000}


def experiment_config(name: str, size: str):
    module = importlib.import_module(f"experiments.{name}")
    if size == "paper":
        config = module.get_config("full")
        if name in PAPER_EXAMPLES and config.get("data") == "real":
            config.data = "synthetic"
            config.synthetic_examples = PAPER_EXAMPLES[name]
        return module, config
    config = module.get_config(size)
    if config.get("data") == "real":  # the plan reads no data set: synthetic images of the real shapes
        config.data = "synthetic"
    return module, config


def plan_experiment(name: str, size: str, plan: Plan, settings: dict | None = None) -> dict:
    """Run experiment ``name`` at ``size`` with ``plan`` installed; its programs are added to ``plan``.
    ``settings``: config entries to set (``{'nobn_depths': (110, 1202)}``), after the size's."""
    from resjax.train import planning

    module, config = experiment_config(name, size)
    for key, value in (settings or {}).items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        if last not in node:
            raise ValueError(f"--set: {name} has no setting {key!r}")
        node[last] = value
    first = len(plan.programs)
    plan.cell, plan._runs = name, 0
    start, error = time.perf_counter(), None
    with tempfile.TemporaryDirectory() as out, planning.installed(plan):
        try:
            module.run(config, pathlib.Path(out))
        except Exception as err:  # noqa: BLE001  (after its programs: the experiment's analysis of NaN stand-ins)
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
            if len(plan.programs) == first:
                traceback.print_exc()
    mine = [p for p in plan.programs[first:] if p.chosen]  # a layout planned beside the chosen one is not run
    return {"experiment": name, "size": size, "programs": len(mine), "compiled": sum(p.compiled for p in mine),
            "fit": all(p.compiled and p.fits for p in mine), "total_s": sum(p.total_s for p in mine if p.compiled),
            "roofline_total_s": sum(p.calls * p.roofline_s for p in mine if p.compiled),
            "flops": sum(p.calls * p.flops_per_chip * plan.chips for p in mine if p.compiled),
            "plan_s": time.perf_counter() - start, "error_after_programs": error}


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.3g} s"


def report(res: dict) -> None:
    chip = res["chip"]
    print(f"\nTPU plan: {res['topology']} ({res['chips']} x {chip['name']}, {res['hosts']} host(s)), size "
          f"{res['size']}: compile-time estimates, not measured times")
    rows = [[p["cell"], p["name"] + ("" if p["chosen"] else " [not chosen]"),
             p["layout"] if not p["error"] else p["error"][:60],
             "yes" if p["compiled"] else "NO",
             f"{p['hbm_per_chip'] / 2**30:.2f}" if p["compiled"] else "-",
             f"{100 * p['hbm_fraction']:.0f}%" if p["compiled"] else "-",
             f"{p['flops_per_chip'] / 1e9:.3g}" if p["compiled"] else "-",
             f"{p['bytes_per_chip'] / 1e9:.3g}" if p["compiled"] else "-",
             f"{100 * p['lane_fill']:.0f}%" if p["compiled"] else "-", p["bound"] or "-", p["calls"],
             _fmt_s(p["padded_s"]), _fmt_s(p["total_s"])] for p in res["programs"]]
    print_table("programs (per chip, one call)", ["cell", "program", "layout", "compiled", "HBM GiB", "of HBM",
                                                   "GFLOP", "GB moved", "lane fill", "bound", "calls", "call",
                                                   "total"], rows)
    print_table("experiments", ["experiment", "programs", "compiled", "fits", "estimated time", "roofline (full lanes)",
                                "planned in", "note"],
                [[e["experiment"], e["programs"], e["compiled"], "yes" if e["fit"] else "NO", _fmt_s(e["total_s"]),
                  _fmt_s(e["roofline_total_s"]), _fmt_s(e["plan_s"]), (e["error_after_programs"] or "")[:60]]
                 for e in res["experiments"]])
    for line in res.get("refusals", []):
        print(f"refused before training on the chip: {line}")


def markdown(res: dict) -> str:
    """The two tables as Markdown, for the benchmarks page (written beside the JSON)."""
    chip = res["chip"]
    lines = [f"{res['topology']} ({res['chips']} x {chip['name']}, {res['hosts']} host(s)), size {res['size']}"
             + (f", settings {res['settings']}" if res.get("settings") else "") + f", jax {res['jax']}:", "",
             "| cell | program | layout | HBM a chip | GFLOP a chip | GB moved | lane fill | bound | calls | a call "
             "| total |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["programs"]:
        if not p["compiled"]:
            lines.append(f"| {p['cell']} | {p['name']}{'' if p['chosen'] else ' (not chosen)'} | did not compile: "
                         f"{p['error'][:80]} | | | | | | | | |")
            continue
        lines.append(f"| {p['cell']} | {p['name']}{'' if p['chosen'] else ' (not chosen)'} | {p['layout']} | "
                     f"{p['hbm_per_chip'] / 2**30:.2f} GiB "
                     f"({100 * p['hbm_fraction']:.0f}%) | {p['flops_per_chip'] / 1e9:.3g} | "
                     f"{p['bytes_per_chip'] / 1e9:.3g} | {100 * p['lane_fill']:.0f}% | {p['bound']} | {p['calls']} | "
                     f"{_fmt_s(p['padded_s'])} | {_fmt_s(p['total_s'])} |")
    lines += ["", "| experiment | programs | all compiled | all fit | estimated time | at full lanes |",
              "|---|---|---|---|---|---|"]
    for e in res["experiments"]:
        lines.append(f"| {e['experiment']} | {e['programs']} | {'yes' if e['compiled'] == e['programs'] else 'NO'} | "
                     f"{'yes' if e['fit'] else 'NO'} | {_fmt_s(e['total_s'])} | {_fmt_s(e['roofline_total_s'])} |")
    if res.get("refusals"):
        lines += ["", "Refused before training on the chip (no layout fits):", ""]
        lines += [f"- {line}" for line in res["refusals"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:2x2", help="a TPU topology (v5e:2x2, v5e:4x4, v4:2x2x1, ...) or a VM "
                                                         f"name ({', '.join(VM_TOPOLOGIES)})")
    p.add_argument("--experiment", default="all", help=f"comma-separated experiments, or 'all' ({', '.join(TRAINING)})")
    p.add_argument("--size", default="default", choices=SIZES)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an experiment setting to change, e.g. --set 'nobn_depths=(110, 1202)' (a Python literal)")
    p.add_argument("--out", default=None, help="JSON (default runs/tpu_plan/<topology>-<size>.json)")
    args = p.parse_args(argv)
    names = TRAINING if args.experiment == "all" else tuple(n.strip() for n in args.experiment.split(",") if n.strip())
    for n in names:
        if n not in TRAINING:
            p.error(f"--experiment: {n!r} is not a training experiment; choose from {', '.join(TRAINING)}")
    settings = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            p.error(f"--set: want KEY=VALUE, got {item!r}")
        try:
            settings[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            settings[key.strip()] = value.strip()
    plan = Plan(args.topology, verbose=True)
    out = args.out or f"runs/tpu_plan/{plan.topology.replace(':', '-')}-{args.size}.json"
    start = time.perf_counter()
    experiments = [plan_experiment(n, args.size, plan, settings) for n in names]
    res = {"topology": plan.topology, "chips": plan.chips, "hosts": plan.hosts, "chip": dataclasses.asdict(plan.chip),
           "size": args.size, "settings": {k: repr(v) for k, v in settings.items()}, "jax": jax.__version__, "experiments": experiments, "programs": plan.rows(), "refusals": plan.refusals,
           "wall_s": time.perf_counter() - start}
    report(res)
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=float))
    path.with_suffix(".md").write_text(markdown(res))
    print(f"\nwrote {path} and {path.with_suffix('.md')}")
    return res


if __name__ == "__main__":
    main()
