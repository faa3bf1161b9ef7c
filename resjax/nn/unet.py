"""U-Net (Ronneberger et al. 2015): an encoder-decoder whose skips are concatenated at matching scales.

Channels-last (NHWC). The encoder applies a ``ConvBlock`` (two of 3x3 conv -> norm -> relu) at each width in
``features`` and halves the spatial size with a 2x2 max-pool between them; the last width is the bottleneck.
The decoder doubles the spatial size with a 2x2 stride-2 transposed convolution, concatenates the encoder
feature map of the same scale through ``concat_merge`` (the lecture's ``h' = concat(h_decoder, h_encoder)``),
and applies a ``ConvBlock``. A final 1x1 convolution gives ``out_channels``.

``depth = len(features) - 1`` poolings, so the input's height and width must be divisible by ``2**depth``.
Each skip is sown into ``'intermediates'`` as ``skip_{i}`` (i = 0 at full resolution): with the default
``features=(64, 128, 256, 512)`` a 224x224 input shows skips at 224, 112 and 56 and a 28x28 bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from resjax.nn.init import FLAX_DEFAULT_KERNEL_INIT
from resjax.nn.norms import check_norm, make_norm
from resjax.nn.precision import PrecisionRepr, layer_dtypes, resolve_dtype
from resjax.nn.residual import check_positive, concat_merge


class ConvBlock(PrecisionRepr, nn.Module):
    """``num_convs`` x (3x3 conv -> norm -> relu) at ``features`` channels, spatial size kept.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        features: the output channels of every conv; an integer >= 1. Required.
        num_convs: the conv -> norm -> relu layers; an integer >= 1. Default 2.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    features: int
    num_convs: int = 2
    norm: str | Callable = "batch"
    param_dtype: Any = None

    def __post_init__(self):
        resolve_dtype(self.param_dtype, "param_dtype")
        check_positive("features", self.features)
        check_positive("num_convs", self.num_convs)
        check_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the ``num_convs`` layers.

        Args:
            x: the feature maps, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, height, width, features)``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out. Nothing is sown.
        """
        for i in range(self.num_convs):
            x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=self.norm == "none", name=f"conv_{i}",
                        kernel_init=FLAX_DEFAULT_KERNEL_INIT,
                        param_dtype=layer_dtypes(None, self.param_dtype)["param_dtype"])(x)
            x = nn.relu(make_norm(self.norm, train=train, name=f"norm_{i}", param_dtype=self.param_dtype)(x))
        return x


def check_features(features: Sequence[int]) -> None:
    """``features`` must be a non-empty sequence of integers >= 1 (else ``ValueError`` naming ``features``)."""
    if isinstance(features, (int, str)) or len(features) == 0:
        raise ValueError(f"features: need a non-empty sequence of widths, got {features!r}")
    for f in features:
        check_positive("features", f)


def check_spatial(x: jax.Array, depth: int, setting: str = "depth") -> None:
    """Height and width of the NHWC input ``x`` must be divisible by ``2**depth``: else ``ValueError`` naming
    ``input`` and ``setting`` (also for an ``x`` without 4 axes)."""
    if x.ndim != 4:
        raise ValueError(f"input: expected NHWC (4 axes), got shape {tuple(x.shape)}")
    h, w = x.shape[1:3]
    if h % 2 ** depth or w % 2 ** depth:
        raise ValueError(f"input: spatial size {h}x{w} is not divisible by 2**{setting} = {2 ** depth} ({setting}={depth})")


class UNet(PrecisionRepr, nn.Module):
    """U-Net on NHWC images; see the module docstring. Call as ``unet(x, train)``.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        features: the encoder's widths, one per scale, the last the bottleneck's: a non-empty sequence of
            integers >= 1; ``len(features) - 1`` poolings. Default ``(64, 128, 256, 512)``.
        out_channels: the final 1x1 conv's output channels; an integer >= 1. Default 1.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    features: Sequence[int] = (64, 128, 256, 512)
    out_channels: int = 1
    norm: str | Callable = "batch"
    param_dtype: Any = None

    def __post_init__(self):
        resolve_dtype(self.param_dtype, "param_dtype")
        check_features(self.features)
        check_positive("out_channels", self.out_channels)
        check_norm(self.norm)
        super().__post_init__()

    @property
    def depth(self) -> int:
        """Number of 2x2 poolings (and of skips)."""
        return len(self.features) - 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the encoder, the bottleneck, the decoder (with concatenated skips) and the 1x1 head.

        Args:
            x: the images, channels-last ``(batch, height, width, channels)``; height and width divisible by
                ``2**depth``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, height, width, out_channels)``.

        Raises:
            ValueError: ``x`` without 4 axes, or a height or width not divisible by ``2**depth`` (names
                ``input`` and ``depth``); ``train`` missing with BatchNorm.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``skip_i`` (the encoder's output at scale i, i = 0 at full resolution)
            when the caller makes it mutable.
        """
        check_spatial(x, self.depth, "depth")
        pd = layer_dtypes(None, self.param_dtype)["param_dtype"]
        skips = []
        for i, f in enumerate(self.features[:-1]):
            x = ConvBlock(f, norm=self.norm, param_dtype=self.param_dtype, name=f"down_{i}")(x, train)
            self.sow("intermediates", f"skip_{i}", x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = ConvBlock(self.features[-1], norm=self.norm, param_dtype=self.param_dtype, name="bottleneck")(x, train)
        for i in reversed(range(self.depth)):
            f = self.features[i]
            x = nn.ConvTranspose(f, (2, 2), strides=(2, 2), kernel_init=FLAX_DEFAULT_KERNEL_INIT, name=f"upsample_{i}",
                                 param_dtype=pd)(x)
            x = concat_merge(x, skips[i])
            x = ConvBlock(f, norm=self.norm, param_dtype=self.param_dtype, name=f"up_{i}")(x, train)
        return nn.Conv(self.out_channels, (1, 1), kernel_init=FLAX_DEFAULT_KERNEL_INIT, name="head", param_dtype=pd)(x)
