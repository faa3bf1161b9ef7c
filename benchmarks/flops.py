"""Dense FLOPs of the XLA programs a process executes, and the seconds it spends compiling them: the counter behind
the FLOP ledger of ``python -m benchmarks.reproduce``.

    python -m benchmarks.flops LEDGER.json [experiments.reproduce's arguments]

runs ``experiments.reproduce.main`` with the counter installed and writes what it counted to ``LEDGER.json``
(also when the run fails; not after a stop signal, which ends an experiment's process at once). In a process of
your own: ``with FlopCounter() as c: ...`` then ``c.summary()``.

How FLOPs are counted: from the compiled programs, each time one runs. Every program JAX executes goes through
``pxla.ExecuteReplicated.__call__`` (jit, AOT ``.lower().compile()``, eager operations); the counter wraps it. The
first time a program runs, its optimised HLO (``hlo_modules()`` of the loaded executable: what XLA runs, after
fusion and dead-code elimination) is read once and its dense FLOPs worked out:

- a ``dot`` is ``2 * (elements of its output) * (product of the lhs contracting dimensions)`` (``2 m n k`` for a
  matmul; batch dimensions are in the output), a ``convolution`` ``2 * (elements of its output) * (elements of
  its kernel) / (kernel output features)`` (a multiply and an add per kernel entry that reaches an output
  element; padding counted as computed);
- nothing else is counted: elementwise operations, reductions, normalisation, the optimiser, random numbers,
  gathers (so the count understates the arithmetic done, as a matmul-peak fraction should);
- fusions and calls count their computations once; a ``while`` loop (``lax.scan``, ``fori_loop``) its body times
  its trip count: XLA's ``known_trip_count`` when XLA found it, else the loop's own test (an induction variable
  from a constant start by a constant step, compared with a constant or with an argument of the program, which
  is read when the program runs: ``fori_loop(0, n, ...)`` with ``n`` an argument, as resjax's chunked training
  runs). A loop whose count cannot be worked out is counted once and reported (``unresolved_loop_executions``
  in the summary); a ``conditional`` counts its most expensive branch (``conditional_executions``);
- a program that runs on D devices (sharded or replicated) counts D times its per-device program.

Why not XLA's ``cost_analysis()``: on XLA:CPU (jaxlib 0.10.2) it counts a while loop's body once, whatever its
trip count (a ``lax.scan`` of 10 matmuls reports the FLOPs of one; checked in
``tests/test_benchmark_reproduce.py``), and it adds elementwise operations. For a bare matmul the two agree.

Checked (``tests/test_benchmark_reproduce.py``): a jitted matmul run k times counts ``k * 2 n^3``; a scan of 7, a
``fori_loop`` whose trip count is an argument and a scan inside such a loop count their bodies 7, n and 3n
times, compiled with and without XLA's optimisation passes; convolutions and their kernel gradients; a program
sharded over two devices counts as the same program on one. On a real run: ``experiments.degradation --quick``
(five MLPs, 2 seeds sharded over 2 devices, 2 epochs in chunks whose length is an argument) counted
60.471877632 GFLOP, exactly ``(6 K - 2 K_1) x 3968`` trained and ``2 K x 5000`` evaluated examples per seed and
epoch summed over the cells (K the dense kernel entries of one seed, K_1 the first layer's, whose input gradient
is not computed). ``taki_cifar --quick``'s training step (unrolled convolutions, 8x8 kernels, no loop) counts
19.38 GFLOP a device against ``cost_analysis()``'s 17.07 (which leaves out the products with padding and adds
elementwise work).

Accelerators: there XLA turns dots and convolutions into library calls (custom calls such as cuBLAS's), which
this count does not read (``custom_calls`` in the summary lists those seen); it is meant for XLA:CPU, where they
stay HLO instructions.

The cost of counting: a program with dense FLOPs no longer takes jit's C++ dispatch path (it would run without
passing through Python), so each of its calls pays Python dispatch: about 70 microseconds a call here (a jitted
4x4 matmul: 6 us a call without the counter, 75 us with it); programs without dense FLOPs (most eager operations)
keep the fast path. Reading a program's HLO costs once per program (``analysis_s`` in the summary: 0.13 s for the
491 programs of ``resnet_signal --quick``). On the quick experiments tried, the wall times with and without the
counter differed by less than their run-to-run spread.

Compile seconds are JAX's own ``jax.monitoring`` durations: ``/jax/core/compile/backend_compile_duration`` (XLA
compiling a program, or loading it from the persistent compilation cache), with the tracing
(``jaxpr_trace_duration``) and lowering (``jaxpr_to_mlir_module_duration``) durations reported beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import sys
import threading
import time
import weakref

import numpy as np

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

# ---- the HLO text of a compiled program ------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
_DIMS = re.compile(r"^\w+\[([^\]]*)\]")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")  # an integer scalar keeps its value through these
_CALLS = re.compile(r"\b(calls|to_apply|condition|body|true_computation|false_computation)=%?([^\s,{}]+)")
_LISTS = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str

    def attr_int(self, key: str) -> int | None:
        m = re.search(rf"\b{key}=(-?\d+)", self.attrs)
        return int(m.group(1)) if m else None

    def called(self) -> dict[str, list[str]]:
        """``{role: [computation, ...]}`` of the computations this instruction calls."""
        out: dict[str, list[str]] = {}
        for role, name in _CALLS.findall(self.attrs):
            out.setdefault(role, []).append(name)
        for role, names in _LISTS.findall(self.attrs):
            out.setdefault(role, []).extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
        return out


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instrs: dict[str, Instr]
    root: str


def _close(text: str, start: int) -> int:
    """The index after the bracket that closes ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


