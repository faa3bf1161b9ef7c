"""Optimisers for image training: ``make_optimizer(config, params, steps_per_epoch)``.

The update is built as one ``optax.chain`` in the order PyTorch applies it:

  1. ``grad_clip_norm > 0``: clip the gradient to that global norm (``clip_grad_norm_`` before ``step``);
  2. coupled L2 weight decay, ``g + weight_decay * w``, added to the gradient as ``torch.optim.SGD`` (and
     ``Adam``) do with ``weight_decay`` -- not AdamW's decoupled decay. ``weight_decay_on``:
     'all' (PyTorch's default: every parameter, BatchNorm scales and biases and scalars included, as the
     tau-ResNet and Fixup repositories train) or 'kernels' (only leaves named ``kernel``);
  3. 'sgd': momentum ``buf = momentum * buf + g`` (no dampening), the update ``buf`` or with
     ``nesterov`` ``g + momentum * buf``, exactly ``torch.optim.SGD``; 'adam': ``optax.scale_by_adam``
     with ``adam_b1``, ``adam_b2``, ``adam_eps`` (PyTorch's Adam);
  4. times the learning-rate schedule (``resjax.train.schedules``), and for scalar parameters (0-d leaves:
     Fixup's scalar biases and multiplier, SkipInit's alpha, a learnable tau) additionally times
     ``scalar_lr_factor`` (1.0 by default; the Fixup and tau-ResNet repositories use 0.1).

Scalars and kernels are told apart per leaf by masks that are functions of the parameter tree, so the
same transformation works inside ``jax.vmap`` over seeds. For plain SGD one step is
``w <- w - lr * f * (g + wd * w)`` with ``f`` the scalar factor (1 for non-scalars).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

from resjax.train.schedules import _get, check_schedule, make_schedule

__all__ = ["OPTIMIZERS", "WEIGHT_DECAY_ON", "check_optimizer", "kernel_mask", "make_optimizer", "scalar_mask"]

#: The values of ``train.optimizer``.
OPTIMIZERS = ("sgd", "adam")
#: The values of ``train.weight_decay_on``.
WEIGHT_DECAY_ON = ("all", "kernels")


def kernel_mask(params: Any) -> Any:
    """True for leaves named ``kernel`` (Dense and Conv weights)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def scalar_mask(params: Any) -> Any:
    """True for 0-d leaves (Fixup scalars, SkipInit alpha, learnable tau)."""
    return jax.tree_util.tree_map(lambda p: p.ndim == 0, params)


def check_optimizer(config: Any) -> None:
    """Raise ``ValueError`` naming the first bad optimiser setting of ``config`` (a ``train_config``, or any
    mapping or object with its fields)."""
    name = _get(config, "optimizer", "sgd")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    momentum = _get(config, "momentum", 0.9)
    if name == "sgd" and not (momentum is not None and 0 <= momentum < 1):
        raise ValueError(f"momentum: must be in [0, 1), got {momentum!r}")
    if name == "sgd" and _get(config, "nesterov", False) and not momentum:
        raise ValueError("nesterov: needs momentum > 0")
    for field in ("weight_decay", "grad_clip_norm"):
        v = _get(config, field, 0.0)
        if v is None or not math.isfinite(v) or v < 0:
            raise ValueError(f"{field}: must be a finite number >= 0, got {v!r}")
    f = _get(config, "scalar_lr_factor", 1.0)
    if f is None or not math.isfinite(f) or f < 0:
        raise ValueError(f"scalar_lr_factor: must be a finite number >= 0, got {f!r}")
    on = _get(config, "weight_decay_on", "all")
    if on not in WEIGHT_DECAY_ON:
        raise ValueError(f"weight_decay_on: unknown choice {on!r}; choose one of {WEIGHT_DECAY_ON}")
    if name == "adam":
        for field, default in (("adam_b1", 0.9), ("adam_b2", 0.999)):
            v = _get(config, field, default)
            if not 0 <= v < 1:
                raise ValueError(f"{field}: must be in [0, 1), got {v!r}")
        if not _get(config, "adam_eps", 1e-8) > 0:
            raise ValueError(f"adam_eps: must be > 0, got {_get(config, 'adam_eps', 1e-8)!r}")


def make_optimizer(config: Any, params: Any = None, steps_per_epoch: int = 1) -> optax.GradientTransformation:
    """The optax transformation for ``config`` (see the module docstring).

    The learning rate and the weight decay are ``optax.inject_hyperparams`` values: they live in the
    optimiser state (``opt_state.hyperparams['learning_rate' | 'weight_decay']``), start at the config's,
    and a seed-vmapped run may set them per seed (``resjax.train.core.with_hyperparams``). The rate at a step
    is ``make_schedule(config, steps_per_epoch, learning_rate)`` of the optimiser's own step count.

    ``params`` (one seed's parameter tree, or its shapes) is only checked: with ``weight_decay_on='kernels'``
    and ``weight_decay > 0`` it must hold a ``kernel``.
    """
    check_optimizer(config)
    check_schedule(config, steps_per_epoch)
    name = _get(config, "optimizer", "sgd")
    on = _get(config, "weight_decay_on", "all")
    wd = float(_get(config, "weight_decay", 0.0))
    if params is not None and wd > 0 and on == "kernels" and not any(jax.tree_util.tree_leaves(kernel_mask(params))):
        raise ValueError("weight_decay_on: 'kernels' but the model has no parameter named 'kernel'")
    clip = float(_get(config, "grad_clip_norm", 0.0))
    momentum = float(_get(config, "momentum", 0.9)) if name == "sgd" else 0.0
    nesterov = bool(_get(config, "nesterov", False))
    adam = tuple(float(_get(config, k, d)) for k, d in (("adam_b1", 0.9), ("adam_b2", 0.999), ("adam_eps", 1e-8)))
    factor = float(_get(config, "scalar_lr_factor", 1.0))

    def chain(learning_rate, weight_decay):
        parts = []
        if clip > 0:
            parts.append(optax.clip_by_global_norm(clip))
        parts.append(optax.add_decayed_weights(weight_decay, mask=kernel_mask if on == "kernels" else None))
        if name == "sgd":
            if momentum > 0:
                parts.append(optax.trace(decay=momentum, nesterov=nesterov))
        else:
            parts.append(optax.scale_by_adam(b1=adam[0], b2=adam[1], eps=adam[2]))
        parts.append(optax.scale_by_learning_rate(make_schedule(config, steps_per_epoch, learning_rate)))
        if factor != 1.0:
            parts.append(optax.masked(optax.scale(factor), scalar_mask))
        return optax.chain(*parts)

    return optax.inject_hyperparams(chain)(learning_rate=float(_get(config, "learning_rate", None)), weight_decay=wd)
