"""The reference models of the MNIST-1D paper (Greydanus 2020; the ``mnist1d`` repository's
``notebooks/models.py``), as Flax modules, for its published table (``experiments.mnist1d_models``).

Each takes ``(batch, length)`` (MNIST-1D's examples; ``(batch, length, 1)`` too) and returns logits
``(batch, num_classes)``. Every layer is initialised as PyTorch initialises the reference's layer by default:
kernels and biases uniform in +-1/sqrt(fan_in) (``'torch_default'``; a convolution's fan-in is
``kernel size * input channels``; the GRU's every weight and bias uniform in +-1/sqrt(hidden), PyTorch's
``nn.GRU`` default).

- ``LogisticRegression``: one linear layer, length -> classes (410 parameters at length 40, 10 classes).
- ``ReferenceMLP`` (the paper's "MLP", ``MLPBase``): ``h = relu(W1 x)``, ``h = h + relu(W2 h)``, ``W3 h``, width
  100 (15,210 parameters). Its middle layer is a residual block whose branch ends in its activation, with nothing
  after the sum: in resjax's block options that is neither order (the post order, ``relu(h + W h)``, activates
  after the sum; the pre order, ``h + W relu(h)``, activates the branch's input), so the block is
  ``ResidualBlock(width, branch=<linear -> relu>, post_activation=False)``: the one block class with a branch
  module of its own under an identity skip, added by ``residual_add``; no norm, no branch scaling. (As ``h >= 0``
  after the first layer's relu, a relu after the sum would change nothing here: the block's output is >= 0.)
- ``ReferenceCNN`` (the paper's "CNN", ``ConvBase``): three 1-D convolutions with stride 2 and padding 1 on each
  side (kernel 5 from 1 to 25 channels, then 3 and 3 at 25), relu after each, flattened (5 positions x 25
  channels = 125 at length 40), one linear layer to the classes (5,210 parameters). No skips, no norm. The
  flattening is channels-last (position-major) where PyTorch's is channel-major: the same function class, its
  linear weights permuted.
- ``ReferenceGRU`` (the paper's "GRU", ``GRUBase``): a bidirectional GRU of hidden size 6 over the positions (one
  input feature a step), initial state zero, every position's outputs of both directions (backward outputs at
  their own positions) flattened (40 x 12 = 480) into one linear layer; ``nn.RNN`` and ``nn.Bidirectional``
  around one of two cells, chosen by ``cell``:

  - ``cell='torch'`` (the default): ``TorchGRUCell`` (``resjax.nn.recurrent``), PyTorch's ``nn.GRU`` step with its
    parameters (two biases on every gate: ``b_ir`` and ``b_hr``, ``b_iz`` and ``b_hz``, ``b_in`` and ``b_hn``),
    162 parameters per direction, 5,134 in all: the reference's count, and its training dynamics;
  - ``cell='flax'``: flax's ``nn.GRUCell``, the same formulas (``b_hn`` inside the reset product, the same sign of
    the update gate) without the hidden-side biases ``b_hr`` and ``b_hz``: the same function class (the sum of a
    gate's two biases is one free bias), 150 parameters per direction, 5,110 in all. It trains differently: the
    reference's two biases of a gate move together, about twice one bias's step under SGD or Adam, and start as
    a sum of two uniform draws (``resjax.nn.recurrent``'s docstring).

  Both draw every weight and bias uniform in +-1/sqrt(hidden). The parameter trees differ (``input_kernel``,
  ``input_bias``, ``hidden_kernel``, ``hidden_bias`` per direction against flax's ``ir``, ``iz``, ``in``, ``hr``,
  ``hz``, ``hn`` layers).

``build_model`` kinds: ``logistic``, ``reference_mlp``, ``reference_cnn``, ``reference_gru``.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from resjax.nn.block import ResidualBlock
from resjax.nn.init import drawn_in_float32, get_bias_initializer, get_initializer
from resjax.nn.precision import layer_dtypes, resolve_dtype
from resjax.nn.recurrent import TorchGRUCell
from resjax.nn.residual import check_positive
from resjax.nn.signal import as_signal

__all__ = ["LogisticRegression", "ReferenceCNN", "ReferenceGRU", "ReferenceMLP"]

TORCH = "torch_default"

#: The values of ``ReferenceGRU.cell``: ``'torch'`` (``TorchGRUCell``, PyTorch's parameters) and ``'flax'``
#: (flax's ``nn.GRUCell``).
GRU_CELLS = ("torch", "flax")


def _flat(x: jax.Array) -> jax.Array:
    """``(batch, length)`` or ``(batch, length, channels)`` as ``(batch, features)``; another rank raises
    ``ValueError`` naming ``signals``."""
    return as_signal(x).reshape(x.shape[0], -1)


def _param_dtype(module: nn.Module) -> Any:
    """The module's ``param_dtype`` as flax's layers take it (``None``: float32)."""
    return layer_dtypes(None, module.param_dtype)["param_dtype"]


def _dense(features: int, fan_in: int, name: str, param_dtype: Any = jnp.float32) -> nn.Dense:
    """A linear layer initialised as PyTorch's ``nn.Linear`` (kernel and bias U(+-1/sqrt(fan_in)))."""
    return nn.Dense(features, kernel_init=get_initializer(TORCH), bias_init=get_bias_initializer(TORCH, fan_in),
                    name=name, param_dtype=param_dtype)


