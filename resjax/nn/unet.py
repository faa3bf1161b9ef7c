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

import flax.linen as nn

from resjax.nn.norms import check_norm, make_norm
from resjax.nn.residual import check_positive, concat_merge


class ConvBlock(nn.Module):
    """``num_convs`` x (3x3 conv -> norm -> relu) at ``features`` channels, spatial size kept."""

    features: int
    num_convs: int = 2
    norm: str | Callable = "batch"

    def __post_init__(self):
        check_positive("features", self.features)
        check_positive("num_convs", self.num_convs)
        check_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, train: bool | None = None):
        for i in range(self.num_convs):
            x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=self.norm == "none", name=f"conv_{i}")(x)
            x = nn.relu(make_norm(self.norm, train=train, name=f"norm_{i}")(x))
        return x


def check_features(features: Sequence[int]) -> None:
    """``features`` must be a non-empty sequence of integers >= 1."""
    if isinstance(features, (int, str)) or len(features) == 0:
        raise ValueError(f"features: need a non-empty sequence of widths, got {features!r}")
    for f in features:
        check_positive("features", f)


def check_spatial(x, depth: int, setting: str = "depth") -> None:
    """Height and width of the NHWC input ``x`` must be divisible by ``2**depth``."""
    if x.ndim != 4:
        raise ValueError(f"input: expected NHWC (4 axes), got shape {tuple(x.shape)}")
    h, w = x.shape[1:3]
    if h % 2 ** depth or w % 2 ** depth:
        raise ValueError(f"input: spatial size {h}x{w} is not divisible by 2**{setting} = {2 ** depth} ({setting}={depth})")


class UNet(nn.Module):
    """U-Net on NHWC images; see the module docstring. Call as ``unet(x, train)``."""

    features: Sequence[int] = (64, 128, 256, 512)
    out_channels: int = 1
    norm: str | Callable = "batch"

    def __post_init__(self):
        check_features(self.features)
        check_positive("out_channels", self.out_channels)
        check_norm(self.norm)
        super().__post_init__()

    @property
    def depth(self) -> int:
        """Number of 2x2 poolings (and of skips)."""
        return len(self.features) - 1

    @nn.compact
    def __call__(self, x, train: bool | None = None):
        check_spatial(x, self.depth, "depth")
        skips = []
        for i, f in enumerate(self.features[:-1]):
            x = ConvBlock(f, norm=self.norm, name=f"down_{i}")(x, train)
            self.sow("intermediates", f"skip_{i}", x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = ConvBlock(self.features[-1], norm=self.norm, name="bottleneck")(x, train)
        for i in reversed(range(self.depth)):
            f = self.features[i]
            x = nn.ConvTranspose(f, (2, 2), strides=(2, 2), name=f"upsample_{i}")(x)
            x = concat_merge(x, skips[i])
            x = ConvBlock(f, norm=self.norm, name=f"up_{i}")(x, train)
        return nn.Conv(self.out_channels, (1, 1), name="head")(x)
