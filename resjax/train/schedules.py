"""Learning-rate schedules for epoch-based image training: ``make_schedule(config, steps_per_epoch)``.

Every schedule is a pure function of the optimiser step (an ``optax.Schedule``), so a resumed run sees
exactly the learning rates an unstopped one would. Settings read from the config:

  learning_rate   the peak (base) learning rate
  schedule        'constant' | 'step' | 'cosine' | 'fixup' | the name of any optax schedule (below)
  milestones      'step', 'fixup': epochs at which the rate is multiplied by ``decay_factor`` (the CIFAR ResNet
                  recipe: (100, 150) of 200 epochs, He et al. and the tau-ResNet repository)
  decay_factor    'step', 'fixup': the factor (default 0.1)
  epochs          'cosine': the rate falls to 0 at the end of ``epochs`` (the whole run, warm-up included)
  warmup_epochs   linear warm-up length in epochs (may be fractional; 0 = none)

Choices: a milestone counts whole epochs, ``step >= milestone * steps_per_epoch``, so epoch ``milestone``
(0-based) is the first at the lower rate, as PyTorch's ``MultiStepLR`` stepped once per epoch does.
Warm-up multiplies the schedule by ``min(1, (step + 1) / warmup_steps)``, so the first step already moves
the weights and step ``warmup_steps - 1`` is at the full rate; ``warmup_steps`` is
``round(warmup_epochs * steps_per_epoch)`` (at least 1 when ``warmup_epochs > 0``). 'cosine' starts its
half-period after the warm-up and reaches 0 at the run's last step boundary.

'fixup' is Fixup's own schedule (hongyi-zhang/Fixup ``cifar/cifar_train.py``, ``adjust_learning_rate``, called
at the start of every epoch): 'step' and, when ``learning_rate > FIXUP_WARMUP_START`` (0.1: Fixup's base rate
0.1 times ``batch / 128`` for batches over 128), a warm-up in whole epochs, epoch ``e < FIXUP_WARMUP_EPOCHS``
(10) at ``0.1 + (learning_rate - 0.1) * e / 10``. The parameter groups' factors scale it as they scale every
schedule, which is what Fixup's script does to its bias and scale groups (``initial_lr * lr / base`` in the
warm-up); with ``fixup_param_groups(batch)`` (``resjax.train.optim``; ``fixup_recipe(batch)`` gives every
setting) each group's rate equals the script's at every epoch (``tests/test_peer_training.py`` against the
script's own function, ``tools/make_parity_fixtures.py --fixup-schedule-only``). ``warmup_epochs`` must stay
0 with it (the warm-up is Fixup's).

Epochs are the trainer's: ``steps_per_epoch`` steps, the training examples it was given // ``batch_size``. Every
epoch count here (milestones, warm-up, 'cosine''s ``epochs``, 'fixup''s 10 warm-up epochs) therefore counts
epochs of the data given: on a subset of CIFAR-10, 'fixup' warms up and decays after proportionally fewer steps
than Fixup's runs on all 50,000 images.

Every other schedule is ``learning_rate`` times a multiplier of the step (big_vision's convention), so a
per-seed learning rate (``hparams``) scales the whole schedule ('fixup' too, but its warm-up starts from the
absolute rate 0.1). Beyond the built-ins:

  optax by name   ``schedule='exponential_decay'`` (or ``'linear_schedule'``, ``'cosine_onecycle_schedule'``,
                  ``'piecewise_constant_schedule'``, ``'warmup_cosine_decay_schedule'``, ...) with
                  ``schedule_args`` (its arguments, in optimiser steps). It gives the multiplier, so its
                  rate-valued arguments are relative: ``init_value``, ``peak_value`` and ``value``, when not
                  given, are 1.0 (``schedule_args=dict(transition_steps=1000, decay_rate=0.5)`` halves the
                  rate every 1000 steps).
  a function      ``make_schedule(..., schedule=fn)`` (and the trainers' ``schedule=``): ``fn(step)`` is the
                  multiplier; pass ``optax.cosine_decay_schedule(1.0, steps)``, not a schedule of rates.

``warmup_epochs`` multiplies every schedule. The rate is computed in the default float dtype: float32, or
float64 under ``jax_enable_x64`` (so a float64 run's rate is exactly 0.1, not 0.10000000149).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

__all__ = ["SCHEDULES", "check_schedule", "float_dtype", "make_schedule", "optax_schedule"]

#: The values of ``train.schedule``.
SCHEDULES = ("constant", "step", "cosine", "fixup")
#: Fixup's warm-up ('fixup'): while ``learning_rate`` exceeds ``FIXUP_WARMUP_START``, the first
#: ``FIXUP_WARMUP_EPOCHS`` epochs rise linearly, epoch by epoch, from ``FIXUP_WARMUP_START``.
FIXUP_WARMUP_START = 0.1
FIXUP_WARMUP_EPOCHS = 10


def _get(config, name, default):
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def _as_dict(value: Any) -> dict:
    """A dict setting (``ConfigDict``, mapping or None) as a plain dict."""
    if value is None:
        return {}
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def float_dtype() -> Any:
    """The default float dtype: float64 under ``jax_enable_x64``, else float32."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


