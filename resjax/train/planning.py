"""Compile-only runs: while a planner is installed, ``Trainer.sweep`` and ``ImageTrainer.fit`` hand it their
programs instead of running them (``benchmarks.tpu_plan`` compiles them for a TPU topology on a machine with none).

A planner is any object with two methods, called where the two feeders would start training:

- ``sweep(trainer, keys, hparams, epochs) -> (run, metrics)``: an on-device sweep of the runs ``keys`` (``(S,)``
  typed PRNG keys) with ``hparams`` (checked, one value per run) for ``epochs`` epochs;
- ``fit(trainer, run, hparams, epochs) -> (run, history)``: a host-fed ``fit`` of the initial state ``run``.

Each returns what the call would (a stand-in: :func:`untrained`), so the code around the call (an experiment's
cells, a grid) goes on and hands the planner its next programs. Nothing is checkpointed, logged or trained while a
planner is installed. ``with installed(planner): ...`` installs one for the block (one at a time per process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

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
    """The stand-in result of a planned run: ``run`` (its initial state) with ``epochs`` epochs counted as done, its
    history NaN (nothing was measured) and nothing diverged, so a caller's bookkeeping sees a finished run."""
    return run._replace(epoch=jnp.full_like(run.epoch, epochs))
