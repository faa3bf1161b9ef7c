"""Compile-only runs: while a planner is installed, ``Trainer.sweep`` and ``ImageTrainer.fit`` hand it their
programs instead of running them (``benchmarks.tpu_plan`` compiles them for a TPU topology on a machine with none).

A planner is any object with two methods, called where the two feeders would start training:

- ``sweep(trainer, keys, hparams, epochs, label) -> (run, metrics)``: an on-device sweep of the runs ``keys`` (``(S,)``
  typed PRNG keys) with ``hparams`` (checked, one value per run) for ``epochs`` epochs;
- ``fit(trainer, run, hparams, epochs, label) -> (run, history)``: a host-fed ``fit`` of the initial state ``run``.

``label``: the call's ``progress`` label (an experiment's cell name), or None.

Each returns what the call would (a stand-in: :func:`untrained`), so the code around the call (an experiment's
cells, a grid) goes on and hands the planner its next programs. Nothing is checkpointed, logged or trained while a
planner is installed. ``with installed(planner): ...`` installs one for the block (one at a time per process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["CHIPS", "Chip", "LayoutCost", "active", "backend", "chip_of", "choose_layout", "compiled_cost", "installed",
           "NoLayoutFits", "out_of_memory", "untrained"]

_active: list = []


def active() -> Any:
    """The installed planner, or None (training runs as usual)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def installed(planner: Any) -> Iterator[Any]:
    """Install ``planner`` for the block: the feeders' sweeps and fits hand it their programs (module docstring)."""
    if _active:
        raise RuntimeError("a planner is installed already: one at a time")
    _active.append(planner)
    try:
        yield planner
    finally:
        _active.pop()


def backend() -> str:
    """The platform the programs being built are for: the installed planner's ``platform`` ('tpu'), else JAX's
    default backend. The rules that choose a layout by platform (the host feeder's ``seed_axis='auto'``, a grid's
    ``pack='auto'``, the experiments' ``scan='auto'``) ask this, so a plan builds what the chip would run."""
    planner = active()
    platform = getattr(planner, "platform", None)
    if platform:
        return platform
    import jax

    return jax.default_backend()


def untrained(run: Any, epochs: int) -> Any:
    """The stand-in result of a planned run, from its initial state ``run`` (arrays, or ``jax.ShapeDtypeStruct``
    from ``jax.eval_shape``: nothing is initialised then): zeros where ``run`` is abstract, its history NaN (nothing
    was measured), nothing diverged and ``epochs`` epochs counted as done, so a caller's bookkeeping sees a finished
    run."""
    import jax
    import numpy as np

    def value(a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, a)
            return jax.random.wrap_key_data(np.zeros(data.shape, data.dtype), impl=a.dtype._impl)
        return np.zeros(a.shape, a.dtype)

    run = jax.tree_util.tree_map(value, run)
    history = {k: np.full(np.shape(v), np.nan, np.asarray(v).dtype) for k, v in run.history.items()}
    return run._replace(epoch=np.full(np.shape(run.epoch), epochs, np.int32),
                        diverged_epoch=np.full(np.shape(run.diverged_epoch), -1, np.int32), history=history)


# ---- the chips, and choosing a layout from compiled programs ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip's published figures (one chip as Cloud TPU sells it)."""

    name: str
    peak_flops: float  # bfloat16 dense matmul, FLOP/s per chip
    hbm_bytes: float  # HBM per chip
    hbm_bandwidth: float  # bytes/s per chip
    lanes: int  # the matrix unit's width (output features per pass)
    source: str
    kinds: tuple = ()  # how JAX names its devices (``device.device_kind``)


#: Google Cloud's published per-chip figures (the pages "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" of
#: cloud.google.com/tpu/docs, read 2026-12-07).
CHIPS = {
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1200e9, 128, "cloud.google.com/tpu/docs/v4", ("TPU v4",)),
    "v5e": Chip("TPU v5e", 197e12, 16 * 2**30, 819e9, 128, "cloud.google.com/tpu/docs/v5e",
                ("TPU v5 lite", "TPU v5e")),
    "v5p": Chip("TPU v5p", 459e12, 95 * 2**30, 2765e9, 128, "cloud.google.com/tpu/docs/v5p", ("TPU v5", "TPU v5p")),
    "v6e": Chip("TPU v6e", 918e12, 32 * 2**30, 1640e9, 256, "cloud.google.com/tpu/docs/v6e",
                ("TPU v6 lite", "TPU v6e")),
}


