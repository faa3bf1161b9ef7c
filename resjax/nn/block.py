"""The one residual block: ``merge(skip, s * branch(x))``, for fully connected and convolutional streams.

``ResidualBlock`` is every residual block in resjax. Its parts:

- **branch**, chosen by ``kind`` (``BRANCH_KINDS``), or a module of one's own (``branch``):

  - ``'mlp'``: ``num_layers`` linear layers of width ``features`` (``linear_i``), on ``(..., features)``;
  - ``'basic'``: 3x3 -> 3x3 convolutions (``conv_0``, ``conv_1``), the first with ``strides``;
  - ``'bottleneck'``: 1x1 to ``bottleneck`` (default ``features // expansion``) -> 3x3 (``strides``, torchvision's
    "v1.5") -> 1x1 back to ``features`` (``conv_0`` .. ``conv_2``);
  - ``'conv'``: one ``kernel_size`` convolution (``conv``), Taki's block;

  in the order ``'post'`` (He et al. 2016a; Zhang et al.'s ``relu(h + tau W h)``): ``[layer -> norm (-> act)] * m``,
  the activation after the sum; or ``'pre'`` (He et al. 2016b): ``[norm -> act -> layer] * m``, nothing after the
  sum. Norms are numbered by their layer (``norm_i``); a convolutional pre-order branch numbers them by the conv
  they follow and calls the input's ``norm_pre`` (as the peers' code, whose weights ``resjax.interop`` maps).
  Convolutions are padded ``((k-1)//2, k//2)`` (XLA's 'SAME' at stride 1: an even kernel pads one more after).
  The convolutional kinds take 1-D signals too, ``(batch, length, channels)``: the number of spatial axes is the
  input's (``ndim - 2``), a kernel ``k`` is ``(k,)`` on a signal and ``(k, k)`` on an image, and ``strides`` is an
  integer there (a pair on a signal raises ``ValueError`` naming ``strides``); option A subsamples the length.
- **skip**: the identity, or, for a ``'basic'``/``'bottleneck'`` block that changes the shape, option ``'A'``
  (subsample, append zero channels) or ``'B'`` (strided 1x1 conv); see ``shortcut``. ``skip=False`` drops it: the
  block is then a plain layer (``PlainMLP``'s) or a branch alone (``BasicBranch``).
- **scale** ``s`` (``scaling``, ``scale_branch``): none, tau, 1/sqrt(2) rescale, SkipInit, Fixup.
- **merge**: ``close_block``: ``residual_add`` (the one shape-checked addition), the rescale, the activation in the
  post order; sown as ``block_out``.

The block's settings are declared once, here, by branch kind: ``CommonSettings`` (every kind's: order, norm, scaling,
tau, initialisers, ``dtype``, ``param_dtype``, ...), ``MLPSettings`` (an ``'mlp'`` branch's ``num_layers`` and
``bias_init``), ``ConvSettings`` (a conv ResNet branch's ``kind``, ``expansion``, ``shortcut``, ``option_a_*``) and
``BlockSettings`` (all of them, with a ``'conv'`` branch's ``kernel_size``: the block's). Each model takes only its
kind's (the MLPs ``MLPSettings``, ``ResNet`` ``ConvSettings``) and passes them to every block; it also takes ``block``
(a class, a ``functools.partial`` or a mapping of settings: Flax's ``block_cls`` idiom, a block already configured),
whose settings win. Another kind's setting passed to a model (``ResNet(num_layers=2)``, the old spelling, when every
model carried every kind's) goes to ``block`` with a ``DeprecationWarning`` (``accept_moved_settings``); ``build_model``
routes such a flat config setting to the block without one.

The helpers that construction calls are ``nn.nowrap``'ed (Flax forbids calling wrapped module methods from
``__post_init__``), so ``Module.tabulate``, ``nn.tabulate``, ``jax.eval_shape(model.init, ...)``, ``clone`` and
``bind`` work on every model while settings are still checked at construction.
The names users know are configurations of this one class: ``ResNetBlock`` (conv defaults), ``TakiBlock``,
``PlainLayer``, ``BasicBranch``/``BottleneckBranch`` (a conv branch alone, the lecture's names for its convs) and
``ConvResidualBlock(branch)`` (a branch module of one's own under an identity skip).

Biases: a linear layer followed directly by BatchNorm has none (BatchNorm's shift takes its place; under Adam the
bias would drift on rounding noise); a convolution has one only with ``norm='none'`` and no scalar biases.
``bias_init`` draws the linear layers' biases with the layer's input size as fan-in; Fixup keeps them at zero.
``scalar_biases`` (default: with Fixup) adds Fixup's learned scalars before every layer (``bias_in_i``), every
activation of the branch (``bias_act_i``) and at its end (``bias_out``: inside the tau factor, as the tau-ResNet
code has it; after Fixup's multiplier). Fixup zeroes the branch's last layer and draws the others times
``K^(-1/(2m-2))``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from resjax.nn.init import get_bias_initializer, get_initializer
from resjax.nn.norms import check_norm, is_batch_norm, make_norm
from resjax.nn.precision import PrecisionRepr, layer_dtypes, resolve_dtype
from resjax.nn.residual import (ORDERS, SCALINGS, check_choice, check_input_width, check_positive, check_tau_field,
                                close_block, fixup_kernel_init, scalar_param_dtype, scale_branch, stack_blocks)

#: The kinds of a residual block's branch (``ResidualBlock(kind=...)``), for two dense layers, a basic or
#: bottleneck convolutional branch, or one convolution.
BRANCH_KINDS = ("mlp", "basic", "bottleneck", "conv")
#: The convolutional ResNets' branch kinds (``ResNet(kind=...)``).
BLOCK_KINDS = ("basic", "bottleneck")
#: The shortcuts of a block that changes the shape (``shortcut``); ``'A'`` subsamples and appends zero channels
#: (no parameters), ``'B'`` is a strided 1x1 convolution.
SHORTCUTS = ("A", "B")
#: What option A subsamples (``option_a_input``), the block's input or what its first convolution reads.
OPTION_A_INPUTS = ("x", "conv_input")
CONV_KERNEL_INIT = "he_normal_fan_out"


def setting(default: Any) -> Any:
    """A block setting re-defaulted by a configuration (keyword-only, as in ``BlockSettings``)."""
    return dataclasses.field(default=default, kw_only=True)


def _check_strides(strides: Any) -> None:
    """An integer >= 1 or a pair (height, width) of them, else ``ValueError`` naming ``strides``."""
    pair = strides if isinstance(strides, (tuple, list)) else (strides,)
    if len(pair) not in (1, 2) or (isinstance(strides, (tuple, list)) and len(pair) != 2) or any(
            not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in pair):
        raise ValueError(f"strides: must be an integer >= 1 or a pair (height, width) of them, got {strides!r}")


class CommonSettings(nn.Module):
    """The settings every residual block has, whatever its branch (keyword-only); the models take them too.

    Attributes:
        order: ``'pre'`` (default) or ``'post'`` (``ORDERS``).
        norm: a name in ``NORMS`` (``'none'``, the default, ``'batch'``, ``'layer'``, ``'group'``, ``'instance'``),
            resjax's ``BatchNorm``/``UnbiasedBatchNorm``/``GroupNorm``, or any flax normalisation class or
            ``functools.partial`` of one (``nn.BatchNorm``, ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, ...):
            ``make_norm`` gives a layer with a ``use_running_average`` field the block's ``train`` (see ``make_norm``).
        scaling: the branch scale ``s``, one of ``SCALINGS``: ``'none'`` (default), ``'tau'``, ``'rescale'``,
            ``'skipinit'``, ``'fixup'``.
        tau: with ``scaling='tau'``, the scale when none is passed at call time: a finite number > 0 or a rule of K
            (``'1/sqrt(K)'``, the default, ``'1/K'``, ``'K^(-1/4)'``, ``'1'``; ``L`` may stand for ``K``).
        scalar_biases: Fixup's learned scalar biases: ``True``, ``False`` or ``None`` (default: with Fixup only).
        kernel_init: the layers' kernel initialiser: a ``resjax.nn.init`` name or a function; ``'taki'`` is Taki's
            N(0, 1/(fan_in * num_blocks)). Default ``'he_uniform'``.
        use_bias: whether the layers may have a bias (see the module docstring). Default ``True``.
        activation: the activation function. Default ``flax.linen.relu``.
        dtype: the computation dtype (``resjax.nn.precision``): ``None`` (default; float32), ``'float32'``,
            ``'bfloat16'`` or ``'float16'``; parameters and BatchNorm's statistics stay float32. A block does not
            cast its input (the network casts it).
        param_dtype: the dtype of every parameter, as flax's ``param_dtype`` (``resjax.nn.precision``): ``None``
            (default: float32, flax's default, and the scalar parameters at least the stream's dtype) or one of
            ``DTYPES``.
    """

    _: dataclasses.KW_ONLY
    order: str = "pre"
    norm: str | Callable = "none"
    scaling: str = "none"
    tau: float | str = "1/sqrt(K)"
    scalar_biases: bool | None = None
    kernel_init: str | Callable = "he_uniform"
    use_bias: bool = True
    activation: Callable = nn.relu
    dtype: Any = None
    param_dtype: Any = None

    #: The class whose fields ``block_settings`` passes on to the blocks (the settings of this model's kind).
    _settings = None

    @nn.nowrap
    def block_settings(self) -> dict[str, Any]:
        """The settings as a dict, to pass to a block: the fields of this model's kind's settings class
        (``MLPSettings``, ``ConvSettings``; every field of ``BlockSettings`` for the block itself)."""
        cls = type(self)._settings or type(self)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}


class MLPSettings(CommonSettings):
    """The settings of an ``'mlp'`` branch (``CommonSettings`` and these), which the MLPs take.

    Attributes:
        num_layers: m, the linear layers of the branch; an integer >= 1. Default 1.
        bias_init: the linear layers' bias initialiser (``'zeros'``, the default, ``'fan_in'``,
            ``'torch_default'`` or a function).
    """

    num_layers: int = setting(1)
    bias_init: str | Callable = setting("zeros")


class ConvSettings(CommonSettings):
    """The settings of a convolutional ResNet's branch (``CommonSettings`` and these), which ``ResNet`` takes.

    Attributes:
        kind: the branch, one of ``BLOCK_KINDS``: ``'basic'`` (default) or ``'bottleneck'``.
        expansion: a bottleneck's inner width is ``features // expansion``; an integer >= 1. Default 4.
        shortcut: ``'A'`` (default; subsample and append zero channels, no parameters) or ``'B'`` (strided 1x1
            conv, normalised in the post order; in the pre order it reads the pre-activated input), used only by a
            block that changes the shape (``SHORTCUTS``).
        option_a_norm: ``True``: option A normalises the subsampled input (``shortcut_norm``) before the zero
            channels (the tau-ResNet repository's BN model). Default ``False``.
        option_a_input: what option A subsamples: ``'x'`` (default) or ``'conv_input'`` (what the first conv reads:
            ``x + bias_in_0`` under scalar biases, the Fixup repository's).
    """

    kind: str = setting("basic")
    expansion: int = setting(4)
    shortcut: str = setting("A")
    option_a_norm: bool = setting(False)
    option_a_input: str = setting("x")


class BlockSettings(ConvSettings):
    """Every setting of the one block (``ResidualBlock``): ``CommonSettings``, ``ConvSettings`` and those of the
    other branch kinds (keyword-only). The models take only their kind's: ``MLPSettings`` (the MLPs),
    ``ConvSettings`` (``ResNet``).

    Attributes:
        kind: the branch, one of ``BRANCH_KINDS``: ``'mlp'`` (default), ``'basic'``, ``'bottleneck'``, ``'conv'``.
        num_layers, bias_init: an ``'mlp'`` branch's (``MLPSettings``).
        kernel_size: the square kernel of a ``'conv'`` branch; an integer >= 1. Default 3.
        The others: ``CommonSettings`` and ``ConvSettings``.
    """

    kind: str = setting("mlp")
    num_layers: int = setting(1)
    kernel_size: int = setting(3)
    bias_init: str | Callable = setting("zeros")


def moved_settings(model: type, settings: type) -> tuple[str, ...]:
    """The block settings a model does not take: ``BlockSettings``'s fields that are not ``model``'s (those of
    other branch kinds). ``build_model`` routes them to the block; ``accept_moved_settings`` too, with a warning."""
    own = {f.name for f in dataclasses.fields(model)}
    return tuple(f.name for f in dataclasses.fields(settings) if f.name not in own)


class SettingsMap(dict):
    """A mapping of block settings that hashes by content (a dict otherwise), so a model whose ``block`` it is
    stays hashable, as flax's transforms may need."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(((k, v) for k, v in self.items()), key=repr)))


def route_to_block(block: Any, moved: Mapping[str, Any]) -> Any:
    """``block`` with the settings ``moved`` added where it fixes none of its own: ``None`` becomes the mapping
    ``moved`` (a hashable ``SettingsMap``), a mapping or a ``functools.partial`` gets them under its own, a class
    becomes a partial."""
    if not moved:
        return block
    if block is None:
        return SettingsMap(moved)
    if isinstance(block, Mapping):
        return SettingsMap({**moved, **block})
    if isinstance(block, functools.partial):
        return functools.partial(block.func, *block.args, **{**moved, **block.keywords})
    return functools.partial(block, **moved)


def accept_moved_settings(cls: type) -> type:
    """Class decorator for a model: the block settings of other branch kinds (``moved_settings``), which the
    model had as fields before each model carried only its kind's (resjax 0.x, issue #33), keep working for now:
    they go to the block (``block={...}``, where its kind ignores them, as the model did) with a
    ``DeprecationWarning`` naming the new spelling."""
    init = cls.__init__
    moved = set(moved_settings(cls, BlockSettings))

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        extra = {k: kwargs.pop(k) for k in sorted(moved & kwargs.keys())}
        if extra:
            what = "is a setting" if len(extra) == 1 else "are settings"
            warnings.warn(f"{cls.__name__}: {', '.join(extra)} {what} of another branch kind, not of {cls.__name__}; "
                          f"passing it to the model is deprecated: pass block={extra!r} (the block ignores what its "
                          "kind does not use)", DeprecationWarning, stacklevel=2)
            kwargs["block"] = route_to_block(kwargs.get("block"), extra)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def resolve_block(block: Any, default: Callable[..., nn.Module], kwargs: dict[str, Any]) -> tuple[Callable, dict]:
    """A parent's block and the keyword arguments to build it with: ``block`` is ``None`` (``default``), a class, a
    ``functools.partial`` or a mapping of settings (a partial of ``default``); what the partial fixes wins over
    the parent's ``kwargs``."""
    if block is None:
        block = default
    elif isinstance(block, Mapping):
        block = functools.partial(default, **block)
    fixed = getattr(block, "keywords", {}) or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in fixed}
    block(**kwargs, parent=None)  # raises ValueError naming a bad setting, before anything is traced
    return block, kwargs


class ResidualBlock(PrecisionRepr, BlockSettings):
    """One residual block (see the module docstring and ``BlockSettings``); call as ``block(x, train, tau)``.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        features: the block's output width (channels); an identity skip needs the input's to equal it. Required.
        strides: the stride of the branch's strided conv and of the shortcut: an integer >= 1 or a pair
            ``(height, width)`` of them (an image's; a 1-D signal takes an integer). Default 1.
        num_blocks: K, the residual blocks of the whole network, for the tau rules, Fixup and ``'taki'``; ``None``
            (default, a standalone block): a tau rule that needs K raises ``ValueError`` naming ``num_blocks``
            when it is used; Fixup and ``'taki'`` count one block.
        skip: ``True`` (default): a residual block; ``False``: no skip (a plain layer, or a branch alone).
        post_activation: whether the activation follows the merge: ``None`` (default: in the post order).
        bottleneck: a ``'bottleneck'`` branch's inner width; ``None`` (default): ``features // expansion``.
        layer_names: the layers' names; ``None`` (default): ``linear_i``, ``conv_i`` or ``conv``.
        branch: a branch module of one's own, called as ``branch(x, train)`` and kept under ``branch``, in place
            of ``kind``'s layers. Default ``None``.
        learned_tau: set by ``ResNet(learnable_tau=True)``: the call-time ``tau`` is a parameter, not checked.
    """

    features: int
    strides: int | tuple[int, int] = 1
    num_blocks: int | None = None
    skip: bool = True
    post_activation: bool | None = None
    bottleneck: int | None = None
    layer_names: tuple[str, ...] | None = None
    branch: Any = None
    learned_tau: bool = False

    def __post_init__(self):
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype, "param_dtype")
        check_positive("features", self.features)
        check_choice("kind", self.kind, BRANCH_KINDS)
        check_choice("order", self.order, ORDERS)
        check_choice("scaling", self.scaling, SCALINGS)
        check_choice("shortcut", self.shortcut, SHORTCUTS)
        check_choice("option_a_input", self.option_a_input, OPTION_A_INPUTS)
        if not isinstance(self.option_a_norm, bool):
            raise ValueError(f"option_a_norm: must be True or False, got {self.option_a_norm!r}")
        _check_strides(self.strides)
        for name in ("num_layers", "kernel_size", "expansion"):
            check_positive(name, getattr(self, name))
        for name in ("num_blocks", "bottleneck"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.kind == "bottleneck" and self.bottleneck is None and self.features % self.expansion:
            raise ValueError(f"features: a bottleneck block needs features divisible by expansion={self.expansion}, "
                             f"got {self.features}")
        check_norm(self.norm)
        self._kernel_init(0, 2)  # raises on an unknown name
        get_bias_initializer(self.bias_init, self.features)
        check_tau_field(self.tau, self.num_blocks)
        super().__post_init__()

    @property
    def uses_scalar_biases(self) -> bool:
        """``scalar_biases``, or when it is ``None``, ``scaling == 'fixup'``."""
        return self.scaling == "fixup" if self.scalar_biases is None else self.scalar_biases

    @property
    def stride_pair(self) -> tuple[int, int]:
        """``strides`` as ``(height stride, width stride)``."""
        return (self.strides, self.strides) if isinstance(self.strides, int) else tuple(self.strides)

    def spatial_strides(self, spatial: int) -> tuple[int, ...]:
        """``strides`` for an input of ``spatial`` spatial axes: ``stride_pair`` for an image, ``(strides,)`` for a
        1-D signal (a pair there raises ``ValueError`` naming ``strides``)."""
        if spatial == 2:
            return self.stride_pair
        if isinstance(self.strides, (tuple, list)):
            raise ValueError(f"strides: a pair {tuple(self.strides)!r} is for images (batch, height, width, channels); "
                             f"an input with {spatial} spatial axis(es) takes an integer")
        return (self.strides,) * spatial

    def _layers(self) -> list[tuple[int | None, int, bool]]:
        """(kernel size (``None``: linear), output width, whether the layer is strided) of each layer."""
        f, one, strided = self.features, False, True
        if self.kind == "mlp":
            return [(None, f, one)] * self.num_layers
        if self.kind == "conv":
            return [(self.kernel_size, f, strided)]
        if self.kind == "basic":
            return [(3, f, strided), (3, f, one)]
        width = self.bottleneck or f // self.expansion
        return [(1, width, one), (3, width, strided), (1, f, one)]

    def _layer_name(self, i: int) -> str:
        if self.layer_names is not None:
            return self.layer_names[i]
        return {"mlp": f"linear_{i}", "conv": "conv"}.get(self.kind, f"conv_{i}")

    def _slot_name(self, base: str, i: int) -> str:
        """The name of the norm (or scalar bias) that goes with layer ``i``: after it (post order) or before it
        (pre order; a conv branch numbers these by the conv they follow, the input's being ``{base}_pre``)."""
        if self.kind == "conv":
            return base
        if self.order == "pre" and self.kind != "mlp":
            return f"{base}_pre" if i == 0 else f"{base}_{i - 1}"
        return f"{base}_{i}"

    @nn.nowrap
    def _kernel_init(self, i: int, m: int) -> Callable:
        if self.scaling == "fixup":
            return fixup_kernel_init(self.kernel_init, i, m, self.num_blocks or 1)
        if isinstance(self.kernel_init, str) and self.kernel_init == "taki":
            return get_initializer("taki", c=1.0, num_blocks=self.num_blocks or 1)
        return get_initializer(self.kernel_init)

    def _scalar_bias(self, name: str, h: jax.Array) -> jax.Array:
        """Fixup's scalar bias (zero at init; at least float32, used in ``h``'s dtype), when the block has them."""
        if not self.uses_scalar_biases:
            return h
        return h + self.param(name, nn.initializers.zeros, (), scalar_param_dtype(self, h)).astype(h.dtype)

    def _norm(self, i: int, h: jax.Array, train: bool | None) -> jax.Array:
        return make_norm(self.norm, train=train, name=self._slot_name("norm", i), dtype=self.dtype,
                         param_dtype=self.param_dtype)(h)

    def _act(self, i: int, h: jax.Array) -> jax.Array:
        return self.activation(self._scalar_bias(self._slot_name("bias_act", i), h))

    def _layer(self, i: int, h: jax.Array) -> jax.Array:
        layers = self._layers()
        size, features, strided = layers[i]
        m = len(layers)
        if size is None:  # linear: no bias when BatchNorm follows directly
            feeds_batch_norm = is_batch_norm(self.norm) and (self.order == "post" or i < m - 1)
            bias_init = "zeros" if self.scaling == "fixup" else self.bias_init
            return nn.Dense(features, use_bias=self.use_bias and not feeds_batch_norm,
                            kernel_init=self._kernel_init(i, m), bias_init=get_bias_initializer(bias_init, h.shape[-1]),
                            name=self._layer_name(i), **layer_dtypes(self.dtype, self.param_dtype))(h)
        use_bias = self.use_bias and self.norm == "none" and not self.uses_scalar_biases
        spatial = h.ndim - 2  # 2: an image (batch, height, width, channels); 1: a signal (batch, length, channels)
        strides = self.spatial_strides(spatial) if strided else (1,) * spatial
        return nn.Conv(features, (size,) * spatial, strides=strides, padding=[((size - 1) // 2, size // 2)] * spatial,
                       use_bias=use_bias, kernel_init=self._kernel_init(i, m), name=self._layer_name(i),
                       **layer_dtypes(self.dtype, self.param_dtype))(h)

    def _branch(self, x: jax.Array, train: bool | None) -> tuple[jax.Array, jax.Array]:
        """The branch's output and what its first layer reads (option B's, and option A's ``'conv_input'``)."""
        if self.branch is not None:
            # re-parent the branch here, so its parameters live under ``branch`` wherever it was built
            branch = self.branch if self.branch.parent is self else self.branch.clone(parent=self, name="branch")
            return branch(x, train), x
        m = len(self._layers())
        h, first_input = x, x
        for i in range(m):
            if self.order == "pre":
                h = self._act(i, self._norm(i, h, train))
            h = self._scalar_bias("bias_in" if self.kind == "conv" else f"bias_in_{i}", h)
            first_input = h if i == 0 else first_input
            h = self._layer(i, h)
            if self.order == "post":
                h = self._norm(i, h, train)
                if i < m - 1:
                    h = self._act(i, h)
        return h, first_input

    def _shortcut(self, x: jax.Array, first_input: jax.Array, train: bool | None) -> jax.Array:
        """The identity, or option A/B where a conv block changes the shape."""
        if self.kind not in BLOCK_KINDS:
            return x
        spatial = x.ndim - 2
        strides = self.spatial_strides(spatial)
        out_shape = (x.shape[0], *(-(-n // s) for n, s in zip(x.shape[1:-1], strides)), self.features)
        if tuple(x.shape) == out_shape:
            return x
        if self.shortcut == "A":
            extra = self.features - x.shape[-1]
            if extra < 0:
                raise ValueError(f"shortcut: option 'A' (zero padding) cannot reduce channels from {x.shape[-1]} "
                                 f"to {self.features}; use shortcut='B'")
            subsample = (slice(None), *(slice(None, None, s) for s in strides), slice(None))
            skip = (first_input if self.option_a_input == "conv_input" else x)[subsample]
            if self.option_a_norm:
                skip = make_norm(self.norm, train=train, name="shortcut_norm", dtype=self.dtype,
                                 param_dtype=self.param_dtype)(skip)
            return jnp.pad(skip, ((0, 0),) * (spatial + 1) + ((0, extra),))
        skip = nn.Conv(self.features, (1,) * spatial, strides=strides, use_bias=self.norm == "none",
                       kernel_init=get_initializer(self.kernel_init), name="shortcut_conv",
                       **layer_dtypes(self.dtype, self.param_dtype))(first_input)
        if self.order == "post":
            skip = make_norm(self.norm, train=train, name="shortcut_norm", dtype=self.dtype,
                             param_dtype=self.param_dtype)(skip)
        return skip

    def _check_input_width(self, x: jax.Array) -> None:
        """An identity skip needs ``features`` at the input; any other block, after init, the width its first
        layer was made for (a norm would otherwise fail with a broadcasting error)."""
        if self.skip and (self.kind not in BLOCK_KINDS or self.branch is not None):
            check_input_width(self, x, self.features, f"features={self.features}: the skip is the identity")
        elif not self.is_initializing() and self.branch is None:
            kernel = self.variables.get("params", {}).get(self._layer_name(0), {}).get("kernel")
            if kernel is not None:
                check_input_width(self, x, kernel.shape[-2], "the channels its parameters were initialised for")

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None) -> jax.Array:
        """Apply the block: ``merge(skip(x), s * branch(x))``; see the module docstring.

        Args:
            x: the stream: ``(..., features)`` for ``'mlp'``, channels-last ``(batch, height, width, channels)``
                (an image) or ``(batch, length, channels)`` (a 1-D signal) for the convolutional kinds.
            train: as ``resjax.nn``'s docstring sets out.
            tau: a scalar branch scale for this call (a number, or a traced value: a sweep over tau is a ``vmap``)
                in place of the ``tau`` field. Only with ``scaling='tau'``; ``None`` (default): the field.

        Returns:
            The block's output: the shape of ``x``, or for a conv block ``(batch, ceil(height / strides[0]),
            ceil(width / strides[1]), features)`` (a signal: ``(batch, ceil(length / strides), features)``).

        Raises:
            ValueError: ``train`` missing with BatchNorm; a ``tau`` passed to a block whose scaling is not ``'tau'``,
                or a concrete ``tau`` that is not a finite number > 0 (unless ``learned_tau``); a tau rule that
                needs K without ``num_blocks``; option A asked to reduce the channels (names ``shortcut``); an
                input of another width (names ``inputs`` and both widths); a branch whose shape differs from the
                skip (``residual_add``).

        Collections:
            ``batch_stats`` with BatchNorm; ``intermediates``: sows ``block_out`` (the output), except a branch
            alone (``skip=False, post_activation=False``: ``BasicBranch``, ``BottleneckBranch``).
        """
        self._check_input_width(x)
        h, first_input = self._branch(x, train)
        skip = self._shortcut(x, first_input, train) if self.skip else None
        h = scale_branch(self, h, tau, lambda h: self._scalar_bias("bias_out", h), check_value=not self.learned_tau)
        return close_block(self, skip, h, sow=self.skip or self.post_activation is not False)


def residual_stack(block_kwargs: dict, num_blocks: int, x: jax.Array, train: bool | None,
                   tau: float | jax.Array | None, scan: bool, name: str = "blocks",
                   remat: int | bool = False) -> jax.Array:
    """``num_blocks`` ``ResidualBlock(**block_kwargs)``s called as ``block(x, train, tau)``: ``stack_blocks`` with
    that class (inside a ``@nn.compact`` method; ``remat`` as ``stack_blocks``'s)."""
    return stack_blocks(ResidualBlock, block_kwargs, num_blocks, x, train, tau, scan=scan, name=name, remat=remat)


# ---- configurations: the names users know, as settings of the one block ----


class ResNetBlock(ResidualBlock):
    """``ResidualBlock`` with the convolutional ResNets' defaults: a ``'basic'`` branch, the post order,
    BatchNorm, He normal fan-out kernels (``resjax.nn.resnet``)."""

    kind: str = setting("basic")
    order: str = setting("post")
    norm: str | Callable = setting("batch")
    kernel_init: str | Callable = setting(CONV_KERNEL_INIT)


class TakiBlock(ResidualBlock):
    """``ResidualBlock`` as Taki's block: ``x + conv(act(N(x)))``, one 8x8 conv at 16 channels without bias,
    drawn N(0, 1/(k*k*C*num_blocks)) (``kernel_init='taki'``), N = ``norm`` (none by default)."""

    features: int = 16
    num_blocks: int | None = 100
    kind: str = setting("conv")
    kernel_size: int = setting(8)
    kernel_init: str | Callable = setting("taki")
    use_bias: bool = setting(False)


def PlainLayer(width: int, **settings: Any) -> ResidualBlock:  # noqa: N802 (a configuration, named as a class)
    """A hidden layer of ``PlainMLP``: ``activation(norm(linear(h)))``, i.e. ``ResidualBlock(width, skip=False,
    order='post')``; ``settings``: ``norm``, ``kernel_init``, ``bias_init``, ``use_bias``, ``activation``, ...."""
    return ResidualBlock(width, skip=False, order="post", **settings)


def BasicBranch(features: int, **settings: Any) -> ResidualBlock:  # noqa: N802
    """The lecture's basic branch alone: 3x3 conv -> norm -> relu -> 3x3 conv -> norm at width ``features``
    (``conv3x3_0``, ``conv3x3_1``), no skip: ``ResidualBlock(kind='basic', skip=False, post_activation=False)``
    with the conv defaults (``norm='batch'``, He normal fan-out)."""
    return ResNetBlock(features, skip=False, post_activation=False, layer_names=("conv3x3_0", "conv3x3_1"),
                       **settings)


def BottleneckBranch(features: int, bottleneck: int, **settings: Any) -> ResidualBlock:  # noqa: N802
    """The lecture's bottleneck branch alone: 1x1 (features -> bottleneck) -> 3x3 -> 1x1 (-> features), each
    followed by a norm, relu between (``conv1x1_reduce``, ``conv3x3``, ``conv1x1_restore``), no skip."""
    return ResNetBlock(features, kind="bottleneck", bottleneck=bottleneck, skip=False, post_activation=False,
                       layer_names=("conv1x1_reduce", "conv3x3", "conv1x1_restore"), **settings)


def ConvResidualBlock(branch: nn.Module, post_activation: bool = True, activation: Callable = nn.relu,
                      **kwargs: Any) -> ResidualBlock:  # noqa: N802
    """``activation(x + branch(x))`` (``post_activation=True``, the original ResNet) or ``x + branch(x)`` with an
    identity skip: ``ResidualBlock(branch.features, branch=branch)``; the branch (e.g. ``BottleneckBranch(256, 64)``,
    or any module called as ``branch(x, train)`` with a ``features`` width) keeps its parameters under
    ``branch``."""
    return ResidualBlock(branch.features, branch=branch, post_activation=post_activation, activation=activation,
                         **kwargs)