#: Rate-valued arguments of optax schedules that default to 1.0 (the schedule is a multiplier).
_UNIT_ARGS = ("init_value", "peak_value", "value")


def optax_schedule(name: str, args: dict | None = None) -> optax.Schedule:
    """``optax.<name>(**args)``, with ``init_value`` / ``peak_value`` / ``value`` 1.0 when it takes them and
    they are not given; ``ValueError`` naming ``schedule`` or ``schedule_args.<arg>`` when it cannot be built."""
    fn = getattr(optax, name, None) if isinstance(name, str) and name.isidentifier() else None
    try:
        params = inspect.signature(fn).parameters if callable(fn) and name.endswith(("schedule", "decay")) else None
    except (TypeError, ValueError):
        params = None
    if params is None:
        raise ValueError(f"schedule: unknown schedule {name!r}; choose one of {SCHEDULES} or an optax schedule "
                         "('exponential_decay', 'linear_schedule', 'cosine_onecycle_schedule', ...)")
    args = _as_dict(args)
    for key in args:
        if key not in params:
            raise ValueError(f"schedule_args.{key}: optax.{name} has no argument {key!r}; its arguments: "
                             f"{', '.join(params)}")
    args = {**{k: 1.0 for k in _UNIT_ARGS if k in params}, **args}
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ValueError(f"schedule_args: optax.{name} needs {', '.join(missing)}")
    try:
        return fn(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"schedule_args: optax.{name}({args}) failed: {e}") from None


def check_schedule(config: Any, steps_per_epoch: int, warn: bool = True) -> None:
    """Raise ``ValueError`` naming the first bad schedule setting of ``config`` (a ``train_config``, or any
    mapping or object with its fields) or a bad ``steps_per_epoch``. ``warn``: warn of milestones at or past the
    run's end (a trainer checks its config once with it, then builds its optimiser without)."""
    name = _get(config, "schedule", "constant")
    if name not in SCHEDULES:
        optax_schedule(name, _get(config, "schedule_args", None))
    elif _as_dict(_get(config, "schedule_args", None)):
        raise ValueError(f"schedule_args: the built-in schedule {name!r} takes its settings from train.milestones, "
                         "decay_factor, warmup_epochs; schedule_args is for optax's schedules")
    if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch: must be an integer >= 1, got {steps_per_epoch!r}")
    lr = _get(config, "learning_rate", None)
    if lr is None or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning_rate: must be a finite number >= 0, got {lr!r}")
    warmup = _get(config, "warmup_epochs", 0.0)
    if warmup is None or not math.isfinite(warmup) or warmup < 0:
        raise ValueError(f"warmup_epochs: must be >= 0, got {warmup!r}")
    if name == "fixup" and warmup > 0:
        raise ValueError(f"warmup_epochs: the 'fixup' schedule has Fixup's own warm-up (epochs 0-"
                         f"{FIXUP_WARMUP_EPOCHS - 1} from {FIXUP_WARMUP_START}); leave warmup_epochs at 0, "
                         f"got {warmup}")
    if name in ("step", "fixup"):
        factor = _get(config, "decay_factor", 0.1)
        if factor is None or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"decay_factor: must be >= 0, got {factor!r}")
        milestones = tuple(_get(config, "milestones", ()))
        if any(m is None or not math.isfinite(m) or m < 0 for m in milestones):
            raise ValueError(f"milestones: every milestone must be an epoch >= 0, got {milestones}")
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones: must be increasing, got {milestones}")
        epochs = _get(config, "epochs", None)
        late = [m for m in milestones if isinstance(epochs, int) and m >= epochs]
        if late and warn:  # image_train_config(epochs=3) keeps He et al.'s (100, 150): the rate would never fall
            warnings.warn(f"milestones: {tuple(late)} at or past the run's epochs={epochs}; the learning rate will "
                          "not fall there (set train.milestones for this run's length)", stacklevel=3)
    if name == "cosine":
        epochs = _get(config, "epochs", None)
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: must be an integer >= 1, got {epochs!r}")
        if warmup >= epochs:
            raise ValueError(f"warmup_epochs: {warmup} leaves no cosine phase in {epochs} epochs")


