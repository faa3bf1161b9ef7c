"""Flax linen modules for residual networks: the public API of ``resjax.nn`` (each file's docstring has the details).

Every name below is importable from ``resjax.nn`` (``__all__`` lists them):

- models (classifiers return logits ``(batch, num_classes)``): ``PlainMLP``, ``ResidualMLP``, ``ResidualStack``
  (blocks only: returns the stream) and Zhang et al.'s ``tau_resnet`` (fully connected; ``tau_resnet_config``,
  ``plain_params_from_residual``, ``tau_value``, ``num_blocks_for``); the convolutional ``ResNet`` with
  ``cifar_resnet``, ``imagenet_resnet``, ``imagenet_tau``, ``REPOSITORY_MODELS`` (the peers' CIFAR models) and
  Taki's ``taki_resnet`` (``TakiResNet``, ``TakiBlock``); ``DenseNet``, ``densenet121``, ``densenet_bc_cifar``;
  ``UNet``; ``Hourglass``, ``StackedHourglass``; on 1-D signals ``(batch, length, channels)``, ``ResNet1D`` and
  ``small_resnet1d`` (``resjax.nn.signal``); the MNIST-1D paper's reference models ``LogisticRegression``,
  ``ReferenceMLP``, ``ReferenceCNN``, ``ReferenceGRU`` (``resjax.nn.reference``). ``build_model`` builds any of them from a config
  (``CLASSIFIERS``: the kinds that take ``num_classes``; ``check_model_fields`` checks a config's fields);
- recurrent cells (``resjax.nn.recurrent``): ``TorchGRUCell``, a GRU cell with PyTorch's parameters (two biases
  per gate, ``torch.nn.GRU``'s layout) for ``nn.RNN`` and ``nn.Bidirectional``, and ``from_torch_gru`` (its
  parameters from a ``torch.nn.GRU``);
- blocks: one residual block, ``ResidualBlock`` (``resjax.nn.block``: skip, a branch of kind ``BRANCH_KINDS``
  (``'mlp'``, ``'basic'``, ``'bottleneck'``, ``'conv'``) or of one's own, scale, merge; its settings
  ``BlockSettings``, by kind ``CommonSettings``, ``MLPSettings`` (the MLPs take these), ``ConvSettings`` (``ResNet``
  takes these), with ``block`` for the block itself: ``resolve_block``; ``moved_settings`` and ``route_to_block``
  send another kind's setting to the block), and its
  configurations ``ResNetBlock``, ``TakiBlock``, ``PlainLayer``, ``BasicBranch`` / ``BottleneckBranch``,
  ``ConvResidualBlock``; ``DenseLayer``, ``DenseBlock``, ``Transition``, ``ConvBlock``;
- the residual contract: ``residual_add`` (the one shape-checked addition), ``concat_merge``; stacks of blocks
  (``residual_stack``, ``stack_blocks``, ``stack_unrolled`` / ``unstack_scanned`` between the unrolled and
  scanned parameter layouts); the settings ``ORDERS``, ``SCALINGS``, ``BLOCK_KINDS``, ``SHORTCUTS``,
  ``OPTION_A_INPUTS``, ``CIFAR_DEPTHS``, ``IMAGENET_STAGES``, ``TAU_CONVENTIONS``; tau (``resolve_tau``,
  ``check_tau_field``, ``check_tau_value``, ``check_call_tau``); and the pieces every residual block shares,
  for writing new ones (``scale_branch``, ``close_block``, ``computed_once``, ``fixup_kernel_init``);
- normalisation: ``make_norm`` (every norm by name, ``NORMS``, or any flax normalisation class or partial:
  ``nn.BatchNorm`` is given ``train`` as ``use_running_average``), ``BatchNorm`` (PyTorch's defaults,
  ``BATCHNORM_DEFAULTS``), ``GroupNorm`` (``default_groups``: the groups fit any channel count), ``is_batch_norm``,
  ``check_norm``. ``BatchNorm`` and ``GroupNorm`` carry flax.linen's names: a star import of this package and of
  ``flax.linen`` in one file keeps whichever came last, and ``BatchNorm``'s momentum differs (0.9 here, 0.99 in
  flax); import the modules (``import resjax.nn as rn``) and write ``rn.BatchNorm``;
- initialisers: ``get_initializer`` (``INITIALIZERS``, ``PARAMETRISED_INITIALIZERS``), ``taki_init``,
  ``get_bias_initializer`` (``BIAS_INITIALIZERS``); ``conv_kernel_weights`` counts conv weights;
- mixed precision (``resjax.nn.precision``): the convolutional classifiers and their blocks have a field
  ``dtype`` (``DTYPES``: ``'float32'``, ``'bfloat16'``, ``'float16'``; ``None``, the default, is float32),
  the computation's dtype, with float32 parameters, BatchNorm statistics and logits; ``DTYPE_KINDS`` are the
  ``build_model`` kinds that take it; ``resolve_dtype`` checks a value, ``layer_dtypes`` gives a flax
  layer's ``dtype``/``param_dtype``; the MLP classes, like their ``build_model`` kinds, refuse a half ``dtype``.
  Every model and block has ``param_dtype`` (``None``: float32, flax's), the dtype of all its parameters, whose
  initial values are the float32 draws rounded to it (``resjax.nn.init``), whatever the ``param_dtype``;
- Flax's tools: ``Module.tabulate``, ``nn.tabulate``, ``jax.eval_shape`` of ``init``, ``clone`` and ``bind`` work
  on every kind (pass ``train`` as a Python bool, e.g. ``model.tabulate(key, x, train=False)``).

Conventions shared by every module (written here once: each ``__call__`` docstring refers to them and
states only what is particular to its module, such as its sows):

- shapes: flax's channels-last layout, ``(batch, features)`` for the MLPs, ``(batch, height, width,
  channels)`` for the convolutional models and ``(batch, length, channels)`` for the 1-D ones (which also take
  ``(batch, length)``, one channel);
- ``train: bool | None = None`` at call time: ``True`` = training mode (BatchNorm normalises with the
  minibatch's statistics and updates its running estimates in the ``batch_stats`` collection, so ``apply``
  needs ``mutable=['batch_stats']`` and returns ``(output, updates)``), ``False`` = evaluation (BatchNorm uses
  the running estimates; nothing is mutated). A model with BatchNorm applied without ``train`` (``None``)
  raises ``ValueError`` naming ``train``; ``init`` without it is allowed (it only needs shapes) and creates
  ``batch_stats`` (``mean``, ``var`` per BatchNorm layer) next to ``params``. A module passes ``train`` on to
  its blocks and layers; models without BatchNorm ignore it. ``batch_stats`` is the only collection a
  training call mutates;
- ``tau`` at call time (residual models with ``scaling='tau'`` only): a number or a traced scalar that
  replaces the ``tau`` field, so a sweep over tau is a ``vmap``;
- the residual models sow every block's output (``block_out``) and their stem's (``stem_out``; ``ResNet``:
  ``stem``) into ``'intermediates'`` when ``apply`` is given ``mutable=['intermediates']`` (with ``'batch_stats'`` too in
  training mode), and only then; each ``__call__`` lists its own sows;
- every setting is checked at construction: a bad one raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import numpy as np

from resjax.nn.block import (
    BRANCH_KINDS,
    BasicBranch,
    BlockSettings,
    BottleneckBranch,
    CommonSettings,
    ConvResidualBlock,
    ConvSettings,
    MLPSettings,
    PlainLayer,
    ResidualBlock,
    ResNetBlock,
    TakiBlock,
    moved_settings,
    residual_stack,
    resolve_block,
    route_to_block,
)
from resjax.nn.conv_blocks import (
    DenseBlock,
    DenseLayer,
    Transition,
    conv_kernel_weights,
)
from resjax.nn.densenet import DenseNet, densenet121, densenet_bc_cifar
from resjax.nn.hourglass import Hourglass, StackedHourglass
from resjax.nn.init import (
    BIAS_INITIALIZERS,
    INITIALIZERS,
    PARAMETRISED_INITIALIZERS,
    get_bias_initializer,
    get_initializer,
    taki_init,
)
from resjax.nn.mlp import PlainMLP, ResidualMLP, ResidualStack
from resjax.nn.norms import (
    BATCHNORM_DEFAULTS, NORMS, RUNNING_VARIANCES, BatchNorm, GroupNorm, UnbiasedBatchNorm, check_norm, default_groups,
    is_batch_norm, make_norm, running_variance_of,
)
from resjax.nn.precision import DTYPES, is_float32, layer_dtypes, resolve_dtype
from resjax.nn.residual import (
    ORDERS,
    SCALINGS,
    check_call_tau,
    check_tau_field,
    check_tau_value,
    close_block,
    computed_once,
    concat_merge,
    fixup_kernel_init,
    residual_add,
    resolve_tau,
    scale_branch,
    stack_blocks,
    stack_unrolled,
    unstack_scanned,
)
from resjax.nn.resnet import (  # after init, norms and residual, which it imports
    BLOCK_KINDS,
    CIFAR_DEPTHS,
    IMAGENET_STAGES,
    OPTION_A_INPUTS,
    REPOSITORY_MODELS,
    SHORTCUTS,
    TAU_CONVENTIONS,
    ResNet,
    TakiResNet,
    cifar_resnet,
    imagenet_resnet,
    imagenet_tau,
    taki_resnet,
)
from resjax.nn.signal import ResNet1D, small_resnet1d  # noqa: I001 (after resnet, which it subclasses)
from resjax.nn.recurrent import TorchGRUCell, from_torch_gru
from resjax.nn.reference import LogisticRegression, ReferenceCNN, ReferenceGRU, ReferenceMLP
from resjax.nn.tau_mlp import num_blocks_for, plain_params_from_residual, tau_resnet, tau_resnet_config, tau_value
from resjax.nn.unet import ConvBlock, UNet

__all__ = [
    # constants: the allowed values of settings, and defaults
    "BATCHNORM_DEFAULTS", "BIAS_INITIALIZERS", "BLOCK_KINDS", "BRANCH_KINDS", "CIFAR_DEPTHS", "CLASSIFIERS", "DTYPES",
    "DTYPE_KINDS", "IMAGENET_STAGES", "INITIALIZERS", "NORMS", "OPTION_A_INPUTS", "ORDERS", "PARAMETRISED_INITIALIZERS",
    "REPOSITORY_MODELS", "RUNNING_VARIANCES", "SCALINGS", "SHORTCUTS", "TAU_CONVENTIONS",
    # modules (flax.linen)
    "BasicBranch", "BatchNorm", "BlockSettings", "BottleneckBranch", "CommonSettings", "ConvBlock", "ConvResidualBlock",
    "ConvSettings", "DenseBlock", "DenseLayer", "DenseNet", "GroupNorm", "Hourglass", "LogisticRegression",
    "MLPSettings", "PlainLayer", "PlainMLP", "ReferenceCNN", "ReferenceGRU", "ReferenceMLP", "ResNet", "ResNet1D",
    "ResNetBlock", "ResidualBlock", "ResidualMLP", "ResidualStack", "StackedHourglass", "TakiBlock",
    "TakiResNet", "TorchGRUCell", "Transition", "UNet", "UnbiasedBatchNorm",
    # functions
    "build_model", "check_call_tau", "check_model_fields", "check_norm", "check_tau_field", "check_tau_value",
    "cifar_resnet", "close_block", "computed_once", "concat_merge", "conv_kernel_weights", "default_groups", "densenet121",
    "densenet_bc_cifar", "fixup_kernel_init", "from_torch_gru", "get_bias_initializer", "get_initializer",
    "imagenet_resnet",
    "imagenet_tau", "is_batch_norm", "layer_dtypes", "make_norm", "moved_settings", "num_blocks_for",
    "plain_params_from_residual", "residual_add", "residual_stack", "resolve_block", "resolve_dtype", "resolve_tau",
    "route_to_block", "running_variance_of", "scale_branch", "small_resnet1d", "stack_blocks", "stack_unrolled",
    "taki_init",
    "taki_resnet", "tau_resnet", "tau_resnet_config", "tau_value", "unstack_scanned",
]


def _families() -> dict[str, Callable[..., nn.Module] | None]:
    """The model kinds of ``build_model``: kind -> the class or function that builds it."""
    return {
        "plain_mlp": PlainMLP, "residual_mlp": ResidualMLP, "residual_stack": ResidualStack,
        "tau_resnet": None,  # variant -> tau_resnet(variant, ...)
        "resnet": ResNet, "cifar_resnet": cifar_resnet, "imagenet_resnet": imagenet_resnet,
        "taki_resnet": taki_resnet,
        "densenet": DenseNet, "densenet121": densenet121, "densenet_bc_cifar": densenet_bc_cifar,
        "unet": UNet, "hourglass": StackedHourglass,
        "resnet1d": ResNet1D, "small_resnet1d": small_resnet1d,
        "logistic": LogisticRegression, "reference_mlp": ReferenceMLP, "reference_cnn": ReferenceCNN,
        "reference_gru": ReferenceGRU,
    }


def _block_setting_models() -> dict[str, type]:
    """The kinds whose model takes the settings of one branch kind: kind -> the model class."""
    return {"plain_mlp": PlainMLP, "residual_mlp": ResidualMLP, "residual_stack": ResidualStack, "resnet": ResNet,
            "cifar_resnet": ResNet, "imagenet_resnet": ResNet, "resnet1d": ResNet1D, "small_resnet1d": ResNet1D}


#: The ``build_model`` kinds that are classifiers (they take ``num_classes`` and return logits); the others
#: (``residual_stack``, ``unet``, ``hourglass``) return a stream, a segmentation map or heatmaps.
CLASSIFIERS = ("plain_mlp", "residual_mlp", "tau_resnet", "resnet", "cifar_resnet", "imagenet_resnet", "taki_resnet",
               "densenet", "densenet121", "densenet_bc_cifar", "resnet1d", "small_resnet1d", "logistic", "reference_mlp",
               "reference_cnn", "reference_gru")

#: The ``build_model`` kinds with a ``dtype`` setting (mixed precision, ``resjax.nn.precision``); the other
#: kinds compute in float32 and accept only a ``dtype`` that means float32.
DTYPE_KINDS = ("resnet", "cifar_resnet", "imagenet_resnet", "taki_resnet", "densenet", "densenet121",
               "densenet_bc_cifar", "resnet1d", "small_resnet1d")


def _floats(value: Any) -> Iterator[float]:
    """The floats in a field value: the value itself, or the floats of a (nested) tuple or list."""
    if isinstance(value, (float, np.floating)):
        yield float(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _floats(v)


def check_model_fields(fields: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming ``model.<field>`` for a non-finite float field, for a ``tau`` that is
    not a finite number > 0 or a known rule (a rule is checked for its form; its K is the model's) and for a
    ``dtype`` that is not one of ``DTYPES`` (or ``None``)."""
    if "dtype" in fields:
        resolve_dtype(fields["dtype"], "model.dtype")
    for name, value in fields.items():
        if name != "tau" and any(not math.isfinite(v) for v in _floats(value)):
            raise ValueError(f"model.{name}: must be a finite number, got {value!r}")
    if "tau" in fields:
        try:
            check_tau_field(fields["tau"], None)
        except ValueError as err:
            raise ValueError(f"model.{err}") from None


