"""The one training config: ``train_config()`` and its checks.

Both feeders (``make_train``: on-device, the whole run a ``lax.scan``; ``make_image_train``: batches from
a host data source) read the same nested ``config.train``, an ``ml_collections.ConfigDict`` with these
fields:

  optimizer          'sgd' (with ``momentum`` > 0: heavy ball; with ``nesterov``: Nesterov) | 'momentum' |
                     'nesterov' | 'adam' (PyTorch's rules) | any optax optimiser by name ('adamw', 'lamb',
                     'lars', 'lion', 'rmsprop', ...; ``resjax.train.optim``)
  optimizer_args     dict: an optax optimiser's other arguments (``dict(b2=0.95)``)
  learning_rate      the base rate (a per-seed ``hparams`` value may replace it inside one program)
  momentum, nesterov SGD momentum ``buf = momentum * buf + g`` (PyTorch's, no dampening)
  adam_b1, adam_b2, adam_eps
  weight_decay       coupled L2, ``g + weight_decay * w`` (PyTorch's ``weight_decay``; per-seed in ``hparams``)
  weight_decay_on    'all' (PyTorch's default: every parameter) | 'kernels' (Dense/Conv kernels only; the
                     lecture's L2 penalty on weights)
  scalar_lr_factor   learning-rate factor for 0-d parameters (Fixup, SkipInit, a learnable tau)
  param_groups       tuple of parameter-group rules or preset names ('tau_resnet', 'fixup'): per-group
                     learning-rate and weight-decay factors by path pattern or rank (``resjax.train.optim``)
  grad_clip_norm     global-norm clipping; 0 = off
  loss               the objective by name: 'cross_entropy' (default) | 'mse' (``resjax.train.objective``; a loss of
                     your own is the trainers' ``loss=`` argument)
  label_smoothing    the cross-entropy's label smoothing in [0, 1) (a traced value: ``hparams`` may vary it per run)
  schedule           'constant' | 'step' | 'cosine' | 'fixup' | an optax schedule's name with ``schedule_args``;
                     ``milestones``, ``decay_factor``, ``warmup_epochs`` (see ``resjax.train.schedules``)
  batch_size, epochs, eval_batch_size (host feeder: evaluation batches; the on-device feeder evaluates whole sets
                     and refuses any other value than the default)
  steps              0 (default): the run is ``epochs`` epochs; > 0: the run is this many minibatch steps
                     instead (a step run; both feeders), ``epochs`` unused (see "Step runs" below)
  eval_every_steps   a step run's evaluation period: evaluate after every k-th step and after the last; 0
                     (default): once, after the last step. ``steps`` must be a multiple of it
  eval_every         evaluate after every k-th epoch and after the last (default 1: every epoch); the history's
                     evaluation entries (train_error, test_loss, test_error) are NaN at the epochs in between. The
                     training is the same; on-device, an evaluation then runs inside a branch, compiled apart:
                     error counts equal an every-epoch run's, the loss to float32 rounding
  augment            host feeder: the data source's augmentation (the on-device feeder refuses True)
  shuffle            True (default): a fresh order of the training set every epoch; False: the examples in their
                     stored order every epoch, the same batches on both feeders (the MNIST-1D reference recipe)
  checkpoint_every   epochs between checkpoints (on-device: chunks are cut there); 0 = only at the end
  checkpoint_keep    how many checkpoints to keep
  seed               the first seed when seeds are given as a count
  seed_axis          how several seeds are stepped by the host feeder: 'auto' | 'vmap' | 'unroll' | 'loop'
                     (on-device runs always vmap: it refuses 'unroll' and 'loop')

``train_config()`` holds the lecture's MNIST-1D setup (plain SGD at 0.005, batch 100, 300 epochs, no
weight decay); ``image_train_config()`` the CIFAR ResNet recipe of He et al. as the tau-ResNet repository
runs it. They are the same fields with other values.

Step runs (``steps > 0``): the run is ``steps`` minibatch steps in periods of ``eval_every_steps`` (``period``:
``step_periods``); the machinery that counts epochs in an epoch run (the history, ``metrics.jsonl``,
checkpoints, ``checkpoint_every``, chunks, resume, progress) counts these periods instead: history entry ``i``
is the period that ends at step ``(i + 1) * period`` (``metrics.jsonl`` rows carry that ``step``), and a
checkpoint's step number is the steps done. Minibatch ``s`` (0-based) is batch ``s mod (N // batch_size)`` of
data epoch ``s // (N // batch_size)``: with ``shuffle`` (default) of that epoch's permutation
``fold_in(key, epoch)`` (so a step run of whole epochs with ``eval_every_steps`` one epoch is the epoch run,
bit for bit), with ``shuffle=False`` of the examples in their stored order (the fixed batch order of the MNIST-1D
reference recipe, as in an epoch run with ``shuffle=False``). Settings that count epochs
are refused in a step run (``ValueError`` naming them): ``eval_every`` other than 1, a ``'step'``/``'fixup'``
or ``'cosine'`` schedule, ``milestones``, ``warmup_epochs``; an optax schedule by name counts steps and is
allowed. Both feeders run step runs: the on-device feeder draws step ``s``'s batch as above; the host feeder reads
the data epochs a period touches from its source (its own order of each ``(seed, epoch)``; ``shuffle=False``: the
stored order) and takes the period's batches of them, so a SIGTERM inside a period saves and resumes there, as
inside an epoch.

Which feeder honours what. Every setting above means the same on both feeders (the optimiser, its schedule and
parameter groups, the loss, the batch size, epochs or steps, the evaluation period, ``shuffle``, checkpoints and
the seed) except three that only the host feeder has, which the on-device feeder refuses by name before anything
is traced (``ValueError`` saying what to use instead: ``resjax.train.ondevice.check_on_device_settings``):
``augment=True`` (it trains on the arrays as they are), ``seed_axis`` 'unroll' or 'loop' (its seeds are always one
vmapped program) and an ``eval_batch_size`` other than the default (it evaluates the whole training and test sets
at once). With ``shuffle=False`` both feeders take the same batches in the same order: batch ``b`` of every epoch
is examples ``[b * batch_size, (b + 1) * batch_size)`` of the stored order, the last partial batch dropped.

``check_train_config`` refuses every float setting that is not a finite number (NaN, +-inf: ``ValueError``
naming ``train.<setting>``) before any range check, since NaN passes every ``< 0`` test.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
import numpy as np

from resjax.train.objective import LOSSES
from resjax.train.optim import check_optimizer
from resjax.train.schedules import check_schedule

__all__ = ["DICT_SETTINGS", "EVAL_BATCH_SIZE", "step_periods", "FLOAT_SETTINGS", "MAX_STEPS", "SEED_AXIS_MODES",
           "check_finite_settings", "check_step_count", "check_train_config", "image_train_config", "is_int",
           "is_number", "train_config"]

#: The default ``train.eval_batch_size``: the host feeder's evaluation batches (the on-device feeder, which evaluates
#: whole sets at once, takes no other value: ``resjax.train.ondevice.check_on_device_settings``).
EVAL_BATCH_SIZE = 1000

#: The values of ``train.seed_axis``: how the host feeder steps several seeds (``seed_axis_mode``).
SEED_AXIS_MODES = ("auto", "vmap", "unroll", "loop")


def train_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The training settings (see the module docstring); defaults: the lecture's MNIST-1D setup."""
    c = ml_collections.ConfigDict()
    c.optimizer = "sgd"
    c.optimizer_args = ml_collections.ConfigDict()
    c.learning_rate = 0.005
    c.momentum = 0.0
    c.nesterov = False
    c.adam_b1 = 0.9
    c.adam_b2 = 0.999
    c.adam_eps = 1e-8
    c.weight_decay = 0.0
    c.weight_decay_on = "kernels"
    c.scalar_lr_factor = 1.0
    c.param_groups = ()
    c.grad_clip_norm = 0.0
    c.loss = "cross_entropy"
    c.label_smoothing = 0.0
    c.schedule = "constant"
    c.schedule_args = ml_collections.ConfigDict()
    c.milestones = ()
    c.decay_factor = 0.1
    c.warmup_epochs = 0.0
    c.batch_size = 100
    c.eval_batch_size = EVAL_BATCH_SIZE
    c.epochs = 300
    c.eval_every = 1
    c.steps = 0
    c.eval_every_steps = 0
    c.augment = False
    c.shuffle = True
    c.checkpoint_every = 10
    c.checkpoint_keep = 2
    c.seed = 0
    c.seed_axis = "auto"
    for name, value in overrides.items():
        if name not in c:
            raise ValueError(f"train.{name}: unknown setting; known: {sorted(c.keys())}")
        c[name] = tuple(value) if isinstance(value, list) else value
    c.lock()  # a misspelt setting (config.train.lr = 0.5) raises instead of being ignored
    for name in DICT_SETTINGS:  # an optax function's arguments stay open (config.train.optimizer_args.b2 = 0.95)
        c[name].unlock()
    return c