def make_schedule(config: Any, steps_per_epoch: int, learning_rate: ArrayLike | None = None,
                  schedule: Callable | None = None) -> optax.Schedule:
    """The learning rate as a function of the step (see the module docstring). ``learning_rate`` (default
    ``config.learning_rate``) may be a traced value: the optimiser passes the per-seed rate it holds in its
    state, so one program trains seeds at different rates on the same schedule. ``schedule``: a multiplier
    function of the step that replaces ``config.schedule``."""
    check_schedule(config, steps_per_epoch)
    if schedule is not None and not callable(schedule):
        raise ValueError(f"schedule: must be a function of the step (a multiplier), got {schedule!r}")
    name = _get(config, "schedule", "constant")
    dtype = float_dtype()
    lr = float(_get(config, "learning_rate", None)) if learning_rate is None else learning_rate
    lr = jnp.asarray(lr, dtype) if isinstance(lr, float) else lr
    warmup_epochs = float(_get(config, "warmup_epochs", 0.0))
    warmup_steps = max(1, round(warmup_epochs * steps_per_epoch)) if warmup_epochs > 0 else 0

    if schedule is not None or name not in SCHEDULES:
        multiplier = schedule if schedule is not None else optax_schedule(name, _get(config, "schedule_args", None))

        def base(step):
            return lr * jnp.asarray(multiplier(step), dtype)
    elif name == "constant":
        def base(step):
            return jnp.broadcast_to(jnp.asarray(lr, dtype), jnp.shape(step))
    elif name in ("step", "fixup"):
        factor = float(_get(config, "decay_factor", 0.1))
        boundaries = [round(m * steps_per_epoch) for m in _get(config, "milestones", ())]

        def decayed(rate, step):
            passed = sum((step >= b).astype(jnp.int32) for b in boundaries) if boundaries else jnp.zeros_like(step)
            return rate * jnp.power(jnp.asarray(factor, dtype), passed.astype(dtype))

        if name == "step":
            def base(step):
                return decayed(lr, step)
        else:
            def base(step):  # Fixup's adjust_learning_rate(optimizer, epoch), epoch = the step's
                epoch = (step // steps_per_epoch).astype(dtype)
                start = jnp.asarray(FIXUP_WARMUP_START, dtype)
                warm = start + (lr - start) * epoch / FIXUP_WARMUP_EPOCHS
                return decayed(jnp.where((epoch < FIXUP_WARMUP_EPOCHS) & (lr > start), warm, lr), step)
    else:  # cosine
        total = int(_get(config, "epochs", None)) * steps_per_epoch
        span = max(1, total - warmup_steps)

        def base(step):
            t = jnp.clip((step - warmup_steps).astype(dtype) / span, 0.0, 1.0)
            return 0.5 * lr * (1.0 + jnp.cos(jnp.pi * t))

    def rate(step):
        step = jnp.asarray(step, jnp.int32)
        value = base(step)
        if warmup_steps:
            value = value * jnp.minimum(1.0, (step + 1).astype(dtype) / warmup_steps)
        return value.astype(dtype)

    return rate
