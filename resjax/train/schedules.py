"""Learning-rate schedules for epoch-based image training: ``make_schedule(config, steps_per_epoch)``.

Every schedule is a pure function of the optimiser step (an ``optax.Schedule``), so a resumed run sees
exactly the learning rates an unstopped one would. Settings read from the config:

  learning_rate   the peak (base) learning rate
  schedule        'constant' | 'step' | 'cosine'
  milestones      'step': epochs at which the rate is multiplied by ``decay_factor`` (the CIFAR ResNet
                  recipe: (100, 150) of 200 epochs, He et al. and the tau-ResNet repository)
  decay_factor    'step': the factor (default 0.1)
  epochs          'cosine': the rate falls to 0 at the end of ``epochs`` (the whole run, warm-up included)
  warmup_epochs   linear warm-up length in epochs (may be fractional; 0 = none)

Choices: a milestone counts whole epochs, ``step >= milestone * steps_per_epoch``, so epoch ``milestone``
(0-based) is the first at the lower rate, as PyTorch's ``MultiStepLR`` stepped once per epoch does.
Warm-up multiplies the schedule by ``min(1, (step + 1) / warmup_steps)``, so the first step already moves
the weights and step ``warmup_steps - 1`` is at the full rate; ``warmup_steps`` is
``round(warmup_epochs * steps_per_epoch)`` (at least 1 when ``warmup_epochs > 0``). 'cosine' starts its
half-period after the warm-up and reaches 0 at the run's last step boundary.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

__all__ = ["SCHEDULES", "check_schedule", "make_schedule"]

#: The values of ``train.schedule``.
SCHEDULES = ("constant", "step", "cosine")


def _get(config, name, default):
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def check_schedule(config: Any, steps_per_epoch: int) -> None:
    """Raise ``ValueError`` naming the first bad schedule setting of ``config`` (a ``train_config``, or any
    mapping or object with its fields) or a bad ``steps_per_epoch``."""
    name = _get(config, "schedule", "constant")
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {name!r}; choose one of {SCHEDULES}")
    if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch: must be an integer >= 1, got {steps_per_epoch!r}")
    lr = _get(config, "learning_rate", None)
    if lr is None or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning_rate: must be a finite number >= 0, got {lr!r}")
    warmup = _get(config, "warmup_epochs", 0.0)
    if warmup is None or not math.isfinite(warmup) or warmup < 0:
        raise ValueError(f"warmup_epochs: must be >= 0, got {warmup!r}")
    if name == "step":
        factor = _get(config, "decay_factor", 0.1)
        if factor is None or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"decay_factor: must be >= 0, got {factor!r}")
        milestones = tuple(_get(config, "milestones", ()))
        if any(m is None or not math.isfinite(m) or m < 0 for m in milestones):
            raise ValueError(f"milestones: every milestone must be an epoch >= 0, got {milestones}")
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones: must be increasing, got {milestones}")
    if name == "cosine":
        epochs = _get(config, "epochs", None)
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: must be an integer >= 1, got {epochs!r}")
        if warmup >= epochs:
            raise ValueError(f"warmup_epochs: {warmup} leaves no cosine phase in {epochs} epochs")


def make_schedule(config: Any, steps_per_epoch: int, learning_rate: ArrayLike | None = None) -> optax.Schedule:
    """The learning rate as a function of the step (see the module docstring). ``learning_rate`` (default
    ``config.learning_rate``) may be a traced value: the optimiser passes the per-seed rate it holds in its
    state, so one program trains seeds at different rates on the same schedule."""
    check_schedule(config, steps_per_epoch)
    name = _get(config, "schedule", "constant")
    lr = float(_get(config, "learning_rate", None)) if learning_rate is None else learning_rate
    warmup_epochs = float(_get(config, "warmup_epochs", 0.0))
    warmup_steps = max(1, round(warmup_epochs * steps_per_epoch)) if warmup_epochs > 0 else 0

    if name == "constant":
        def base(step):
            return jnp.broadcast_to(jnp.asarray(lr, jnp.float32), jnp.shape(step))
    elif name == "step":
        factor = float(_get(config, "decay_factor", 0.1))
        boundaries = [round(m * steps_per_epoch) for m in _get(config, "milestones", ())]

        def base(step):
            passed = sum((step >= b).astype(jnp.int32) for b in boundaries) if boundaries else jnp.zeros_like(step)
            return lr * jnp.power(jnp.float32(factor), passed.astype(jnp.float32))
    else:  # cosine
        total = int(_get(config, "epochs", None)) * steps_per_epoch
        span = max(1, total - warmup_steps)

        def base(step):
            t = jnp.clip((step - warmup_steps).astype(jnp.float32) / span, 0.0, 1.0)
            return 0.5 * lr * (1.0 + jnp.cos(jnp.pi * t))

    def schedule(step):
        step = jnp.asarray(step, jnp.int32)
        value = base(step)
        if warmup_steps:
            value = value * jnp.minimum(1.0, (step + 1).astype(jnp.float32) / warmup_steps)
        return value.astype(jnp.float32)

    return schedule
