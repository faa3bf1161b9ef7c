"""Convolutional blocks for the lecture's architectures (NHWC, flax's channels-last layout).

Residual branches (lecture 000, "Bottleneck blocks", "Weights in a bottleneck") are configurations of the one
residual block, ``resjax.nn.block`` (imported here too):

- ``BasicBranch(features)``: 3x3 conv -> norm -> relu -> 3x3 conv -> norm; at 256 channels its two
  kernels hold 2 * 9 * 256^2 = 1,179,648 weights.
- ``BottleneckBranch(features, bottleneck)``: 1x1 (reduce) -> norm -> relu -> 3x3 -> norm -> relu -> 1x1
  (restore) -> norm; 256 -> 64 -> 64 -> 256 holds 256*64 + 9*64^2 + 64*256 = 69,632 weights.
- ``ConvResidualBlock(branch)``: ``relu(x + branch(x))`` (post-activation, the original ResNet) or
  ``x + branch(x)`` with ``post_activation=False``, added through ``residual_add``: an identity skip
  only, so the branch must give back the input's shape (another input width raises ``ValueError``).

Dense connections (lecture 000, "DenseNet", "Width in a dense block"; Huang et al. 2017):

- ``DenseLayer(growth_rate, bottleneck)``: norm -> relu -> [1x1 conv to 4*growth -> norm -> relu] ->
  3x3 conv to ``growth_rate`` channels (the bracket only when ``bottleneck=True``, DenseNet-B).
- ``DenseBlock(num_layers, growth_rate)``: ``h_k = concat(h_{k-1}, f_k(h_{k-1}))`` through
  ``concat_merge`` (the shape-checked twin of ``residual_add``), so layer k sees C_0 + (k-1) g channels.
- ``Transition(compression)``: norm -> relu -> 1x1 conv to ``floor(compression * C)`` -> 2x2 average pool.

Convolutions carry no bias when a normalisation follows them (the norm's offset replaces it), and a
bias when ``norm='none'``. Normalisation is chosen by name (or callable) through ``make_norm``; kernels
are drawn by ``kernel_init`` (a ``resjax.nn.init`` name; default He normal fan-out, the conv ResNets'
choice). Call every module as ``module(x, train)``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax

from resjax.nn.init import get_initializer
from resjax.nn.norms import check_norm, make_norm
from resjax.nn.precision import PrecisionRepr, layer_dtypes, resolve_dtype
from resjax.nn.block import CONV_KERNEL_INIT, BasicBranch, BottleneckBranch, ConvResidualBlock  # noqa: F401
from resjax.nn.residual import check_positive, concat_merge

DEFAULT_KERNEL_INIT = CONV_KERNEL_INIT


def _conv(module: nn.Module, features: int, size: int, name: str, use_bias: bool) -> nn.Conv:
    return nn.Conv(features, (size, size), padding="SAME", use_bias=use_bias,
                   kernel_init=get_initializer(module.kernel_init), name=name,
                   **layer_dtypes(module.dtype, module.param_dtype))


def norm_layer(module: nn.Module, name: str, train: bool | None) -> Callable:
    """``make_norm(module.norm, ...)`` with the module's ``dtype`` and ``param_dtype``, named ``name``."""
    return make_norm(module.norm, train=train, name=name, dtype=module.dtype, param_dtype=module.param_dtype)


def _check(module: nn.Module) -> None:
    check_norm(module.norm)
    get_initializer(module.kernel_init)  # raises on an unknown name
    resolve_dtype(module.dtype)
    resolve_dtype(module.param_dtype, "param_dtype")


class DenseLayer(PrecisionRepr, nn.Module):
    """norm -> relu -> [1x1 conv to ``4 * growth_rate`` -> norm -> relu] -> 3x3 conv to ``growth_rate``.

    Returns only the ``growth_rate`` new channels; ``DenseBlock`` concatenates them to the input.

    Attributes:
        growth_rate: g, the new channels (the 3x3 conv's output); an integer >= 1. Required.
        bottleneck: ``True``: the 1x1 conv to ``bottleneck_factor * growth_rate`` channels first (DenseNet-B).
            Default ``False``.
        bottleneck_factor: the 1x1 conv's width in units of ``growth_rate``; an integer >= 1. Default 4.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        kernel_init: the convs' initialiser (a ``resjax.nn.init`` name or a function). Default
            ``'he_normal_fan_out'``.
        activation: the activation function. Default ``flax.linen.relu``.
        dtype: the computation dtype (mixed precision, ``resjax.nn.precision``): ``None`` (default; float32),
            ``'float32'``, ``'bfloat16'`` or ``'float16'``. Convolutions and norms' outputs compute in it;
            parameters and BatchNorm's statistics stay float32. The input is not cast (the network casts it).
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    growth_rate: int
    bottleneck: bool = False
    bottleneck_factor: int = 4
    norm: str | Callable = "batch"
    kernel_init: str | Callable = DEFAULT_KERNEL_INIT
    activation: Callable = nn.relu
    dtype: Any = None
    param_dtype: Any = None

    def __post_init__(self):
        check_positive("growth_rate", self.growth_rate)
        check_positive("bottleneck_factor", self.bottleneck_factor)
        _check(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Compute the new channels: norm -> act -> [1x1 conv -> norm -> act] -> 3x3 conv.

        Args:
            x: the feature maps, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            The new channels, ``(batch, height, width, growth_rate)``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out. Nothing is sown.
        """
        bias = self.norm == "none"
        h = self.activation(norm_layer(self, "norm_0", train)(x))
        if self.bottleneck:
            h = _conv(self, self.bottleneck_factor * self.growth_rate, 1, "conv1x1", bias)(h)
            h = self.activation(norm_layer(self, "norm_1", train)(h))
        # the 3x3 conv's output is concatenated, not normalised, so it keeps no bias either way
        # (DenseNet's convention); only with norm='none' is a bias added.
        return _conv(self, self.growth_rate, 3, "conv3x3", bias)(h)


