"""A GRU cell with PyTorch's parameterisation: ``TorchGRUCell``, for ``nn.RNN`` and ``nn.Bidirectional``.

It computes PyTorch's ``torch.nn.GRU`` step, ``x`` the input and ``h`` the carry (the previous output)::

    r  = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
    z  = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
    n  = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

with every weight and bias drawn from U(-1/sqrt(H), 1/sqrt(H)) by default (H = ``features``, the hidden size),
PyTorch's default. Its parameters are laid out as PyTorch's, transposed to flax's ``(in, out)``: ``input_kernel``
``(I, 3H)`` and ``input_bias`` ``(3H,)`` (``weight_ih_l0.T`` and ``bias_ih_l0``), ``hidden_kernel`` ``(H, 3H)``
and ``hidden_bias`` ``(3H,)`` (``weight_hh_l0.T`` and ``bias_hh_l0``), the gates in PyTorch's order r, z, n along
the last axis. ``from_torch_gru`` gives these parameters for a ``torch.nn.GRU``.

How it differs from flax's ``nn.GRUCell``: flax's cell computes the same formulas (``b_hn`` inside the reset
product too, the same sign of ``z``: ``z`` near 1 keeps the old state) but has one bias per reset and update gate,
on the input side (``b_ir``, ``b_iz``), where PyTorch has two (``b_ir`` and ``b_hr``, ``b_iz`` and ``b_hz``); the
candidate ``n`` has two biases in both (``b_in`` outside the reset product, ``b_hn`` inside). So this cell has
``3 (H I + H^2 + 2 H)`` parameters where flax's has ``3 (H I + H^2 + H) + H``, ``2 H`` fewer (162 and 150 at
H = 6, I = 1). The two compute the same function class (the sum ``b_ir + b_hr`` acts as one free bias), but they
do not train alike: the two biases of a gate get the same gradient, so under SGD their sum moves at twice the
learning rate of one bias, and under Adam, whose step is about the learning rate whatever the gradient's scale,
the sum also moves about twice as far a step as one bias would (weight decay, too, acts on each of the two).
Their initial sum is also triangular on +-2/sqrt(H), not uniform on +-1/sqrt(H). Only this cell reproduces a
PyTorch GRU's training step by step.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers

from resjax.nn.init import Initializer, drawn_in_float32

__all__ = ["TorchGRUCell", "from_torch_gru"]


def _torch_uniform(features: int) -> Initializer:
    """PyTorch's GRU default: U(-1/sqrt(features), 1/sqrt(features)), drawn in at least float32."""
    bound = 1.0 / math.sqrt(features)

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return drawn_in_float32(init)