#: The dict-valued settings of ``train_config`` (each a ``ConfigDict`` of an optax function's arguments).
DICT_SETTINGS = ("optimizer_args", "schedule_args")


def image_train_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The CIFAR ResNet recipe of He et al. as the tau-ResNet repository runs it: SGD with momentum 0.9,
    batch 128, learning rate 0.1 divided by 10 at epochs 100 and 150 of 200, weight decay 1e-4 on every
    parameter, flips and crops."""
    base = dict(learning_rate=0.1, momentum=0.9, weight_decay=1e-4, weight_decay_on="all", schedule="step",
                milestones=(100, 150), batch_size=128, epochs=200, augment=True)
    return train_config(**{**base, **overrides})


def is_int(v: Any) -> bool:
    """Whether ``v`` is an integer (Python or numpy), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


#: The float settings of ``train_config``: each must be a finite number (NaN and +-inf refused).
FLOAT_SETTINGS = ("learning_rate", "momentum", "adam_b1", "adam_b2", "adam_eps", "weight_decay", "scalar_lr_factor",
                  "grad_clip_norm", "decay_factor", "warmup_epochs", "label_smoothing")


def is_number(v: Any) -> bool:
    """Whether ``v`` is a real number (Python or numpy int or float), not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_finite_settings(c: ml_collections.ConfigDict) -> None:
    """Raise ``ValueError`` naming ``train.<setting>`` when a float setting (``FLOAT_SETTINGS``) or a
    milestone is not a finite number: NaN passes every ``< 0`` test, so this runs before the range checks."""
    for name in FLOAT_SETTINGS:
        if name in c:
            v = c[name]
            if not is_number(v) or not math.isfinite(v):
                raise ValueError(f"train.{name}: must be a finite number, got {v!r}")
    milestones = c.get("milestones", ())
    if milestones is not None:
        try:
            values = list(milestones)
        except TypeError:
            values = [milestones]
        if not all(is_number(v) and math.isfinite(v) for v in values):
            raise ValueError(f"train.milestones: must be finite numbers (epochs), got {milestones!r}")


def check_train_config(c: ml_collections.ConfigDict) -> None:
    """Raise ``ValueError`` naming the first bad setting of a ``train_config``: every float setting must be
    finite (``train.learning_rate: must be a finite number, got nan``), then each setting's range."""
    check_finite_settings(c)
    for name in ("batch_size", "eval_batch_size", "epochs", "eval_every"):
        v = c.get(name, 1 if name == "eval_every" else None)  # a config made before eval_every: every epoch
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    check_step_settings(c)
    v = c.get("checkpoint_every", 0)
    if not is_int(v) or v < 0:
        raise ValueError(f"checkpoint_every: must be an integer >= 0, got {v!r}")
    v = c.get("checkpoint_keep", 2)
    if v is not None and (not is_int(v) or v < 1):
        raise ValueError(f"checkpoint_keep: must be an integer >= 1 or None, got {v!r}")
    v = c.get("seed", 0)
    if not is_int(v) or not 0 <= v < 2**31:
        raise ValueError(f"seed: must be an integer in [0, 2**31), got {v!r}")
    lr = c.get("learning_rate")
    if lr is None or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"learning_rate: must be a finite number >= 0, got {lr!r}")
    mode = c.get("seed_axis", "auto")
    if mode not in SEED_AXIS_MODES:
        raise ValueError(f"seed_axis: unknown value {mode!r}; choose one of {SEED_AXIS_MODES}")
    v = c.get("loss", "cross_entropy")
    if v not in LOSSES:
        raise ValueError(f"train.loss: unknown loss {v!r}; choose one of {sorted(LOSSES)} (a loss of your own is the "
                         "trainers' loss= argument: make_train(config, data, loss=fn))")
    v = c.get("label_smoothing", 0.0)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"train.label_smoothing: must be in [0, 1), got {v!r}")
    check_optimizer(c)
    check_schedule(c, 1)  # names and ranges (an unknown schedule is refused here, not when the optimiser is built)