def _instr(line: str) -> tuple[bool, Instr]:
    line = _COMMENT.sub("", line).strip()
    root = line.startswith("ROOT ")
    name, _, rest = line[5 if root else 0:].partition(" = ")
    rest = rest.lstrip()
    if rest.startswith("("):
        end = _close(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if m is None:
        raise ValueError(f"not an HLO instruction: {line[:120]!r}")
    end = _close(rest, m.end() - 1)
    operands = [tok.split()[-1].lstrip("%") for tok in _split_top(rest[m.end():end - 1])]
    return root, Instr(name.strip().lstrip("%"), shape, m.group(1), operands, rest[end:])


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    comps, current = {}, None
    for line in text.splitlines():
        if not line.strip():
            continue
        if current is None:
            if line.startswith("HloModule") or not line.rstrip().endswith("{"):
                continue
            entry = line.startswith("ENTRY")
            name = re.match(r"^(?:ENTRY\s+)?%?([^\s(){}]+)", line).group(1)
            current = Computation(name, entry, {}, "")
        elif line.strip() == "}":
            comps[current.name] = current
            current = None
        else:
            root, ins = _instr(line)
            current.instrs[ins.name] = ins
            if root:
                current.root = ins.name
    return comps


def dims(shape: str) -> list[int]:
    m = _DIMS.match(shape)
    if m is None:
        raise ValueError(f"not an array shape: {shape!r}")
    return [int(d.strip().lstrip("<=")) for d in m.group(1).split(",") if d.strip()]


def dot_flops(comp: Computation, ins: Instr) -> int:
    lhs = dims(comp.instrs[ins.operands[0]].shape)
    m = re.search(r"lhs_contracting_dims=\{([^}]*)\}", ins.attrs)
    k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d.strip()) if m else 1
    return 2 * math.prod(dims(ins.shape)) * k


def conv_flops(comp: Computation, ins: Instr) -> int:
    kernel = dims(comp.instrs[ins.operands[1]].shape)
    labels = re.search(r"dim_labels=([^,\s]+)", ins.attrs).group(1)  # e.g. b01f_01io->b01f
    out_features = kernel[labels.split("_")[1].split("->")[0].index("o")]
    return 2 * math.prod(dims(ins.shape)) * math.prod(kernel) // out_features


# ---- a program's dense FLOPs: a constant, plus loops whose trip counts are read when it runs -------------------