class TorchGRUCell(nn.RNNCellBase):
    """A GRU cell with PyTorch's parameters: two biases per gate, ``torch.nn.GRU``'s layout (module docstring).

    Use it where ``nn.GRUCell`` goes: ``nn.RNN(TorchGRUCell(6))``, ``nn.Bidirectional(nn.RNN(TorchGRUCell(6)),
    nn.RNN(TorchGRUCell(6)))``.

    Attributes:
        features: the hidden size H (the carry's and the output's features).
        kernel_init: initialiser of ``input_kernel`` and ``hidden_kernel``; ``None`` (the default): U(+-1/sqrt(H)).
        bias_init: initialiser of ``input_bias`` and ``hidden_bias``; ``None`` (the default): U(+-1/sqrt(H)).
        dtype: the computation's dtype (``None``: inferred from the inputs and parameters, as flax's layers do).
        param_dtype: the parameters' dtype (default float32); the carry starts in it, as in flax's cell. Every
            initialiser draws in at least float32 and rounds to a narrower ``param_dtype`` (``resjax.nn.init``).
        carry_init: the initial carry's initialiser (default zeros).
    """

    features: int
    kernel_init: Initializer | None = None
    bias_init: Initializer | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: Initializer = initializers.zeros_init()

    @nn.compact
    def __call__(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: ``(h', h')`` from the carry ``h`` ``(..., H)`` and the input ``x`` ``(..., I)`` (all axes
        but the last are batch axes)."""
        h = carry
        hidden = self.features
        default = _torch_uniform(hidden)
        kernel_init = drawn_in_float32(self.kernel_init) if self.kernel_init is not None else default
        bias_init = drawn_in_float32(self.bias_init) if self.bias_init is not None else default
        w_i = self.param("input_kernel", kernel_init, (inputs.shape[-1], 3 * hidden), self.param_dtype)
        b_i = self.param("input_bias", bias_init, (3 * hidden,), self.param_dtype)
        w_h = self.param("hidden_kernel", kernel_init, (hidden, 3 * hidden), self.param_dtype)
        b_h = self.param("hidden_bias", bias_init, (3 * hidden,), self.param_dtype)
        x, h_in, w_i, b_i, w_h, b_h = nn.dtypes.promote_dtype(inputs, h, w_i, b_i, w_h, b_h, dtype=self.dtype)
        i_r, i_z, i_n = jnp.split(x @ w_i + b_i, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(h_in @ w_h + b_h, 3, axis=-1)
        r = jax.nn.sigmoid(i_r + h_r)
        z = jax.nn.sigmoid(i_z + h_z)
        n = jnp.tanh(i_n + r * h_n)
        new_h = (1.0 - z) * n + z * h
        return new_h, new_h

    @nn.nowrap
    def initialize_carry(self, rng: jax.Array, input_shape: tuple[int, ...]) -> jax.Array:
        """The initial carry ``(*batch, features)`` for inputs of shape ``(*batch, I)``, in ``param_dtype``."""
        return self.carry_init(rng, tuple(input_shape[:-1]) + (self.features,), self.param_dtype)

    @property
    def num_feature_axes(self) -> int:
        """The inputs' feature axes: 1 (the last)."""
        return 1


def _array(value: Any) -> np.ndarray:
    """A torch tensor (or anything array-like) as a numpy array, its dtype kept."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def from_torch_gru(gru: Any, dtype: Any = None) -> dict[str, np.ndarray] | tuple[dict[str, np.ndarray], ...]:
    """``TorchGRUCell``'s parameters for a one-layer ``torch.nn.GRU`` (the module or its ``state_dict``): a dict
    ``{input_kernel, input_bias, hidden_kernel, hidden_bias}`` of numpy arrays, or for a bidirectional GRU the
    tuple ``(forward, backward)`` of two, for the cells of ``nn.Bidirectional``'s forward and backward ``nn.RNN``.

    Each kernel is the torch weight transposed; a GRU built with ``bias=False`` gets zero biases. ``dtype``: the
    arrays' dtype (``None``: the tensors'). torch is not imported (a module is read through ``state_dict()``). A
    GRU of several layers, or a state_dict without ``weight_ih_l0``, raises ``ValueError`` naming ``gru``."""
    state = gru.state_dict() if hasattr(gru, "state_dict") else gru
    if not isinstance(state, Mapping) or "weight_ih_l0" not in state:
        raise ValueError("gru: expected a torch.nn.GRU or its state_dict (with weight_ih_l0)")
    if any("_l1" in key for key in state):
        raise ValueError(f"gru: only a one-layer GRU maps onto one TorchGRUCell; got the keys {sorted(state)}")

    def cell(suffix: str) -> dict[str, np.ndarray]:
        w_i, w_h = _array(state[f"weight_ih_l0{suffix}"]), _array(state[f"weight_hh_l0{suffix}"])
        zeros = np.zeros(w_i.shape[0], w_i.dtype)
        params = {"input_kernel": w_i.T, "input_bias": _array(state.get(f"bias_ih_l0{suffix}", zeros)),
                  "hidden_kernel": w_h.T, "hidden_bias": _array(state.get(f"bias_hh_l0{suffix}", zeros))}
        return {k: np.ascontiguousarray(v, dtype=dtype) for k, v in params.items()}

    return (cell(""), cell("_reverse")) if "weight_ih_l0_reverse" in state else cell("")
