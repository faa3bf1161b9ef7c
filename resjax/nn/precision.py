"""Mixed precision: the ``dtype`` setting of the convolutional models (issue #13).

The convolutional models (``ResNet`` and its blocks, ``cifar_resnet``, ``imagenet_resnet``, ``TakiResNet``,
``DenseNet`` and their blocks) have a field ``dtype``: the dtype of the computation, as in flax's
``examples/imagenet``. With ``dtype='bfloat16'`` (or ``jnp.bfloat16``):

- the input is cast to ``dtype`` at the stem; every convolution, dense layer, activation, pooling and
  residual addition computes in ``dtype`` (flax layers get ``dtype=dtype, param_dtype=float32``);
- every parameter is created and stored in float32 (the scalar parameters of Fixup, SkipInit, tau and the
  scalar biases included) and cast to ``dtype`` where it is used, so the gradients and the optimiser state
  are float32;
- BatchNorm computes the batch mean and variance in float32 (its input promoted to float32), keeps its
  running estimates (``batch_stats``) in float32 and returns ``dtype`` (flax's
  ``force_float32_reductions``, on by default);
- the logits are returned as float32, so a loss computed from them (``resjax.train``'s cross-entropy) is
  float32.

With ``dtype=None`` nothing is cast: a float64 input under ``jax_enable_x64`` (``resjax.interop``'s
comparisons with PyTorch) still gives float64 logits and float64 scalar parameters, as before the field
existed.

``dtype=None`` (the default) and ``'float32'`` compute in float32 and give bit-identical results (tested).
``'float16'`` is accepted, but nothing here scales the loss, so small gradients can underflow in float16;
``'bfloat16'`` (float32's exponent range) needs no loss scaling and is the one to use on TPUs and recent
GPUs. On a CPU, bfloat16 convolutions are emulated and usually slower than float32.

``param_dtype`` (every model and block, as flax's layers have it): the dtype in which every parameter is
created and stored, ``None`` (the default) or one of ``DTYPES``. ``None`` keeps flax's float32 (and the
scalar parameters at least the stream's dtype, as above); ``'bfloat16'`` stores every parameter, the scalar
ones and the norms' scales and offsets included, in bfloat16 (BatchNorm's running estimates stay float32, as
flax keeps them). It is independent of ``dtype``: ``dtype='bfloat16', param_dtype='bfloat16'`` is pure
bfloat16.

A model's ``repr`` (which ``resjax.train`` stores with a checkpoint to recognise the model that made it)
omits a ``dtype`` that computes in float32, so float32 models describe themselves as they did before the
field existed.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["DTYPES", "layer_dtypes", "resolve_dtype"]

#: The values of the ``dtype`` setting, by name (``jnp`` dtypes equal to them are accepted too).
DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(value: Any, setting: str = "dtype") -> np.dtype | None:
    """The computation dtype a ``dtype`` setting asks for: ``None`` for ``None`` (float32, flax's default
    inference), else the numpy dtype of one of ``DTYPES``.

    Args:
        value: ``None``, one of the names ``DTYPES`` (``'float32'``, ``'bfloat16'``, ``'float16'``) or a dtype
            equal to one of them (``jnp.bfloat16``, ``jnp.dtype('float16')``, ``np.float32``, ...).
        setting: the name the error gives the setting (``'model.dtype'`` from ``build_model``).

    Returns:
        ``None`` or ``np.dtype('float32' | 'bfloat16' | 'float16')``.

    Raises:
        ValueError: any other value, naming ``setting``: ``dtype: unknown value 'bf17'; choose one of
            ('float32', 'bfloat16', 'float16')``.
    """
    if value is None:
        return None
    error = ValueError(f"{setting}: unknown value {value!r}; choose one of {DTYPES} (or None: float32)")
    if isinstance(value, str):
        if value not in DTYPES:
            raise error
        return jnp.dtype(value)
    if isinstance(value, bool):
        raise error
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError):
        raise error from None
    if dtype.name not in DTYPES:
        raise error
    return dtype


def layer_dtypes(dtype: Any, param_dtype: Any = None) -> dict[str, Any]:
    """The keyword arguments that make a flax layer compute in ``dtype`` with ``param_dtype`` parameters:
    ``{'dtype': resolve_dtype(dtype), 'param_dtype': resolve_dtype(param_dtype) or jnp.float32}`` (``None``:
    flax's own defaults, so a float32 model is unchanged). Raises ``ValueError`` naming ``dtype`` or
    ``param_dtype`` for a bad value."""
    resolved = resolve_dtype(param_dtype, "param_dtype")
    return {"dtype": resolve_dtype(dtype), "param_dtype": jnp.float32 if resolved is None else resolved}


def is_float32(dtype: Any) -> bool:
    """Whether a (valid) ``dtype`` setting computes in float32: ``None`` or float32."""
    resolved = resolve_dtype(dtype)
    return resolved is None or resolved == jnp.float32


class PrecisionRepr:
    """Mixin for flax modules with a ``dtype`` field (and ``param_dtype``): their ``repr`` leaves out a ``dtype``
    that computes in float32 (``None`` or float32) and a ``param_dtype`` of ``None``, so it equals the ``repr``
    they had before the fields existed (a checkpoint records it; see the module docstring). Other values are
    shown."""

    def __repr__(self) -> str:
        text = super().__repr__()
        if is_float32(getattr(self, "dtype", None)):
            text = re.sub(r"\n    dtype = [^\n]*", "", text, count=1)
        if getattr(self, "param_dtype", None) is None:
            text = re.sub(r"\n    param_dtype = None(?=\n)", "", text, count=1)
        return text
