"""DenseNet (Huang et al. 2017) composed from ``DenseBlock`` and ``Transition`` (NHWC).

``DenseNet(block_layers, growth_rate, init_features, compression, bottleneck, num_classes, stem)``:

- stem ``'imagenet'``: 7x7 stride-2 conv to ``init_features`` (no bias) -> norm -> relu -> 3x3 stride-2
  max pool (padding 1, as torchvision);
- stem ``'cifar'``: one 3x3 conv to ``init_features`` (no bias), no pooling (DenseNet-BC on CIFAR: the
  first dense block's norm follows directly);
- ``len(block_layers)`` dense blocks separated by transitions (norm -> relu -> 1x1 conv to
  ``floor(compression * C)`` -> 2x2 average pool);
- final norm -> relu -> global average pool -> ``Dense(num_classes)`` with bias.

Parameter counts (params only: norm scales and offsets counted, running statistics not), measured
with ``jax.eval_shape``: ``densenet121()`` holds 7,978,856, torchvision's count;
``densenet_bc_cifar(100, 12)`` with 10 classes holds 769,162 (the paper's "0.8M").

Call as ``model(x, train)``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from resjax.nn.conv_blocks import DEFAULT_KERNEL_INIT, DenseBlock, Transition, _check, norm_layer
from resjax.nn.init import FLAX_DEFAULT_KERNEL_INIT, get_initializer
from resjax.nn.precision import PrecisionRepr, layer_dtypes
from resjax.nn.residual import check_positive

STEMS = ("imagenet", "cifar")


class DenseNet(PrecisionRepr, nn.Module):
    """DenseNet classifier; see the module docstring.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        block_layers: the dense layers of each block, a non-empty sequence of integers >= 1 (stored as a
            tuple). Default ``(6, 12, 24, 16)``, DenseNet-121.
        growth_rate: the channels each dense layer adds; an integer >= 1. Default 32.
        init_features: the stem's output channels; an integer >= 1. Default 64.
        compression: the fraction of channels the transitions keep, in (0, 1]. Default 0.5.
        bottleneck: whether the dense layers have the 1x1 bottleneck conv (DenseNet-B); ``True`` (default)
            or ``False``.
        num_classes: the classifier's outputs (logits); an integer >= 1. Default 1000.
        stem: ``'imagenet'`` (default; 7x7/2 conv -> norm -> relu -> 3x3/2 max pool) or ``'cifar'`` (one 3x3
            conv); ``STEMS``.
        norm: a name in ``NORMS`` (``'batch'``, the default, ``'none'``, ``'layer'``, ``'group'``, ``'instance'``)
            or a callable for ``make_norm``. Convolutions have a bias only with ``'none'``.
        kernel_init: the convs' initialiser (a ``resjax.nn.init`` name or a function). Default
            ``'he_normal_fan_out'``.
        dtype: the computation dtype (mixed precision, ``resjax.nn.precision``): ``None`` (default; float32),
            ``'float32'``, ``'bfloat16'`` or ``'float16'``. The images are cast to it at the stem; convolutions,
            the classifier, activations and pooling compute in it; parameters and BatchNorm's statistics
            (``batch_stats``) stay float32; the logits are returned as float32.
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    block_layers: Sequence[int] = (6, 12, 24, 16)
    growth_rate: int = 32
    init_features: int = 64
    compression: float = 0.5
    bottleneck: bool = True
    num_classes: int = 1000
    stem: str = "imagenet"
    norm: str | Callable = "batch"
    kernel_init: str | Callable = DEFAULT_KERNEL_INIT
    dtype: Any = None
    param_dtype: Any = None

    def __post_init__(self):
        layers = self.block_layers
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__") or len(layers) == 0:
            raise ValueError(f"block_layers: must be a non-empty sequence of integers >= 1, got {layers!r}")
        for n in layers:
            check_positive("block_layers", n)
        object.__setattr__(self, "block_layers", tuple(layers))
        check_positive("growth_rate", self.growth_rate)
        check_positive("init_features", self.init_features)
        check_positive("num_classes", self.num_classes)
        if isinstance(self.compression, bool) or not isinstance(self.compression, (int, float)) \
                or not 0 < self.compression <= 1:
            raise ValueError(f"compression: must lie in (0, 1], got {self.compression!r}")
        if not isinstance(self.bottleneck, bool):
            raise ValueError(f"bottleneck: must be True or False, got {self.bottleneck!r}")
        if self.stem not in STEMS:
            raise ValueError(f"stem: unknown stem {self.stem!r}; choose one of {STEMS}")
        _check(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Classify images: stem, dense blocks and transitions, final norm -> relu, global average pool, dense.

        Args:
            x: the images, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            The logits, ``(batch, num_classes)``; float32 also when computed in a half ``dtype``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out. Nothing is sown.
        """
        bias = self.norm == "none"
        init = get_initializer(self.kernel_init)
        dtypes = layer_dtypes(self.dtype, self.param_dtype)
        if dtypes["dtype"] is not None:
            x = x.astype(dtypes["dtype"])
        if self.stem == "imagenet":
            h = nn.Conv(self.init_features, (7, 7), strides=(2, 2), padding=((3, 3), (3, 3)),
                        use_bias=bias, kernel_init=init, name="stem_conv", **dtypes)(x)
            h = nn.relu(norm_layer(self, "stem_norm", train)(h))
            h = nn.max_pool(h, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        else:
            h = nn.Conv(self.init_features, (3, 3), padding="SAME", use_bias=bias, kernel_init=init,
                        name="stem_conv", **dtypes)(x)
        last = len(self.block_layers) - 1
        for i, n in enumerate(self.block_layers):
            h = DenseBlock(n, self.growth_rate, self.bottleneck, norm=self.norm, kernel_init=self.kernel_init,
                           dtype=self.dtype, param_dtype=self.param_dtype, name=f"block_{i}")(h, train)
            if i < last:
                h = Transition(self.compression, norm=self.norm, kernel_init=self.kernel_init,
                               dtype=self.dtype, param_dtype=self.param_dtype, name=f"transition_{i}")(h, train)
        h = nn.relu(norm_layer(self, "final_norm", train)(h))
        h = jnp.mean(h, axis=(1, 2))
        logits = nn.Dense(self.num_classes, kernel_init=FLAX_DEFAULT_KERNEL_INIT, name="classifier", **dtypes)(h)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # half -> float32


def densenet121(num_classes: int = 1000, **kwargs: Any) -> DenseNet:
    """DenseNet-121: blocks (6, 12, 24, 16), growth 32, 64 stem features, compression 0.5, bottlenecks."""
    return DenseNet((6, 12, 24, 16), growth_rate=32, init_features=64, compression=0.5, bottleneck=True,
                    num_classes=num_classes, stem="imagenet", **kwargs)


def densenet_bc_cifar(depth: int = 100, growth_rate: int = 12, num_classes: int = 10, **kwargs: Any) -> DenseNet:
    """DenseNet-BC for CIFAR: 3 blocks of ``(depth - 4) / 6`` bottleneck layers, a 3x3 stem conv to
    ``2 * growth_rate`` channels, compression 0.5, no max pool."""
    check_positive("depth", depth)
    check_positive("growth_rate", growth_rate)
    if depth < 10 or (depth - 4) % 6:
        raise ValueError(f"depth: DenseNet-BC needs depth = 6n + 4 with n >= 1, got {depth!r}")
    n = (depth - 4) // 6
    return DenseNet((n, n, n), growth_rate=growth_rate, init_features=2 * growth_rate, compression=0.5,
                    bottleneck=True, num_classes=num_classes, stem="cifar", **kwargs)