def step_periods(c: Any) -> tuple[int, int] | None:
    """A step run's ``(periods, period)``: ``steps // period`` evaluation periods of ``period =
    eval_every_steps or steps`` steps; ``None`` for an epoch run (``steps`` 0 or absent)."""
    steps = c.get("steps", 0)
    if not steps:
        return None
    period = c.get("eval_every_steps", 0) or steps
    return steps // period, period


def check_step_settings(c: Any) -> None:
    """``ValueError`` naming the setting: ``steps`` and ``eval_every_steps`` integers >= 0, ``eval_every_steps``
    only in a step run and dividing ``steps``, and in a step run no setting that counts epochs (see the module
    docstring)."""
    steps, every = c.get("steps", 0), c.get("eval_every_steps", 0)
    for name, v in (("steps", steps), ("eval_every_steps", every)):
        if not is_int(v) or v < 0:
            raise ValueError(f"train.{name}: must be an integer >= 0, got {v!r}")
    if not steps:
        if every:
            raise ValueError(f"train.eval_every_steps: {every} is for a step run (train.steps > 0); an epoch run "
                             "evaluates every train.eval_every epochs")
        return
    if every and steps % every:
        raise ValueError(f"train.eval_every_steps: {every} does not divide train.steps={steps}; the run is whole "
                         "evaluation periods")
    if steps > MAX_STEPS:
        raise ValueError(f"train.steps: {steps} is more than the int32 step counter holds ({MAX_STEPS})")
    if c.get("eval_every", 1) != 1:
        raise ValueError(f"train.eval_every: {c.get('eval_every')} counts epochs; a step run (train.steps={steps}) "
                         "evaluates every train.eval_every_steps steps")
    if c.get("schedule", "constant") in ("step", "fixup", "cosine"):
        raise ValueError(f"train.schedule: {c.get('schedule')!r} counts epochs; a step run (train.steps={steps}) "
                         "takes 'constant' or an optax schedule by name (its arguments in steps)")
    if c.get("milestones", ()):
        raise ValueError("train.milestones: count epochs; a step run has none")
    if c.get("warmup_epochs", 0.0):
        raise ValueError("train.warmup_epochs: counts epochs; a step run has none (an optax schedule by name "
                         "counts steps)")


#: The optimiser's step counter is an int32: a run of more steps would wrap it.
MAX_STEPS = 2**31 - 1


def check_step_count(epochs: int, steps_per_epoch: int) -> None:
    """``ValueError`` naming ``epochs`` when ``epochs * steps_per_epoch`` training steps would overflow the int32
    step counter (``MAX_STEPS``): ``--train.epochs 1000000000000`` is refused with the reason, not run."""
    if epochs * steps_per_epoch > MAX_STEPS:
        raise ValueError(f"epochs: {epochs} epochs of {steps_per_epoch} steps is {epochs * steps_per_epoch:.3g} "
                         f"steps, more than the int32 step counter holds ({MAX_STEPS})")
