"""Flax linen modules for residual networks; see each file's docstring."""

from resjax.nn.init import INITIALIZERS, get_initializer
from resjax.nn.init import BIAS_INITIALIZERS, get_bias_initializer
from resjax.nn.mlp import PlainMLP, ResidualMLP, ResidualStack
from resjax.nn.norms import NORMS, make_norm
from resjax.nn.residual import (ORDERS, SCALINGS, ResidualBlock, residual_add, residual_stack, resolve_tau,
                                stack_unrolled, unstack_scanned)

__all__ = [
    "BIAS_INITIALIZERS", "INITIALIZERS", "NORMS", "ORDERS", "SCALINGS", "PlainMLP", "ResidualBlock", "ResidualMLP", "ResidualStack",
    "get_bias_initializer", "get_initializer", "make_norm", "residual_add", "residual_stack", "resolve_tau", "stack_unrolled",
    "unstack_scanned", "build_model",
]


def build_model(kind: str, **kwargs):
    """A model from a config: ``kind`` is ``'plain_mlp'`` or ``'residual_mlp'``, the rest are its fields."""
    models = {"plain_mlp": PlainMLP, "residual_mlp": ResidualMLP}
    if kind not in models:
        raise ValueError(f"model.kind: unknown model {kind!r}; choose one of {tuple(models)}")
    return models[kind](**kwargs)
