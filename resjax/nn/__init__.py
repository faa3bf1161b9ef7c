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


def build_model(config=None, /, num_classes: int | None = None, **kwargs):
    """A model from its config: ``config`` is a mapping (``ConfigDict`` or dict) with ``kind`` and the
    model's fields, or ``kind`` as a string with the fields as keyword arguments.

    Kinds: ``plain_mlp``, ``residual_mlp``, ``residual_stack`` (``resjax.nn.mlp``); ``tau_resnet`` (Zhang et
    al.'s fully connected models: ``variant`` = 'tau' | 'bn' | 'fixup' | 'plain', then ``tau_resnet``'s
    arguments); ``resnet`` (``ResNet``'s fields), ``cifar_resnet`` (``depth``, ``widen_factor``, ...),
    ``imagenet_resnet`` (``depth``), ``taki_resnet`` (``num_blocks``, ``norm``, ``kernel_init``);
    ``densenet``, ``densenet121``, ``densenet_bc_cifar``; ``unet``; ``hourglass`` (``StackedHourglass``).
    ``num_classes``: the data's class count, used for classifiers whose config does not set it.
    Unknown kinds and bad fields raise ``ValueError`` naming the setting."""
    fields = dict(config) if config is not None and not isinstance(config, str) else {}
    if isinstance(config, str):
        fields["kind"] = config
    fields.update(kwargs)
    kind = fields.pop("kind", None)
    families = _families()
    if kind not in families:
        raise ValueError(f"model.kind: unknown model {kind!r}; choose one of {tuple(families)}")
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
