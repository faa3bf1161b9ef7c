"""One factory for every normalisation: flax.linen's own layers, chosen by name.

``make_norm(kind, train=..., name=...)`` returns a layer to call on ``x``:

- ``none``: the identity (no variables);
- ``batch``: ``nn.BatchNorm`` over the batch (and spatial) axes, with running estimates in the
  ``batch_stats`` collection: minibatch statistics when ``train=True``, the running estimates otherwise;
- ``layer``: ``nn.LayerNorm`` over the features of each example;
- ``group``: ``nn.GroupNorm`` (``num_groups`` groups of channels per example; by default the largest divisor
  of the channels up to 32, ``default_groups``, so any channel count works);
- ``instance``: ``nn.InstanceNorm`` over the spatial axes of each channel of each example (needs a
  spatial axis, so not for MLPs).

BatchNorm defaults follow PyTorch, where the lecture's numbers come from: ``epsilon=1e-5`` and running
estimates ``m <- (1 - rho) m + rho m_batch`` with rho = 0.1. Flax's ``momentum`` is 1 - rho, so the
default here (``make_norm('batch')`` and the ``BatchNorm`` class itself) is ``momentum=0.9`` (flax's own
default, 0.99, is rho = 0.01). Flax stores the biased
(population) batch variance in the running estimate; PyTorch stores the unbiased one (times n/(n-1), n the
values per channel in the batch). ``running_variance='unbiased'`` (a ``BatchNorm`` field, also
``make_norm('batch', running_variance='unbiased')``; ``UnbiasedBatchNorm`` is the class with it set, to pass
as a model's ``norm``) keeps PyTorch's: both normalise by the biased batch variance in training, and only the
running estimate differs, so weights imported from PyTorch then give its evaluation outputs *and* its next
training update at once (``resjax.interop``). The default, ``'biased'``, is flax's.

Under ``jax.vmap`` over seeds, BatchNorm must not be given an ``axis_name`` equal to the vmapped
axis's name: that would pool statistics across seeds. resjax never names its seed axis.

Which axes supply the statistics (flax is channels-last: the lecture's ``(B, C, H, W)`` is flax's
``(B, H, W, C)``; see ``resjax.analysis.batchnorm.reduction_axes``): ``batch`` reduces over every axis but
the channels (B, H, W); ``layer`` over the last axis only by default (flax's default: each example
*and position* separately, the Transformer convention; pass ``reduction_axes=(1, 2, 3)`` for the
lecture's "channels and spatial positions within each example"; on an MLP's ``(B, D)`` both agree);
``group`` over the spatial axes and the channels of one group; ``instance`` over the spatial axes.

Names shared with flax: ``BatchNorm`` and ``GroupNorm`` here subclass ``flax.linen.BatchNorm`` and
``flax.linen.GroupNorm`` under the same names, so a star import of ``resjax.nn`` after ``flax.linen`` (or
before) gives the later one's class without a word. ``BatchNorm``'s ``momentum`` defaults to 0.9 here and 0.99
in flax (and it has ``running_variance``); ``GroupNorm``'s defaults are flax's (``num_groups=32``,
``epsilon=1e-6``; ``make_norm('group')`` chooses the groups and ``epsilon=1e-5``). Import the modules
(``import flax.linen as nn``, ``import resjax.nn as rn``) and write ``rn.BatchNorm`` or ``nn.BatchNorm``.

Settings are checked (``ValueError`` naming the setting): ``momentum`` must lie in [0, 1) (rho = 1 -
momentum in (0, 1]); ``rho=`` may be passed instead of ``momentum`` (PyTorch's convention); ``num_groups``
must divide the channels (checked when the layer sees its input); a BatchNorm in training mode needs
more than one value per channel (a batch of one in an MLP), as PyTorch requires. That last check is
skipped during ``init``, which only needs shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from resjax.nn.precision import layer_dtypes

#: The norms that a model's ``norm`` and ``make_norm`` take by name (none, BatchNorm, LayerNorm, GroupNorm,
#: InstanceNorm).
NORMS = ("none", "batch", "layer", "group", "instance")

#: The defaults of resjax's ``BatchNorm``, PyTorch's (flax's ``nn.BatchNorm`` has momentum 0.99); ``momentum`` is
#: the weight of the old running estimate.
BATCHNORM_DEFAULTS = {"momentum": 0.9, "epsilon": 1e-5}

#: The running variances a BatchNorm can keep (``running_variance``), ``'biased'`` (flax's) or ``'unbiased'``
#: (PyTorch's, ``UnbiasedBatchNorm``).
RUNNING_VARIANCES = ("biased", "unbiased")


def _identity(x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    return x


TRAIN_REQUIRED = (
    "train: this model has BatchNorm (layer {layer}), so applying it needs train=True (training: minibatch "
    "statistics; pass mutable=['batch_stats']) or train=False (evaluation: the running estimates). resjax's "
    "train has no default so that forgetting it is an error, not a silently wrong run (a BatchNorm layer "
    "used on its own takes use_running_average)")


class BatchNorm(nn.BatchNorm):
    """``flax.linen.BatchNorm`` with PyTorch's running-estimate rate as its default and a check.

    The same name as flax's class, other defaults: a star import of both (``from resjax.nn import *``,
    ``from flax.linen import *``) leaves whichever came last as ``BatchNorm`` (momentum 0.9 here, 0.99 in flax);
    import the modules and write ``rn.BatchNorm`` / ``nn.BatchNorm``.

    ``momentum`` defaults to 0.9 (rho = 0.1, PyTorch's ``momentum=0.1``: ``m <- 0.9 m + 0.1 m_batch``), not
    flax's 0.99; ``epsilon`` is 1e-5 (flax's default and PyTorch's). Refuses training-mode statistics over a
    single value per channel. When neither the field nor the call gives ``use_running_average`` (a resjax
    model called without ``train``), ``apply`` raises ``ValueError`` naming ``train`` and the layer; ``init``
    goes on with the running estimates, since it only needs shapes. ``running_variance='unbiased'`` keeps
    PyTorch's running variance (see below).

    Attributes:
        momentum: flax's running-estimate momentum, 1 - rho: ``m <- momentum * m + (1 - momentum) * m_batch``;
            in [0, 1) (``make_norm`` checks it and accepts ``rho=`` instead). Default 0.9 (rho = 0.1).
        epsilon: added to the variance before the square root. Default 1e-5.
        running_variance: what a training-mode call averages into the running variance ``batch_stats/var``:
            ``'biased'`` (the default, flax's: the batch variance the layer normalises with, dividing by n) or
            ``'unbiased'`` (PyTorch's: that variance times n/(n-1), n = the values per channel that gave it:
            batch x spatial size, summed over ``axis_name``'s devices, or the ``mask``'s count). Only the
            running estimate differs: both normalise a batch by its biased variance, and evaluation uses the
            stored estimate as it is. Other values raise ``ValueError`` naming ``running_variance``.
        use_running_average: ``True`` (evaluation: the running estimates), ``False`` (training: minibatch
            statistics) or ``None`` (the default: given at call time; ``make_norm`` sets it from the model's
            ``train``, ``None`` when ``train`` is ``None``). The other fields are ``flax.linen.BatchNorm``'s
            (``axis=-1``, ``use_bias``, ``use_scale``, ``axis_name``, ``dtype``, ``param_dtype``, ...).

    Mixed precision (``dtype=jnp.bfloat16``, ``param_dtype=jnp.float32``, as ``make_norm(..., dtype=)`` sets
    them): the batch mean and variance are computed from the input promoted to float32, the running
    estimates in ``batch_stats`` and the scale and offset are float32, the normalisation is computed in
    float32 and the output is cast to ``dtype`` (flax's ``force_float32_reductions=True``, its default).
    """

    momentum: float = BATCHNORM_DEFAULTS["momentum"]
    epsilon: float = BATCHNORM_DEFAULTS["epsilon"]
    running_variance: str = "biased"

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, **kwargs: Any) -> jax.Array:
        """Normalise ``x`` per channel (``axis``, the last by default) over every other axis.

        Args:
            x: the input, e.g. ``(batch, features)`` or channels-last ``(batch, height, width, channels)``.
            use_running_average: ``False`` = training mode (the minibatch's statistics; the running estimates
                in ``batch_stats`` are updated), ``True`` = evaluation (the running estimates). Give it here
                or as the field, not both (``ValueError``). Given by neither, ``apply`` raises ``ValueError``
                naming ``train`` and this layer's path; ``init`` uses the running estimates.
            **kwargs: passed on to ``flax.linen.BatchNorm.__call__`` (``mask``).

        Returns:
            The normalised ``x``, same shape; its dtype is the ``dtype`` field when set (the input's otherwise).

        Raises:
            ValueError: neither the field nor the call gives the mode (``apply`` only; names ``train``);
                training mode with a single value per channel, e.g. a batch of one in an MLP (names
                ``batch_size``; not checked during ``init``).

        Collections:
            ``batch_stats`` (``mean``, ``var``): created by ``init``; updated in training mode, so ``apply``
            with ``use_running_average=False`` (a model's ``train=True``) needs ``mutable=['batch_stats']``.
            ``var`` averages the biased or unbiased batch variance (``running_variance``).
        """
        _check_running_variance(self.running_variance)
        if self.use_running_average is None and use_running_average is None:
            if not self.is_initializing():
                raise ValueError(TRAIN_REQUIRED.format(layer="/".join(map(str, self.path)) or self.name))
            use_running_average = True  # init only needs shapes
        use_ra = nn.merge_param("use_running_average", self.use_running_average, use_running_average)
        if not use_ra and not self.is_initializing():
            feature = {a % x.ndim for a in ((self.axis,) if isinstance(self.axis, int) else self.axis)}
            count = 1
            for a in range(x.ndim):
                if a not in feature:
                    count *= x.shape[a]
            if count < 2:
                raise ValueError(
                    f"batch_size: BatchNorm in training mode (train=True) needs more than one value per channel "
                    f"to compute batch statistics; input shape {tuple(x.shape)} gives {count} (a batch of one). "
                    "Use evaluation mode (train=False, the running estimates) for single examples")
        if self.running_variance == "biased" or use_ra or self.is_initializing():
            return super().__call__(x, use_running_average, **kwargs)
        old = self.get_variable("batch_stats", "var")
        y = super().__call__(x, use_running_average, **kwargs)
        new = self.get_variable("batch_stats", "var")  # flax's update: momentum * old + (1 - momentum) * var
        n = self._count(x, kwargs.get("mask"), old.dtype)
        # PyTorch's: momentum * old + (1 - momentum) * var * n / (n - 1), from flax's own update (its var is the
        # biased batch variance the layer normalised with), so the statistics are computed once
        self.put_variable("batch_stats", "var", (self.momentum * old + (new - self.momentum * old) * (n / (n - 1)))
                          .astype(old.dtype))
        return y

    def _count(self, x: jax.Array, mask: jax.Array | None, dtype: Any) -> jax.Array | int:
        """The values per channel that gave the batch statistics: batch x spatial size, summed over
        ``axis_name``'s devices, or the ``mask``'s count per channel (in ``dtype``)."""
        axes = {a % x.ndim for a in ((self.axis,) if isinstance(self.axis, int) else self.axis)}
        reduction_axes = tuple(i for i in range(x.ndim) if i not in axes)
        if mask is None:
            n = math.prod(x.shape[a] for a in reduction_axes)
            if self.axis_name is not None:
                n = n * jax.lax.psum(1, self.axis_name, axis_index_groups=self.axis_index_groups)
            return n
        n = jnp.sum(jnp.broadcast_to(mask, x.shape), axis=reduction_axes, dtype=dtype)
        if self.axis_name is not None:
            n = jax.lax.psum(n, self.axis_name, axis_index_groups=self.axis_index_groups)
        return n.reshape([x.shape[a] for a in sorted(axes)])


class UnbiasedBatchNorm(BatchNorm):
    """``BatchNorm`` with ``running_variance='unbiased'``: PyTorch's running variance (``n/(n-1)`` times the
    batch variance). Pass it as a model's ``norm`` (``cifar_resnet(20, norm=UnbiasedBatchNorm)``;
    ``resjax.interop.repository_settings(name, running_variance='unbiased')`` for the peers' models): every
    BatchNorm of the model then keeps the unbiased estimate, with the same parameter names as ``norm='batch'``,
    and ``make_norm`` gives it the model's ``train`` and ``dtype`` as it does ``'batch'``."""

    running_variance: str = "unbiased"


def _check_running_variance(value: Any) -> None:
    if value not in RUNNING_VARIANCES:
        raise ValueError(f"running_variance: BatchNorm's running variance is 'biased' (flax's) or 'unbiased' "
                         f"(PyTorch's), got {value!r}")


def _resjax_batch_norm(kind: Callable) -> bool:
    """Whether ``kind`` is resjax's ``BatchNorm`` (or a subclass, or a ``functools.partial`` of one)."""
    cls = kind.func if isinstance(kind, functools.partial) else kind
    return isinstance(cls, type) and issubclass(cls, BatchNorm)


def running_variance_of(kind: str | Callable) -> str | None:
    """The running-variance convention of a ``norm`` setting: ``'biased'`` or ``'unbiased'`` for BatchNorm
    (``'batch'`` and flax's own ``nn.BatchNorm`` are ``'biased'``), ``None`` for the other kinds."""
    if not is_batch_norm(kind):
        return None
    if isinstance(kind, str):
        return "biased"
    keywords = kind.keywords if isinstance(kind, functools.partial) else {}
    cls = kind.func if isinstance(kind, functools.partial) else kind
    return keywords.get("running_variance", getattr(cls, "running_variance", "biased"))


class GroupNorm(nn.GroupNorm):
    """``flax.linen.GroupNorm`` whose group-count error names the setting.

    The same name and defaults as flax's class (``num_groups=32``, ``epsilon=1e-6``); a star import of
    ``resjax.nn`` shadows flax's (or is shadowed by it), which changes only that error message.

    The fields are ``flax.linen.GroupNorm``'s (``num_groups``: the number of channel groups, which must divide
    the channels; ``epsilon``, ...); ``make_norm('group')`` uses ``default_groups(channels)`` groups (32 where 32
    divides the channels) and ``epsilon=1e-5``.
    """

    def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        """Normalise ``x`` over its spatial axes and the channels of each group, per example.

        Args:
            x: the input, channels-last: ``(batch, ..., channels)``, e.g. ``(batch, height, width, channels)``.
            **kwargs: passed on to ``flax.linen.GroupNorm.__call__`` (``mask``).

        Returns:
            The normalised ``x``, same shape. No mutable collections; there is no training mode.

        Raises:
            ValueError: ``num_groups`` does not divide the channels (names ``num_groups``).
        """
        channels = x.shape[-1]
        if self.num_groups is not None and (self.num_groups < 1 or channels % self.num_groups):
            raise ValueError(f"num_groups: {self.num_groups} groups do not divide the {channels} channels "
                             f"(the last axis of input shape {tuple(x.shape)})")
        return super().__call__(x, **kwargs)


def _momentum(overrides: dict) -> dict:
    """Resolve ``rho`` / ``momentum`` overrides into flax's ``momentum`` = 1 - rho, validated."""
    overrides = dict(overrides)
    if "rho" in overrides:
        if "momentum" in overrides:
            raise ValueError("rho: pass either rho (PyTorch's momentum) or momentum (flax's, 1 - rho), not both")
        rho = overrides.pop("rho")
        if not 0 < rho <= 1:
            raise ValueError(f"rho: the running-estimate rate must lie in (0, 1], got {rho}")
        overrides["momentum"] = 1.0 - rho
    m = overrides.get("momentum", BATCHNORM_DEFAULTS["momentum"])
    if not 0 <= m < 1:
        raise ValueError(f"momentum: flax's BatchNorm momentum (1 - rho) must lie in [0, 1), got {m} "
                         f"(rho = {1 - m}); note PyTorch's momentum is rho itself")
    return overrides


def default_groups(channels: int, at_most: int = 32) -> int:
    """``norm='group'``'s number of groups for ``channels`` channels: the largest divisor of ``channels`` that is
    at most ``at_most`` (32, Wu & He's choice): 32 wherever 32 divides the channels, 16 groups of one channel
    for a CIFAR ResNet's 16, 24 for 48."""
    return max(g for g in range(1, min(at_most, channels) + 1) if channels % g == 0)


def _norm_class(kind: Callable) -> type | None:
    """The class behind a callable ``norm`` setting (a class or a ``functools.partial`` of one), or ``None``."""
    cls = kind.func if isinstance(kind, functools.partial) else kind
    return cls if isinstance(cls, type) else None


def _has_field(cls: type | None, field: str) -> bool:
    return cls is not None and dataclasses.is_dataclass(cls) and field in {f.name for f in dataclasses.fields(cls)}


def _grouped(make: Callable[..., Callable], fixed: dict) -> Callable:
    """A group norm whose ``num_groups`` (unless ``fixed`` gives it or ``group_size``) fits the channels of the
    input it is called on (``default_groups``): the layer is made when it sees its input."""
    if "num_groups" in fixed or "group_size" in fixed:
        return make()
    return lambda x, **kwargs: make(num_groups=default_groups(x.shape[-1]))(x, **kwargs)


def _mode_from_train(layer: nn.Module, train: bool | None, name: str | None) -> Callable:
    """``layer`` (a flax layer with a ``use_running_average`` field left unset) called with the mode from
    ``train``: ``use_running_average = not train``; with ``train=None``, ``init`` uses the running averages (it
    only needs shapes) and ``apply`` raises ``ValueError`` naming ``train``, as resjax's ``BatchNorm`` does."""
    if train is not None:
        return functools.partial(layer, use_running_average=not train)

    def call(x: jax.Array, **kwargs: Any) -> jax.Array:
        if layer.parent is not None and layer.parent.is_initializing():
            return layer(x, use_running_average=True, **kwargs)
        raise ValueError(TRAIN_REQUIRED.format(layer=repr(name)))

    return call


def make_norm(kind: str | Callable, *, train: bool | None, name: str | None = None, dtype: Any = None,
              param_dtype: Any = None, **overrides: Any) -> Callable:
    """A normalisation layer of the given kind (or ``kind(name=name, **overrides)`` if it is callable).

    Must be called inside a ``@nn.compact`` method: the returned layer is bound to that module.
    ``train`` is the calling model's ``train`` argument: ``True`` (BatchNorm normalises by the minibatch's
    statistics and updates ``batch_stats``), ``False`` (the running estimates) or ``None`` (not given). A
    BatchNorm made with ``train=None`` raises ``ValueError`` naming ``train`` when it is applied (``init``,
    which only needs shapes, is allowed and uses the running estimates); the other kinds ignore ``train``.
    ``name``: the layer's name in the parameter tree; ``overrides``: the layer's settings (``momentum`` or
    ``rho`` and ``epsilon`` for BatchNorm, ``num_groups`` for GroupNorm, ``reduction_axes``, ...). Returns a
    layer called as ``layer(x)``.
    ``dtype``: the model's computation dtype (``resjax.nn.precision``): ``None`` (the default) leaves the layer
    as it was; otherwise the layer returns ``dtype`` with float32 parameters (``dtype``, ``param_dtype`` set;
    BatchNorm's statistics and running estimates stay float32) and a callable ``kind`` is given ``dtype=``.
    ``param_dtype``: the model's parameter dtype; ``None`` (the default) leaves the layer's (float32), else the
    layer (a callable ``kind`` too) is given ``param_dtype=``.
    Unknown names raise ``ValueError`` naming ``norm``. ``running_variance='biased'|'unbiased'`` (BatchNorm):
    see ``BatchNorm``. ``'group'`` takes ``default_groups(channels)`` groups (32 where 32 divides the channels)
    unless ``num_groups`` or ``group_size`` is given.

    A callable ``kind`` is a flax layer class (resjax's ``BatchNorm``, ``UnbiasedBatchNorm``, ``GroupNorm``, or
    flax's ``nn.BatchNorm``, ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, ``nn.InstanceNorm``, ...), a
    ``functools.partial`` of one, or any function that returns a layer. A layer with a ``use_running_average``
    field that the partial does not fix is given the mode from ``train`` (``use_running_average = not train``:
    flax's own ``nn.BatchNorm`` works as ``norm``; with ``train=None`` it is refused at ``apply`` as above);
    resjax's ``BatchNorm`` also gets ``dtype``'s float32 parameters, as ``'batch'``. A ``GroupNorm`` (flax's or
    resjax's) whose partial fixes neither ``num_groups`` nor ``group_size`` takes ``default_groups`` groups.
    Other callables get ``name``, ``dtype`` and ``param_dtype`` (those set) and the ``overrides``.
    """
    cls = _norm_class(kind) if callable(kind) else None
    fixed = dict(getattr(kind, "keywords", None) or {})
    resjax_bn = callable(kind) and _resjax_batch_norm(kind) and "use_running_average" not in fixed
    precision = layer_dtypes(dtype, param_dtype)
    if dtype is not None:
        overrides = {**(precision if resjax_bn or not callable(kind) else {"dtype": precision["dtype"]}),
                     **overrides}
    if param_dtype is not None:
        overrides = {"param_dtype": precision["param_dtype"], **overrides}
    if resjax_bn:
        return kind(use_running_average=None if train is None else not train, name=name, **overrides)
    if callable(kind):
        if cls is not None and issubclass(cls, nn.GroupNorm):
            return _grouped(lambda **groups: kind(name=name, **overrides, **groups), {**fixed, **overrides})
        if _has_field(cls, "use_running_average") and "use_running_average" not in fixed:
            return _mode_from_train(kind(name=name, **overrides), train, name)
        return kind(name=name, **overrides)
    if kind == "none":
        return _identity
    if kind == "batch":
        kwargs = {**BATCHNORM_DEFAULTS, **_momentum(overrides)}
        _check_running_variance(kwargs.get("running_variance", "biased"))
        return BatchNorm(use_running_average=None if train is None else not train, name=name, **kwargs)
    if kind == "layer":
        return nn.LayerNorm(name=name, **{"epsilon": 1e-5, **overrides})
    if kind == "group":
        settings = {"epsilon": 1e-5, **overrides}
        return _grouped(lambda **groups: GroupNorm(name=name, **settings, **groups), settings)
    if kind == "instance":
        return nn.InstanceNorm(name=name, **{"epsilon": 1e-5, **overrides})
    raise ValueError(f"norm: unknown normalisation {kind!r}; choose one of {NORMS} or pass a callable")


def is_batch_norm(kind: str | Callable) -> bool:
    """Whether a ``norm`` setting is BatchNorm: ``'batch'``, a BatchNorm class or a ``functools.partial`` of
    one. A layer followed directly by BatchNorm needs no bias (BatchNorm subtracts the batch mean)."""
    if isinstance(kind, str):
        return kind == "batch"
    cls = getattr(kind, "func", kind)
    return isinstance(cls, type) and issubclass(cls, nn.BatchNorm)


def check_norm(kind: str | Callable) -> None:
    """Raise the ``make_norm`` error for an unknown name, at module construction."""
    if not callable(kind) and kind not in NORMS:
        raise ValueError(f"norm: unknown normalisation {kind!r}; choose one of {NORMS} or pass a callable")