@dataclasses.dataclass(frozen=True)
class Trip:
    """A loop's trip count from its start, step and bound, each a constant or an argument of the program."""
    init: tuple
    bound: tuple
    step: int
    inclusive: bool  # i <= bound

    def count(self, args) -> int | None:
        start, stop = _value(self.init, args), _value(self.bound, args)
        if start is None or stop is None:
            return None
        if self.inclusive:
            stop += 1 if self.step > 0 else -1
        return max(0, -((start - stop) // self.step) if self.step > 0 else -((stop - start) // -self.step))


def _value(source: tuple, args) -> int | None:
    kind, v = source
    if kind == "const":
        return v
    if args is None or v >= len(args):
        return None
    try:
        return int(np.asarray(args[v]))
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass
class Cost:
    """``const + sum(trips * body) + sum(max(branches))`` FLOPs."""
    const: float = 0.0
    loops: list = dataclasses.field(default_factory=list)     # (Trip, Cost)
    choices: list = dataclasses.field(default_factory=list)   # [Cost, ...]

    def zero(self) -> bool:
        return self.const == 0 and not self.loops and not self.choices

    def add(self, other: Cost, times: int = 1) -> None:
        self.const += times * other.const
        if times == 1:
            self.loops += other.loops
            self.choices += other.choices
        elif other.loops or other.choices:
            self.loops.append((Trip(("const", 0), ("const", times), 1, False), Cost(0.0, other.loops, other.choices)))

    def flops(self, args, misses: list) -> float:
        total = self.const
        for trip, body in self.loops:
            n = trip.count(args)
            if n is None:
                misses.append(trip)
                n = 1
            total += n * body.flops(args, misses) if n else 0.0
        for branches in self.choices:
            total += max(b.flops(args, misses) for b in branches)
        return total


class Program:
    """The dense FLOPs of one compiled program (its optimised HLO text), per device, for given arguments.

    Subclasses count another cost over the same traversal (loops by their trip counts, a conditional's largest
    branch): ``own(comp, ins)`` is an instruction's own cost, and the computations called by the opcodes in
    ``DESCEND`` are counted into their caller (``benchmarks.tpu_plan``'s HBM bytes and MXU-padded FLOPs)."""

    #: opcodes whose called computations are counted into the caller's cost (a fusion's instructions, a call's)
    DESCEND = ("fusion", "call", "custom-call", "async-start")
    DESCEND_ASYNC = True  # also every other ``*-start`` (an asynchronous op's wrapped computation)

    def own(self, comp: Computation, ins: Instr) -> float:
        """The dense FLOPs of the instruction itself (a dot's or a convolution's; 0 for anything else)."""
        if ins.opcode == "dot":
            return dot_flops(comp, ins)
        if ins.opcode == "convolution":
            return conv_flops(comp, ins)
        return 0

    def __init__(self, text: str):
        self.comps = parse_module(text)
        self.callers: dict[str, list[tuple[str, Instr, str]]] = {}
        for comp in self.comps.values():
            for ins in comp.instrs.values():
                for role, names in ins.called().items():
                    for name in names:
                        self.callers.setdefault(name, []).append((comp.name, ins, role))
        self.unresolved_loops = 0
        self.conditionals = 0
        self.custom_calls: dict[str, int] = {}
        self._memo: dict[str, Cost] = {}
        entry = [c for c in self.comps.values() if c.entry]
        self.cost = self._cost(entry[0].name) if entry else Cost()
        self.dynamic = bool(self.cost.loops or self.cost.choices)

    def flops(self, args=None) -> tuple[float, int]:
        """(FLOPs per device, loops whose trip count could not be read from ``args``, counted once)."""
        if not self.dynamic:
            return self.cost.const, 0
        misses: list = []
        return self.cost.flops(args, misses), len(misses)

    def _cost(self, name: str) -> Cost:
        if name in self._memo:
            return self._memo[name]
        self._memo[name] = Cost()  # a computation reached again while it is being costed: no recursion in HLO
        comp, cost = self.comps[name], Cost()
        for ins in comp.instrs.values():
            op, called = ins.opcode, ins.called()
            if op not in ("while", "conditional"):
                cost.const += self.own(comp, ins)
            if op == "while":
                body = Cost()
                body.add(self._cost(called["body"][0]))
                body.add(self._cost(called["condition"][0]))
                if body.zero():
                    continue
                trip = self._trip(comp, ins)
                if isinstance(trip, int):
                    cost.add(body, trip)
                elif trip is None:
                    self.unresolved_loops += 1
                    cost.add(body)
                else:
                    cost.loops.append((trip, body))
            elif op == "conditional":
                branches = [self._cost(b) for role in ("branch_computations", "true_computation",
                                                       "false_computation") for b in called.get(role, [])]
                if any(not b.zero() for b in branches):
                    self.conditionals += 1
                    cost.choices.append(branches)
            elif op in self.DESCEND or (self.DESCEND_ASYNC and op.endswith("-start")):
                if op == "custom-call":
                    m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
                    target = m.group(1) if m else "?"
                    self.custom_calls[target] = self.custom_calls.get(target, 0) + 1
                for role in ("calls", "to_apply", "called_computations"):
                    for sub in called.get(role, []):
                        cost.add(self._cost(sub))
        self._memo[name] = cost
        return cost

    # -- a while loop's trip count ---------------------------------------------------------------------------

    def _trip(self, comp: Computation, loop: Instr):
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
        if m:
            return int(m.group(1))
        called = loop.called()
        cond, body = self.comps[called["condition"][0]], self.comps[called["body"][0]]
        test = self._elementwise(cond, cond.root)
        if test is None or test[1].opcode != "compare":
            return None
        where, compare = test
        direction = re.search(r"direction=(\w+)", compare.attrs)
        sides = [self._element(where, operand) for operand in compare.operands]
        if direction is None or None in sides:
            return None
        direction = direction.group(1)
        for k in (0, 1):
            iv = sides[k]
            if iv[0] != "elem":
                continue
            step = self._step(body, iv[1])
            if step is None:
                continue
            d = direction if k == 0 else {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction)
            if (d in ("LT", "LE") and step <= 0) or (d in ("GT", "GE") and step >= 0) or d not in ("LT", "LE", "GT",
                                                                                                      "GE"):
                return None
            other = sides[1 - k]
            init = self._resolve(comp.name, loop.operands[0], (iv[1],))
            if other[0] == "elem":
                bound = self._resolve(comp.name, loop.operands[0], (other[1],)) if self._invariant(body, other[1]) \
                    else None
            else:
                bound = other
            if init is None or bound is None:
                return None
            trip = Trip(init, bound, step, d in ("LE", "GE"))
            return trip.count(None) if init[0] == bound[0] == "const" else trip
        return None

    def _elementwise(self, comp: Computation, name: str):
        """``(computation, instruction)`` computing ``name``: through a fusion to its fused root."""
        ins = comp.instrs.get(name)
        while ins is not None and ins.opcode == "fusion":
            sub = self.comps[ins.called()["calls"][0]]
            comp, ins = sub, sub.instrs.get(sub.root)
        return None if ins is None else (comp, ins)

    def _element(self, comp: Computation, name: str):
        """``('elem', j)`` for element j of the loop's state (``get-tuple-element`` of a loop computation's
        parameter), ``('const', v)`` for an integer constant, through copies and fusion parameters; else None."""
        for _ in range(64):
            ins = comp.instrs.get(name)
            if ins is None:
                return None
            if ins.opcode in _PASS_THROUGH:
                name = ins.operands[0]
            elif ins.opcode == "constant":
                try:
                    return ("const", int(ins.operands[0]))
                except (IndexError, ValueError):
                    return None
            elif ins.opcode == "get-tuple-element":
                source = comp.instrs.get(ins.operands[0])
                if source is None or source.opcode != "parameter" or not any(
                        role in ("body", "condition") for _, _, role in self.callers.get(comp.name, [])):
                    return None
                return ("elem", ins.attr_int("index"))
            elif ins.opcode == "parameter":  # of a fusion: the fusion's operand in its caller
                callers = self.callers.get(comp.name, [])
                if len(callers) != 1 or callers[0][2] != "calls":
                    return None
                caller, fusion, _ = callers[0]
                comp, name = self.comps[caller], fusion.operands[int(ins.operands[0])]
            else:
                return None
        return None

    def _step(self, body: Computation, j: int) -> int | None:
        """The constant the loop body adds to element j of the state, or None."""
        root = body.instrs.get(body.root)
        if root is None or root.opcode != "tuple" or j >= len(root.operands):
            return None
        name = root.operands[j]
        while body.instrs.get(name) is not None and body.instrs[name].opcode in _PASS_THROUGH:
            name = body.instrs[name].operands[0]
        found = self._elementwise(body, name)
        if found is None or found[1].opcode not in ("add", "subtract"):
            return None
        where, op = found
        sides = [self._element(where, o) for o in op.operands]
        if sides[0] == ("elem", j) and sides[1] is not None and sides[1][0] == "const":
            return sides[1][1] if op.opcode == "add" else -sides[1][1]
        if op.opcode == "add" and sides[1] == ("elem", j) and sides[0] is not None and sides[0][0] == "const":
            return sides[0][1]
        return None

    def _invariant(self, body: Computation, j: int) -> bool:
        """Whether the loop body passes element j of its state through unchanged."""
        root = body.instrs.get(body.root)
        if root is None or root.opcode != "tuple" or j >= len(root.operands):
            return False
        ins = body.instrs.get(root.operands[j])
        while ins is not None and ins.opcode in ("copy", "bitcast"):
            ins = body.instrs.get(ins.operands[0])
        return (ins is not None and ins.opcode == "get-tuple-element" and ins.attr_int("index") == j
                and body.instrs[ins.operands[0]].opcode == "parameter")

    def _resolve(self, name: str, value: str, path: tuple = (), depth: int = 0):
        """``('const', v)`` or ``('param', k)`` (parameter k of the entry computation) that the integer scalar
        ``value`` of computation ``name``, indexed by the tuple ``path``, always equals; else None."""
        comp = self.comps[name]
        ins = comp.instrs.get(value)
        if ins is None or depth > 64:
            return None
        op = ins.opcode
        if op in _PASS_THROUGH:
            return self._resolve(name, ins.operands[0], path, depth + 1)
        if op == "get-tuple-element":
            return self._resolve(name, ins.operands[0], (ins.attr_int("index"), *path), depth + 1)
        if op == "tuple":
            return self._resolve(name, ins.operands[path[0]], path[1:], depth + 1) if path else None
        if op == "constant":
            try:
                return None if path else ("const", int(ins.operands[0]))
            except (IndexError, ValueError):
                return None
        if op != "parameter":
            return None
        k = int(ins.operands[0])
        if comp.entry:
            return None if path else ("param", k)
        callers = self.callers.get(name, [])
        if len(callers) != 1:
            return None
        caller, call, role = callers[0]
        if role in ("calls", "to_apply"):
            return self._resolve(caller, call.operands[k], path, depth + 1)
        if role in ("body", "condition") and path:
            loop_body = self.comps[call.called()["body"][0]]
            if self._invariant(loop_body, path[0]):
                return self._resolve(caller, call.operands[0], path, depth + 1)
        return None


def hlo_text(xla_executable) -> str:
    """The optimised HLO of a loaded executable, without metadata, with backend configs (trip counts)."""
    from jax._src.lib import hlo

    options = hlo.HloPrintOptions.short_parsable()
    options.print_metadata = False
    options.print_backend_config = True
    return "\n".join(m.to_string(options) for m in xla_executable.hlo_modules())


# ---- the counter ----------------------------------------------------------------------------------------


class FlopCounter:
    """Counts the dense FLOPs of every program executed, and compile seconds, while installed (a context manager;
    one at a time). ``summary()`` is what was counted."""

    _active: FlopCounter | None = None

    def __init__(self):
        self._lock = threading.Lock()
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ExecuteReplicated -> entry
        self._by_executable: dict[int, tuple] = {}  # id(xla_executable) -> (weakref to ExecuteReplicated, entry)
        self.flops = 0.0
        self.programs = 0
        self.dense_executions = 0
        self.unresolved_executions = 0
        self.conditional_executions = 0
        self.compile_s = self.trace_s = self.lower_s = 0.0
        self.compiles = self.cache_hits = 0
        self.by_name: dict[str, list] = {}  # program name -> [executions, flops]
        self.custom_calls: dict[str, int] = {}
        self.failed_analyses = 0
        self.analysis_s = 0.0
        self._saved = None

    # -- install / uninstall --

    def __enter__(self) -> FlopCounter:
        import jax
        import jax.monitoring
        from jax._src.interpreters import pxla

        if FlopCounter._active is not None:
            raise RuntimeError("a FlopCounter is installed already")
        # programs that ran before keep their entries in jit's C++ dispatch caches, which run them without
        # Python: emptied, so that every program runs through the counter at least once
        jax.clear_caches()
        FlopCounter._active = self
        original_call, original_fastpath = pxla.ExecuteReplicated.__call__, pxla.MeshExecutableFastpathData
        counter = self

        def call(er, *args):
            counter._count(er, args)
            return original_call(er, *args)

        def fastpath(xla_executable, *rest, **kw):
            # the C++ dispatch path runs a program without Python: only for programs with no dense FLOPs
            entry = counter._entry_of(xla_executable)
            if entry is None or entry["program"] is None or entry["program"].dynamic or entry["program"].cost.const:
                return None
            return original_fastpath(xla_executable, *rest, **kw)

        pxla.ExecuteReplicated.__call__ = call
        pxla.MeshExecutableFastpathData = fastpath
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        self._saved = (original_call, original_fastpath)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring
        from jax._src.interpreters import pxla

        pxla.ExecuteReplicated.__call__, pxla.MeshExecutableFastpathData = self._saved
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
        FlopCounter._active = None

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            self.compile_s += seconds
            self.compiles += 1
        elif event == TRACE:
            self.trace_s += seconds
        elif event == LOWER:
            self.lower_s += seconds

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            self.cache_hits += 1

    # -- counting --

    def _entry_of(self, xla_executable):
        found = self._by_executable.get(id(xla_executable))
        if found is None:
            return None
        er = found[0]()
        return found[1] if er is not None and er.xla_executable is xla_executable else None

    def _analyse(self, er) -> dict:
        start = time.perf_counter()
        try:
            program = Program(hlo_text(er.xla_executable))
        except Exception:  # noqa: BLE001  (a program this parser cannot read: counted as 0, reported)
            program = None
            self.failed_analyses += 1
        entry = {"program": program, "devices": len(er._local_devices), "offset": len(er.ordered_effects)}
        if program is not None:
            for target, n in program.custom_calls.items():
                self.custom_calls[target] = self.custom_calls.get(target, 0) + n
        key = id(er.xla_executable)
        ref = weakref.ref(er, lambda r, key=key: self._by_executable.pop(key, None)
                          if self._by_executable.get(key, (None,))[0] is r else None)
        self._by_executable[key] = (ref, entry)
        self._programs[er] = entry
        self.programs += 1
        self.analysis_s += time.perf_counter() - start
        return entry

    def _count(self, er, args) -> None:
        with self._lock:
            entry = self._programs.get(er)
            if entry is None:
                entry = self._analyse(er)
            program = entry["program"]
            if program is None or (not program.dynamic and not program.cost.const):
                return
            if program.dynamic:
                kept = [x for i, x in enumerate(args) if i in er.kept_var_idx]
                flops, misses = program.flops([None] * entry["offset"] + kept)
            else:
                flops, misses = program.cost.const, 0
            flops *= entry["devices"]
            self.flops += flops
            self.dense_executions += 1
            self.unresolved_executions += bool(misses or program.unresolved_loops)
            self.conditional_executions += bool(program.conditionals)
            row = self.by_name.setdefault(er.name, [0, 0.0])
            row[0] += 1
            row[1] += flops

    def summary(self, top: int = 8) -> dict:
        """What was counted: ``flops``; ``programs`` (programs executed, each counted once) and
        ``dense_executions`` (executions of those with dense FLOPs); loops counted once
        (``unresolved_loop_executions``: executions of programs with one) and conditionals (their largest branch);
        compile, tracing and lowering seconds; the ``top`` programs by FLOPs."""
        programs = sorted(self.by_name.items(), key=lambda kv: -kv[1][1])[:top]
        return {"flops": self.flops, "programs": self.programs, "dense_executions": self.dense_executions,
                "unresolved_loop_executions": self.unresolved_executions,
                "conditional_executions": self.conditional_executions,
                "compile_s": self.compile_s, "compiles": self.compiles, "compilation_cache_hits": self.cache_hits,
                "trace_s": self.trace_s, "lower_s": self.lower_s, "unreadable_programs": self.failed_analyses,
                "analysis_s": self.analysis_s,
                "custom_calls": dict(self.custom_calls),
                "top_programs": {name: {"executions": n, "flops": f} for name, (n, f) in programs}}


def main(argv=None) -> int:
    """``python -m benchmarks.flops LEDGER.json [experiments.reproduce's arguments]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    ledger, rest = pathlib.Path(argv[0]), argv[1:]
    from experiments import reproduce

    status = 0
    counter = FlopCounter()
    try:
        with counter:
            reproduce.main(rest)
    except SystemExit as stop:  # a stopped or failed run: its status, and what it had counted
        status = stop.code if isinstance(stop.code, int) else 1
    finally:
        ledger.parent.mkdir(parents=True, exist_ok=True)
        ledger.write_text(json.dumps(counter.summary(), indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
