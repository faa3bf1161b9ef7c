"""1-D convolutional residual networks, for signals ``(batch, length, channels)`` such as MNIST-1D's.

``ResNet1D`` is ``resjax.nn.ResNet`` on signals: the same stages, blocks (``ResidualBlock`` as ``ResNetBlock``:
``'basic'`` or ``'bottleneck'``, pre or post order, every norm, every branch scaling, option A or B shortcuts,
``scan``, ``remat``, ``dtype``) and head, with every kernel, stride and pool on the length axis alone: a block's
3x3 convolution is a length-3 one, a stride 2 halves the length (rounded up), option A subsamples the length and
appends zero channels, the global average pool is over the length. Every residual addition is the library's one
``residual_add`` (a skip and a branch of different shapes raise ``ValueError``). It takes ``(batch, length)``
(one channel: a channel axis is added, as MNIST-1D comes) or ``(batch, length, channels)``.

Choices where no paper fixes them: the stem is the CIFAR ResNet's (a length-3 convolution to ``stem_width``
channels, then norm and activation in the post order) or, with ``stem='imagenet'``, a length-7 stride-2
convolution and a length-3 stride-2 max pool; stage ``i > 0`` starts with stride 2, as in the 2-D ResNets.

Named configurations:

- ``small_resnet1d(width=7)``: three stages of one basic block each, widths ``(width, 2 width, 4 width)``, the stem
  ``width`` wide, BatchNorm, post order, option A: 40 -> 40 -> 20 -> 10 positions on MNIST-1D. With the default
  ``width=7`` it has 5,225 parameters (plus BatchNorm's running statistics), the reference CNN's 5,210 within 0.3%
  (``resjax.nn.reference``), so ``experiments.mnist1d_models`` compares the two at one size (``width=8``: 6,738).
- the reference CNN of the MNIST-1D paper (three stride-2 convolutions, no skips) is ``resjax.nn.reference.ReferenceCNN``.

``build_model`` kinds: ``resnet1d`` (``ResNet1D``'s fields) and ``small_resnet1d``.
"""

from __future__ import annotations

from typing import Any

import jax

from resjax.nn.block import accept_moved_settings
from resjax.nn.residual import check_positive
from resjax.nn.resnet import ResNet

__all__ = ["ResNet1D", "small_resnet1d"]


def as_signal(x: jax.Array, setting: str = "signals") -> jax.Array:
    """``x`` as ``(batch, length, channels)``: a ``(batch, length)`` input gets one channel; any other rank than 2
    or 3 raises ``ValueError`` naming ``setting``."""
    if x.ndim == 2:
        return x[..., None]
    if x.ndim != 3:
        raise ValueError(f"{setting}: expected (batch, length) or (batch, length, channels), got shape "
                         f"{tuple(x.shape)}")
    return x


@accept_moved_settings
class ResNet1D(ResNet):
    """A staged 1-D convolutional ResNet (see the module docstring and ``ResNet``, whose fields it has).

    Call as ``model(signals, train, tau)`` with signals ``(batch, length)`` or ``(batch, length, channels)``;
    returns the logits ``(batch, num_classes)``. Sows as ``ResNet`` (``stem``, every block's ``block_out``,
    ``pre_logits``).
    """

    def __call__(self, x: jax.Array, train: bool | None = None, tau: Any = None) -> jax.Array:
        """Classify signals: ``ResNet.__call__`` on ``as_signal(x)``.

        Raises:
            ValueError: ``x`` not of rank 2 or 3 (names ``signals``); the rest as ``ResNet.__call__``.
        """
        return super().__call__(as_signal(x), train, tau)


def small_resnet1d(width: int = 7, num_classes: int = 10, **kwargs: Any) -> ResNet1D:
    """A small 1-D ResNet: stages of one basic block at widths ``(width, 2 width, 4 width)``, stem ``width`` wide
    (5,225 parameters at ``width=7``, 10 classes: the reference CNN's size); any ``ResNet1D`` field can be
    overridden."""
    check_positive("width", width)
    fields = dict(stage_sizes=(1, 1, 1), stage_widths=(width, 2 * width, 4 * width), stem_width=width, **kwargs)
    return ResNet1D(num_classes=num_classes, **fields)
