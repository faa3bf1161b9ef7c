"""Hourglass networks (Newell, Yang & Deng 2016): repeated down- and up-sampling with processed, added skips.

Channels-last (NHWC). ``Hourglass(depth, features)`` is recursive: at each level the input goes two ways,

- the skip branch: a ``ConvBlock`` at full resolution of that level;
- the low branch: 2x2 max-pool -> ``ConvBlock`` -> the next level (or a ``ConvBlock`` at the bottom) ->
  ``ConvBlock`` -> 2x nearest-neighbour upsampling;

and the two are added through ``residual_add`` (unlike U-Net, the skip is processed and added, not
concatenated). Each level's skip is sown into ``'intermediates'`` as ``skip``. The input's height and width
must be divisible by ``2**depth``.

``StackedHourglass(num_stacks, depth, features, num_heatmaps)`` applies a 3x3 stem to ``features`` channels, then
``num_stacks`` hourglasses; after each a 1x1 head gives ``num_heatmaps`` heatmaps (one per output channel, e.g.
one per joint), and between stacks the features and heatmaps are remapped by 1x1 convs and added back to the
stream through ``residual_add``. It returns the list of every stack's heatmaps (intermediate supervision);
the last one is the prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from resjax.nn.init import FLAX_DEFAULT_KERNEL_INIT
from resjax.nn.norms import check_norm
from resjax.nn.precision import PrecisionRepr, layer_dtypes, resolve_dtype
from resjax.nn.residual import check_positive, residual_add
from resjax.nn.unet import ConvBlock, check_spatial


def _upsample2(x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    return jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")


class Hourglass(PrecisionRepr, nn.Module):
    """One hourglass of ``depth`` levels at constant width ``features``; see the module docstring.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        depth: the levels (poolings); an integer >= 1. Required.
        features: the channels of every ``ConvBlock``; an integer >= 1. Required.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    depth: int
    features: int
    norm: str | Callable = "batch"
    param_dtype: Any = None

    def __post_init__(self):
        resolve_dtype(self.param_dtype, "param_dtype")
        check_positive("depth", self.depth)
        check_positive("features", self.features)
        check_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the hourglass: the processed skip plus the upsampled low branch, at every level.

        Args:
            x: the feature maps, channels-last ``(batch, height, width, channels)``; height and width
                divisible by ``2**depth``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, height, width, features)``.

        Raises:
            ValueError: ``x`` without 4 axes, or a height or width not divisible by ``2**depth`` (names
                ``input`` and ``depth``); ``train`` missing with BatchNorm.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``skip`` (this level's processed skip; the deeper levels' under ``inner``)
            when the caller makes it mutable.
        """
        check_spatial(x, self.depth, "depth")
        block = lambda name: ConvBlock(self.features, num_convs=1, norm=self.norm, param_dtype=self.param_dtype,
                                       name=name)
        skip = block("skip_block")(x, train)
        self.sow("intermediates", "skip", skip)
        low = block("down")(nn.max_pool(x, (2, 2), strides=(2, 2)), train)
        if self.depth > 1:
            low = Hourglass(self.depth - 1, self.features, self.norm, param_dtype=self.param_dtype,
                            name="inner")(low, train)
        else:
            low = block("bottom")(low, train)
        low = block("up")(low, train)
        return residual_add(skip, _upsample2(low))


class StackedHourglass(PrecisionRepr, nn.Module):
    """``num_stacks`` hourglasses with a heatmap head after each; returns a list of ``(B, H, W, num_heatmaps)``.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        num_stacks: the hourglasses; an integer >= 1. Required.
        depth: the levels of each hourglass; an integer >= 1. Required.
        features: the stream's channels (stem, hourglasses, remapping convs); an integer >= 1. Required.
        num_heatmaps: the heatmaps of each head (its output channels); an integer >= 1. Required.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    num_stacks: int
    depth: int
    features: int
    num_heatmaps: int
    norm: str | Callable = "batch"
    param_dtype: Any = None

    def __post_init__(self):
        resolve_dtype(self.param_dtype, "param_dtype")
        for setting in ("num_stacks", "depth", "features", "num_heatmaps"):
            check_positive(setting, getattr(self, setting))
        check_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> list[jax.Array]:
        """Apply the stem and the stacks; every stack's heatmaps are returned (intermediate supervision).

        Args:
            x: the images, channels-last ``(batch, height, width, channels)``; height and width divisible by
                ``2**depth``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            A list of ``num_stacks`` arrays ``(batch, height, width, num_heatmaps)``; the last is the prediction.

        Raises:
            ValueError: ``x`` without 4 axes, or a height or width not divisible by ``2**depth`` (names
                ``input`` and ``depth``); ``train`` missing with BatchNorm.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: every hourglass sows its ``skip``s (under ``hourglass_s``) when the caller
            makes it mutable.
        """
        check_spatial(x, self.depth, "depth")
        pd = layer_dtypes(None, self.param_dtype)["param_dtype"]
        block = lambda name: ConvBlock(self.features, num_convs=1, norm=self.norm, param_dtype=self.param_dtype,
                                       name=name)
        x = block("stem")(x, train)
        heatmaps = []
        for s in range(self.num_stacks):
            h = Hourglass(self.depth, self.features, self.norm, param_dtype=self.param_dtype,
                          name=f"hourglass_{s}")(x, train)
            h = block(f"features_{s}")(h, train)
            heat = nn.Conv(self.num_heatmaps, (1, 1), kernel_init=FLAX_DEFAULT_KERNEL_INIT, name=f"heatmap_{s}",
                           param_dtype=pd)(h)
            heatmaps.append(heat)
            if s < self.num_stacks - 1:
                back = nn.Conv(self.features, (1, 1), kernel_init=FLAX_DEFAULT_KERNEL_INIT,
                               name=f"remap_features_{s}", param_dtype=pd)(h)
                back = back + nn.Conv(self.features, (1, 1), kernel_init=FLAX_DEFAULT_KERNEL_INIT,
                                      name=f"remap_heatmap_{s}", param_dtype=pd)(heat)
                x = residual_add(x, back)
        return heatmaps