class DenseBlock(PrecisionRepr, nn.Module):
    """``num_layers`` dense layers; layer k sees ``C_0 + (k-1) * growth_rate`` channels; the output has
    ``C_0 + num_layers * growth_rate``. Layers are named ``layer_0`` ... ``layer_{n-1}``.

    Attributes:
        num_layers: the dense layers; an integer >= 1. Required.
        growth_rate: the channels each layer adds; an integer >= 1. Required.
        bottleneck: whether every layer has DenseNet-B's 1x1 bottleneck conv. Default ``False``.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        kernel_init: the convs' initialiser (a ``resjax.nn.init`` name or a function). Default
            ``'he_normal_fan_out'``.
        dtype: the computation dtype (mixed precision, ``resjax.nn.precision``): ``None`` (default; float32),
            ``'float32'``, ``'bfloat16'`` or ``'float16'``. Convolutions and norms' outputs compute in it;
            parameters and BatchNorm's statistics stay float32. The input is not cast (the network casts it).
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    num_layers: int
    growth_rate: int
    bottleneck: bool = False
    norm: str | Callable = "batch"
    kernel_init: str | Callable = DEFAULT_KERNEL_INIT
    dtype: Any = None
    param_dtype: Any = None

    def __post_init__(self):
        check_positive("num_layers", self.num_layers)
        check_positive("growth_rate", self.growth_rate)
        _check(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the layers, concatenating each one's new channels to the stream (``concat_merge``).

        Args:
            x: the feature maps, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, height, width, channels + num_layers * growth_rate)``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out. Nothing is sown.
        """
        h = x
        for k in range(self.num_layers):
            new = DenseLayer(self.growth_rate, self.bottleneck, norm=self.norm, kernel_init=self.kernel_init,
                             dtype=self.dtype, param_dtype=self.param_dtype, name=f"layer_{k}")(h, train)
            h = concat_merge(h, new, axis=-1)
        return h


class Transition(PrecisionRepr, nn.Module):
    """norm -> relu -> 1x1 conv to ``floor(compression * C)`` channels -> 2x2 average pool (stride 2).

    Attributes:
        compression: the fraction of the channels kept, in (0, 1]: ``max(1, floor(compression * C))``.
            Default 0.5.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        kernel_init: the convs' initialiser (a ``resjax.nn.init`` name or a function). Default
            ``'he_normal_fan_out'``.
        activation: the activation function. Default ``flax.linen.relu``.
        dtype: the computation dtype (mixed precision, ``resjax.nn.precision``): ``None`` (default; float32),
            ``'float32'``, ``'bfloat16'`` or ``'float16'``. Convolutions and norms' outputs compute in it;
            parameters and BatchNorm's statistics stay float32. The input is not cast (the network casts it).
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    compression: float = 0.5
    norm: str | Callable = "batch"
    kernel_init: str | Callable = DEFAULT_KERNEL_INIT
    activation: Callable = nn.relu
    dtype: Any = None
    param_dtype: Any = None

    def __post_init__(self):
        if not 0 < self.compression <= 1:
            raise ValueError(f"compression: must lie in (0, 1], got {self.compression!r}")
        _check(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Compress the channels and halve the spatial size.

        Args:
            x: the feature maps, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, height // 2, width // 2, max(1, floor(compression * channels)))``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out. Nothing is sown.
        """
        out_channels = max(1, int(self.compression * x.shape[-1]))
        h = self.activation(norm_layer(self, "norm", train)(x))
        h = _conv(self, out_channels, 1, "conv1x1", self.norm == "none")(h)
        return nn.avg_pool(h, (2, 2), strides=(2, 2))


def conv_kernel_weights(params: Mapping[str, Any]) -> dict[str, int]:
    """Weights (biases excluded) of every conv kernel in a parameter tree (or a tree of
    ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``), keyed by the '/'-joined path of the kernel.

    A conv kernel is a leaf named ``kernel`` with 4 axes ``(h, w, in, out)``; norms' scales and offsets
    and all biases are excluded.
    """
    import math

    from flax.traverse_util import flatten_dict

    out = {}
    for path, leaf in flatten_dict(dict(params)).items():
        if path[-1] == "kernel" and len(leaf.shape) == 4:
            out["/".join(path[:-1])] = math.prod(leaf.shape)
    return out