class _Reference(nn.Module):
    """What the reference models share: ``num_classes`` and ``param_dtype`` (every parameter's dtype, flax's
    ``param_dtype``: ``None``, float32, or one of ``DTYPES``), checked at construction. They compute in float32
    (``dtype`` is not theirs: ``build_model`` drops a float32 one and refuses a half one), except the GRU's
    recurrence under a half ``param_dtype``, which runs in that dtype (either cell keeps its carry in it)."""

    num_classes: int = 10
    param_dtype: Any = None

    def __post_init__(self):
        check_positive("num_classes", self.num_classes)
        resolve_dtype(self.param_dtype, "param_dtype")
        super().__post_init__()


class LogisticRegression(_Reference):
    """Multinomial logistic regression: ``W x + b`` on the flattened signal (see the module docstring)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """The logits ``(batch, num_classes)``; ``train`` is accepted and unused (no norm)."""
        h = _flat(x)
        return _dense(self.num_classes, h.shape[-1], "linear", _param_dtype(self))(h)


class _LinearRelu(nn.Module):
    """The reference MLP's branch: ``relu(W h + b)`` (PyTorch's default initialisation)."""

    features: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, train: bool | None = None) -> jax.Array:
        return nn.relu(_dense(self.features, h.shape[-1], "linear", self.param_dtype)(h))


class ReferenceMLP(_Reference):
    """The MNIST-1D paper's MLP: ``relu(W1 x)``, one residual block ``h + relu(W2 h)``, ``W3 h`` (module docstring).

    Sows ``stem_out`` (the first layer's activated output) and the block's ``block_out``, as resjax's MLPs do."""

    width: int = 100

    def __post_init__(self):
        check_positive("width", self.width)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """The logits ``(batch, num_classes)``; ``train`` is accepted and unused (no norm)."""
        h = _flat(x)
        dtype = _param_dtype(self)
        h = nn.relu(_dense(self.width, h.shape[-1], "stem", dtype)(h))
        self.sow("intermediates", "stem_out", h)
        h = ResidualBlock(self.width, branch=_LinearRelu(self.width, dtype), post_activation=False,
                          param_dtype=self.param_dtype, name="blocks_0")(h, train)
        return _dense(self.num_classes, self.width, "head", dtype)(h)


class ReferenceCNN(_Reference):
    """The MNIST-1D paper's CNN: three stride-2 1-D convolutions with relu, flatten, linear (module docstring).

    Attributes:
        channels: every convolution's output channels. Default 25.
        kernel_sizes: the three kernels. Default ``(5, 3, 3)``.
        num_classes: default 10; param_dtype: every parameter's dtype (``None``: float32), as ``_Reference``'s.
    """

    channels: int = 25
    kernel_sizes: tuple[int, ...] = (5, 3, 3)

    def __post_init__(self):
        check_positive("channels", self.channels)
        if not self.kernel_sizes:
            raise ValueError("kernel_sizes: need at least one convolution, got ()")
        for k in self.kernel_sizes:
            check_positive("kernel_sizes", k)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """The logits ``(batch, num_classes)``; ``train`` is accepted and unused (no norm)."""
        h = as_signal(x)
        for i, k in enumerate(self.kernel_sizes):
            fan_in = k * h.shape[-1]
            h = nn.Conv(self.channels, (k,), strides=(2,), padding=[(1, 1)], kernel_init=get_initializer(TORCH),
                        bias_init=get_bias_initializer(TORCH, fan_in), name=f"conv_{i}",
                        param_dtype=_param_dtype(self))(h)
            h = nn.relu(h)
        h = h.reshape(h.shape[0], -1)
        return _dense(self.num_classes, h.shape[-1], "head", _param_dtype(self))(h)


class ReferenceGRU(_Reference):
    """The MNIST-1D paper's GRU: a bidirectional GRU over the positions, flattened, linear (module docstring).

    Attributes:
        hidden: the GRU's state size per direction. Default 6.
        bidirectional: default ``True`` (the reference's).
        cell: ``'torch'`` (the default: ``TorchGRUCell``, PyTorch's parameters, 5,134 at the defaults) or ``'flax'``
            (flax's ``nn.GRUCell``, no hidden-side reset and update biases, 5,110); see the module docstring.
        num_classes: default 10; param_dtype: every parameter's dtype (``None``: float32), as ``_Reference``'s.
    """

    hidden: int = 6
    bidirectional: bool = True
    cell: str = "torch"

    def __post_init__(self):
        check_positive("hidden", self.hidden)
        if not isinstance(self.bidirectional, bool):
            raise ValueError(f"bidirectional: must be True or False, got {self.bidirectional!r}")
        if not isinstance(self.cell, str) or self.cell not in GRU_CELLS:
            raise ValueError(f"cell: unknown value {self.cell!r}; choose one of {GRU_CELLS}")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """The logits ``(batch, num_classes)``; ``train`` is accepted and unused."""
        # either cell keeps its carry in the parameters' dtype: with a half param_dtype the recurrence runs in it
        h = as_signal(x).astype(_param_dtype(self))
        bound = 1.0 / math.sqrt(self.hidden)

        @drawn_in_float32  # a half param_dtype rounds the float32 draws (resjax.nn.init)
        def uniform(key: jax.Array, shape: Any, dtype: Any = jnp.float32) -> jax.Array:
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        def rnn(name: str) -> nn.RNN:
            if self.cell == "torch":  # U(+-1/sqrt(hidden)) by default, drawn in float32 (resjax.nn.init)
                return nn.RNN(TorchGRUCell(self.hidden, param_dtype=_param_dtype(self), name=f"{name}_cell"),
                              name=name)
            cell = nn.GRUCell(self.hidden, kernel_init=uniform, recurrent_kernel_init=uniform, bias_init=uniform,
                              param_dtype=_param_dtype(self), name=f"{name}_cell")
            return nn.RNN(cell, name=name)

        if self.bidirectional:
            h = nn.Bidirectional(rnn("forward"), rnn("backward"), name="gru")(h)
        else:
            h = rnn("gru")(h)
        h = h.reshape(h.shape[0], -1)
        return _dense(self.num_classes, h.shape[-1], "head", _param_dtype(self))(h)