def build_model(config: Mapping[str, Any] | str | None = None, /, num_classes: int | None = None,
                **kwargs: Any) -> nn.Module:
    """A model from its config: ``config`` is a mapping (``ConfigDict`` or dict) with ``kind`` and the
    model's fields, or ``kind`` as a string with the fields as keyword arguments.

    Kinds: ``plain_mlp``, ``residual_mlp``, ``residual_stack`` (``resjax.nn.mlp``); ``tau_resnet`` (Zhang et
    al.'s fully connected models: ``variant`` = 'tau' | 'bn' | 'fixup' | 'plain', then ``tau_resnet``'s
    arguments); ``resnet`` (``ResNet``'s fields), ``cifar_resnet`` (``depth``, ``widen_factor``, ...),
    ``imagenet_resnet`` (``depth``), ``taki_resnet`` (``num_blocks``, ``norm``, ``kernel_init``);
    ``densenet``, ``densenet121``, ``densenet_bc_cifar``; ``unet``; ``hourglass`` (``StackedHourglass``);
    ``resnet1d`` (``ResNet1D``'s fields), ``small_resnet1d`` (``width``, ...); the MNIST-1D paper's reference models
    ``logistic``, ``reference_mlp``, ``reference_cnn``, ``reference_gru`` (``resjax.nn.reference``).
    ``num_classes``: the data's class count, used for classifiers whose config does not set it.
    Unknown kinds and bad fields raise ``ValueError`` naming the setting: every float field (and every
    float in a tuple field) must be finite (``model.<field>: must be a finite number, got nan``), and
    ``tau`` a finite number > 0 or a known rule (``model.tau: ...``).
    ``dtype`` (mixed precision, ``resjax.nn.precision``): ``'float32'``, ``'bfloat16'`` or ``'float16'`` (or
    the ``jnp`` dtype; ``None``: float32) for the kinds ``DTYPE_KINDS``: the computation's dtype, with float32
    parameters, BatchNorm statistics and logits. An unknown value raises ``ValueError`` (``model.dtype:
    unknown value 'bf17'; choose one of ...``); the other kinds compute in float32, accept a float32 ``dtype``
    (dropped) and refuse a half one (``ValueError`` naming ``model.dtype`` and the kind).
    Returns the unbound module (call ``init``/``apply`` on it; see the package docstring for ``train``)."""
    fields = dict(config) if config is not None and not isinstance(config, str) else {}
    if isinstance(config, str):
        fields["kind"] = config
    fields.update(kwargs)
    kind = fields.pop("kind", None)
    families = _families()
    if kind not in families:
        raise ValueError(f"model.kind: unknown model {kind!r}; choose one of {tuple(families)}")
    check_model_fields(fields)
    if "dtype" in fields and kind not in DTYPE_KINDS:
        if not is_float32(fields["dtype"]):
            raise ValueError(f"model.dtype: {fields['dtype']!r} is not available for model.kind={kind!r}, which "
                             f"computes in float32 only; the kinds with a dtype setting: {DTYPE_KINDS}")
        del fields["dtype"]
    if num_classes is not None and kind in CLASSIFIERS:
        fields.setdefault("num_classes", num_classes)
    settings_of = _block_setting_models().get(kind)
    if settings_of is not None:  # a flat setting of another branch kind goes to the block (which ignores it)
        moved = {k: fields.pop(k) for k in moved_settings(settings_of, BlockSettings) if k in fields}
        if moved:
            fields["block"] = route_to_block(fields.get("block"), moved)
    if kind == "tau_resnet":
        if "variant" not in fields:
            raise ValueError("model.variant: a tau_resnet config needs variant = one of ('tau', 'bn', 'fixup', 'plain')")
        return tau_resnet(fields.pop("variant"), **fields)
    try:
        return families[kind](**fields)
    except TypeError as err:  # an unknown field
        raise ValueError(f"model: {err} (model.kind={kind!r})") from None
