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
from collections.abc import Iterator
from typing import Any

__all__ = ["active", "backend", "installed", "untrained"]

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
