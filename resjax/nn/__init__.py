"""Flax linen modules for residual networks; see each file's docstring."""

from resjax.nn.conv_blocks import (
    BasicBranch,
    BottleneckBranch,
    ConvResidualBlock,
    DenseBlock,
    DenseLayer,
    Transition,
)
from resjax.nn.densenet import DenseNet, densenet121, densenet_bc_cifar
from resjax.nn.hourglass import Hourglass, StackedHourglass
from resjax.nn.init import (
    BIAS_INITIALIZERS,
    INITIALIZERS,
    get_bias_initializer,
    get_initializer,
)
from resjax.nn.mlp import PlainLayer, PlainMLP, ResidualMLP, ResidualStack
from resjax.nn.norms import NORMS, make_norm
from resjax.nn.residual import (
    ORDERS,
    SCALINGS,
    ResidualBlock,
    concat_merge,
    residual_add,
    residual_stack,
    stack_blocks,
    resolve_tau,
    stack_unrolled,
    unstack_scanned,
)
from resjax.nn.tau_resnet import tau_resnet
from resjax.nn.unet import UNet

__all__ = [
    "BasicBranch", "BottleneckBranch", "ConvResidualBlock", "DenseBlock", "DenseLayer", "Hourglass",
    "StackedHourglass", "Transition", "UNet", "DenseNet", "densenet121", "densenet_bc_cifar",
    "BIAS_INITIALIZERS", "INITIALIZERS", "NORMS", "ORDERS", "SCALINGS", "PlainLayer", "PlainMLP", "ResidualBlock", "ResidualMLP", "ResidualStack",
    "concat_merge", "get_bias_initializer", "get_initializer", "make_norm", "residual_add", "residual_stack", "resolve_tau", "stack_blocks", "stack_unrolled",
    "unstack_scanned", "build_model", "tau_resnet",
]


def build_model(kind: str, **kwargs):
    """A model from a config: ``kind`` is ``'plain_mlp'``, ``'residual_mlp'`` or ``'tau_resnet'``; the rest are
    its fields (for ``'tau_resnet'``: ``variant`` = its ``kind``, then ``tau_resnet``'s arguments)."""
    if kind == "tau_resnet":
        if "variant" not in kwargs:
            raise ValueError("model.variant: a tau_resnet config needs variant = one of ('tau', 'bn', 'fixup', 'plain')")
        return tau_resnet(kwargs.pop("variant"), **kwargs)
    models = {"plain_mlp": PlainMLP, "residual_mlp": ResidualMLP}
    if kind not in models:
        raise ValueError(f"model.kind: unknown model {kind!r}; choose one of {(*models, 'tau_resnet')}")
    return models[kind](**kwargs)
