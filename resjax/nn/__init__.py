"""Flax linen modules for residual networks; see each file's docstring."""

import math

import numpy as np

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
    check_tau_field,
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
    "unstack_scanned", "build_model", "tau_resnet", "CLASSIFIERS",
]


def _families() -> dict:
    from resjax.nn import resnet

    return {
        "plain_mlp": PlainMLP, "residual_mlp": ResidualMLP, "residual_stack": ResidualStack,
        "tau_resnet": None,  # variant -> tau_resnet(variant, ...)
        "resnet": resnet.ResNet, "cifar_resnet": resnet.cifar_resnet, "imagenet_resnet": resnet.imagenet_resnet,
        "taki_resnet": resnet.taki_resnet,
        "densenet": DenseNet, "densenet121": densenet121, "densenet_bc_cifar": densenet_bc_cifar,
        "unet": UNet, "hourglass": StackedHourglass,
    }


CLASSIFIERS = ("plain_mlp", "residual_mlp", "tau_resnet", "resnet", "cifar_resnet", "imagenet_resnet", "taki_resnet",
               "densenet", "densenet121", "densenet_bc_cifar")


def _floats(value):
    """The floats in a field value: the value itself, or the floats of a (nested) tuple or list."""
    if isinstance(value, (float, np.floating)):
        yield float(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _floats(v)


def check_model_fields(fields: dict) -> None:
    """Raise ``ValueError`` naming ``model.<field>`` for a non-finite float field and for a ``tau`` that is
    not a finite number > 0 or a known rule (a rule is checked for its form; its K is the model's)."""
    for name, value in fields.items():
        if name != "tau" and any(not math.isfinite(v) for v in _floats(value)):
            raise ValueError(f"model.{name}: must be a finite number, got {value!r}")
    if "tau" in fields:
        try:
            check_tau_field(fields["tau"], None)
        except ValueError as err:
            raise ValueError(f"model.{err}") from None


def build_model(config=None, /, num_classes: int | None = None, **kwargs):
    """A model from its config: ``config`` is a mapping (``ConfigDict`` or dict) with ``kind`` and the
    model's fields, or ``kind`` as a string with the fields as keyword arguments.

    Kinds: ``plain_mlp``, ``residual_mlp``, ``residual_stack`` (``resjax.nn.mlp``); ``tau_resnet`` (Zhang et
    al.'s fully connected models: ``variant`` = 'tau' | 'bn' | 'fixup' | 'plain', then ``tau_resnet``'s
    arguments); ``resnet`` (``ResNet``'s fields), ``cifar_resnet`` (``depth``, ``widen_factor``, ...),
    ``imagenet_resnet`` (``depth``), ``taki_resnet`` (``num_blocks``, ``norm``, ``kernel_init``);
    ``densenet``, ``densenet121``, ``densenet_bc_cifar``; ``unet``; ``hourglass`` (``StackedHourglass``).
    ``num_classes``: the data's class count, used for classifiers whose config does not set it.
    Unknown kinds and bad fields raise ``ValueError`` naming the setting: every float field (and every
    float in a tuple field) must be finite (``model.<field>: must be a finite number, got nan``), and
    ``tau`` a finite number > 0 or a known rule (``model.tau: ...``)."""
    fields = dict(config) if config is not None and not isinstance(config, str) else {}
    if isinstance(config, str):
        fields["kind"] = config
    fields.update(kwargs)
    kind = fields.pop("kind", None)
    families = _families()
    if kind not in families:
        raise ValueError(f"model.kind: unknown model {kind!r}; choose one of {tuple(families)}")
    check_model_fields(fields)
    if num_classes is not None and kind in CLASSIFIERS:
        fields.setdefault("num_classes", num_classes)
    if kind == "tau_resnet":
        if "variant" not in fields:
            raise ValueError("model.variant: a tau_resnet config needs variant = one of ('tau', 'bn', 'fixup', 'plain')")
        return tau_resnet(fields.pop("variant"), **fields)
    try:
        return families[kind](**fields)
    except TypeError as err:  # an unknown field
        raise ValueError(f"model: {err} (model.kind={kind!r})") from None