def chip_of(device: Any) -> Chip | None:
    """The figures of ``device``'s chip (a JAX device, or its ``device_kind``), or None for a chip not in
    :data:`CHIPS` (a GPU, the CPU)."""
    kind = getattr(device, "device_kind", device)
    for chip in CHIPS.values():
        if kind in chip.kinds:
            return chip
    return None


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """One layout's compiled program: ``needed`` bytes of device memory (arguments, outputs and temporaries, less
    what outputs alias) against the device's ``limit``; ``seconds`` for one call of it (a roofline: the larger of
    FLOPs / peak and bytes / bandwidth); ``calls`` per training step of every seed (the looped layout calls its
    single-seed program once per seed)."""

    needed: float
    limit: float
    seconds: float
    calls: int = 1

    @property
    def fits(self) -> bool:
        """Whether the program's memory fits the device's (``needed <= limit``)."""
        return self.needed <= self.limit

    @property
    def step_seconds(self) -> float:
        """The estimated seconds of one training step of every seed: ``calls`` calls of ``seconds`` each."""
        return self.calls * self.seconds


def compiled_cost(compiled: Any, device: Any, calls: int = 1) -> LayoutCost:
    """The :class:`LayoutCost` of a compiled program on ``device`` (a JAX device), from XLA's own analyses:
    ``memory_analysis()`` for the memory it needs, ``cost_analysis()`` for its FLOPs and bytes accessed (a loop's
    body counted once: compare layouts whose loops are alike, as the seeds' layouts of one step are), timed by the
    chip's figures (:data:`CHIPS`; a device not in it is timed by its bytes at 1 byte/s: the layouts' order, not a
    time). The memory limit is the device's own (``memory_stats()['bytes_limit']``), else the chip's HBM."""
    mem = compiled.memory_analysis()
    needed = sum(float(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp"))
    needed -= float(getattr(mem, "alias_size_in_bytes", 0) or 0)
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    work, moved = float(cost.get("flops", 0.0) or 0.0), float(cost.get("bytes accessed", 0.0) or 0.0)
    chip = chip_of(device)
    limit = math.inf
    try:
        stats = device.memory_stats() or {}
        limit = float(stats.get("bytes_limit", math.inf))
    except Exception:  # noqa: BLE001  (compile-only devices, the CPU: no memory statistics)
        pass
    if chip is not None:
        limit = min(limit, chip.hbm_bytes)
        seconds = max(work / chip.peak_flops, moved / chip.hbm_bandwidth)
    else:
        seconds = moved
    return LayoutCost(needed, limit, seconds, calls)


#: the sizes in XLA:TPU's out-of-memory refusal ("... the total memory required for HLO temporaries (80.00G) exceeds
#: available HBM (15.75G)"; older: "Used 27.85G of 15.75G hbm")
_OOM = (re.compile(r"\(([\d.]+)\s*([KMGT]?)i?B?\)\s+exceeds available HBM\s+\(([\d.]+)\s*([KMGT]?)i?B?\)", re.I),
        re.compile(r"Used\s+([\d.]+)\s*([KMGT]?)i?B?\s+of\s+([\d.]+)\s*([KMGT]?)i?B?\s+hbm", re.I))
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory(err: BaseException) -> tuple[float, float] | None:
    """``(bytes needed, bytes the device has)`` when ``err`` is a compiler's refusal of a program for want of device
    memory (XLA's ``RESOURCE_EXHAUSTED``; sizes read from its message, ``inf`` / ``0`` where it gives none), else
    None."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    m = next((m for m in (p.search(text) for p in _OOM) if m), None)
    if m is None:
        return math.inf, 0.0
    return (float(m.group(1)) * _UNIT[m.group(2).upper()], float(m.group(3)) * _UNIT[m.group(4).upper()])


class NoLayoutFits(ValueError):
    """No layout of a run's programs fits the device's memory (raised before training)."""


def refused(err: BaseException, what: str, fix: str) -> BaseException:
    """``err`` as :class:`NoLayoutFits` naming ``what`` and ``fix`` when it is the compiler's out-of-memory
    refusal (``out_of_memory``), else ``err`` itself (to re-raise)."""
    sizes = out_of_memory(err)
    if sizes is None:
        return err
    needed, limit = sizes
    return NoLayoutFits(f"{what} does not fit the device's memory (it needs {needed / 2**30:.2f} GiB, the device has "
                        f"{limit / 2**30:.2f} GiB): {fix}")


def choose_layout(costs: dict[str, LayoutCost], what: str = "the training step", fix: str = "") -> str:
    """The layout (a key of ``costs``) whose programs fit the device and cost least a step (``step_seconds``; ties:
    the first). None fits: :class:`NoLayoutFits`, one line naming what each needs and ``fix``."""
    fitting = [k for k, c in costs.items() if c.fits]
    if fitting:
        return min(fitting, key=lambda k: costs[k].step_seconds)
    limit = min(c.limit for c in costs.values())
    if len(costs) == 1:
        needs = f"it needs {next(iter(costs.values())).needed / 2**30:.2f} GiB"
    else:
        needs = "in no layout: " + ", ".join(f"{k} needs {c.needed / 2**30:.2f} GiB" for k, c in costs.items())
    raise NoLayoutFits(f"{what} does not fit the device's {limit / 2**30:.2f} GiB of memory ({needs})"
                       + (f": {fix}" if fix else ""))
