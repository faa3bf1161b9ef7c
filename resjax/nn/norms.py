"""One factory for every normalisation: flax.linen's own layers, chosen by name.

``make_norm(kind, train=..., name=...)`` returns a layer to call on ``x``:

- ``none``: the identity (no variables);
- ``batch``: ``nn.BatchNorm`` over the batch (and spatial) axes, with running estimates in the
  ``batch_stats`` collection: minibatch statistics when ``train=True``, the running estimates otherwise;
- ``layer``: ``nn.LayerNorm`` over the features of each example;
- ``group``: ``nn.GroupNorm`` (``num_groups`` groups of channels per example);
- ``instance``: ``nn.InstanceNorm`` over the spatial axes of each channel of each example (needs a
  spatial axis, so not for MLPs).

BatchNorm defaults follow PyTorch, where the lecture's numbers come from: ``epsilon=1e-5`` and running
estimates ``m <- (1 - rho) m + rho m_batch`` with rho = 0.1. Flax's ``momentum`` is 1 - rho, so the
default here is ``momentum=0.9`` (flax's own default, 0.99, is rho = 0.01). Flax stores the biased
(population) batch variance in the running estimate; PyTorch stores the unbiased one.

Under ``jax.vmap`` over seeds, BatchNorm must not be given an ``axis_name`` equal to the vmapped
axis's name: that would pool statistics across seeds. resjax never names its seed axis.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn

NORMS = ("none", "batch", "layer", "group", "instance")

BATCHNORM_DEFAULTS = {"momentum": 0.9, "epsilon": 1e-5}


def _identity(x, *args, **kwargs):
    return x


def make_norm(kind: str | Callable, *, train: bool, name: str | None = None, **overrides: Any) -> Callable:
    """A normalisation layer of the given kind (or ``kind(name=name, **overrides)`` if it is callable).

    Must be called inside a ``@nn.compact`` method: the returned layer is bound to that module.
    """
    if callable(kind):
        return kind(name=name, **overrides)
    if kind == "none":
        return _identity
    if kind == "batch":
        kwargs = {**BATCHNORM_DEFAULTS, **overrides}
        return nn.BatchNorm(use_running_average=not train, name=name, **kwargs)
    if kind == "layer":
        return nn.LayerNorm(name=name, **{"epsilon": 1e-5, **overrides})
    if kind == "group":
        return nn.GroupNorm(name=name, **{"num_groups": 32, "epsilon": 1e-5, **overrides})
    if kind == "instance":
        return nn.InstanceNorm(name=name, **{"epsilon": 1e-5, **overrides})
    raise ValueError(f"norm: unknown normalisation {kind!r}; choose one of {NORMS} or pass a callable")


def check_norm(kind: str | Callable) -> None:
    """Raise the ``make_norm`` error for an unknown name, at module construction."""
    if not callable(kind) and kind not in NORMS:
        raise ValueError(f"norm: unknown normalisation {kind!r}; choose one of {NORMS} or pass a callable")
