"""Plain and residual MLPs: a linear stem, a stack of ``ResidualBlock``s (``kind='mlp'``), a linear head.

``ResidualMLP(width, num_blocks)``: a linear stem ``in -> width``, ``num_blocks`` residual blocks, and a linear head.
With ``order='post'`` the stem is followed by the activation (``h_0 = relu(A x)``, as in Zhang et al.'s model); with
``order='pre'`` the stem is linear and every branch begins with its own norm and activation (the udlbook residual
MLPs). With ``scaling='fixup'`` the head starts at zero.

``PlainMLP(width, depth)``: the same network without its skips: ``depth`` blocks ``ResidualBlock(skip=False,
order='post')``, each a hidden ``width -> width`` layer linear -> norm -> activation. ``depth`` counts the hidden
width-to-width layers, as the lecture does: "plain depth 8" has 8 hidden 64-to-64 layers.

``ResidualStack(width, num_blocks)``: the blocks without stem or head (the input is the stream).

The block settings are an ``'mlp'`` block's (``MLPSettings``: ``num_layers``, ``bias_init``, ``order``, ``norm``,
``scaling``, ..., ``resjax.nn.block``); a model passes them to every block, and ``block`` replaces the block itself (a
class, a ``functools.partial`` whose settings win, or a mapping of settings). ``scan=True`` builds the blocks with
``nn.scan`` (one ``blocks/block`` subtree whose leaves have a leading axis of size K; compile time independent of depth;
the same outputs for the same parameters, see ``resjax.nn.residual.stack_unrolled``); ``scan=False`` unrolls them
(``blocks_0`` ...): the plain and the residual networks name their parameters alike. ``remat`` (with ``scan=True``)
rematerialises the scanned blocks in segments in the backward pass (``resjax.nn.residual.stack_blocks``): ``True``
(segments of about sqrt(K) blocks) or a segment length; the same parameters, outputs and gradients in a fraction of
the memory. ``bias_init`` also draws the stem's and head's biases (fan-in = the layer's input size);
``stem_init``/``head_init`` (``None``: ``kernel_init``) draw the stem and head kernels. The models sow their stem's
output (``stem_out``) and every block's (``block_out``) into ``'intermediates'``.

Precision: the MLPs compute in float32. Their ``dtype`` field (a block setting) accepts only a value that means
float32 (``None``, ``'float32'``); a half one raises ``ValueError`` naming ``dtype``, as ``build_model`` refuses
``model.dtype`` for the MLP kinds (mixed precision is the convolutional models', ``resjax.nn.precision``).
``param_dtype`` stores every parameter in another dtype; the initial values are drawn in float32 and rounded
to it (``resjax.nn.init``), so a bfloat16 MLP starts from its float32 twin's draws.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax

from resjax.nn.block import MLPSettings, ResidualBlock, accept_moved_settings, resolve_block, setting
from resjax.nn.init import get_bias_initializer, get_initializer
from resjax.nn.precision import is_float32, layer_dtypes, resolve_dtype
from resjax.nn.residual import check_call_tau, check_positive, check_remat, stack_blocks


class _Stack(MLPSettings):
    """What the MLPs share: the settings of an ``'mlp'`` block (``MLPSettings``), ``scan``, ``remat`` and
    ``block``; subclasses give ``width`` and the number of blocks (``stack_size``)."""

    scan: bool = setting(False)
    remat: int | bool = setting(False)
    block: Any = setting(None)

    _settings = MLPSettings

    def __post_init__(self):
        check_positive("width", self.width)
        check_remat(self.remat, self.scan)
        resolve_dtype(self.param_dtype, "param_dtype")
        if not is_float32(self.dtype):  # as build_model's MLP kinds: mixed precision is the conv models' (DTYPE_KINDS)
            raise ValueError(f"dtype: {self.dtype!r} is not available for {type(self).__name__}, which computes in "
                             "float32 only (as build_model's MLP kinds); a half dtype is the convolutional models' "
                             "setting (resjax.nn.DTYPE_KINDS), and param_dtype stores an MLP's parameters in another "
                             "dtype")
        self.block_kwargs()  # validates every block setting before anything is traced
        super().__post_init__()

    @property
    def stack_size(self) -> int:
        return self.num_blocks

    @nn.nowrap
    def block_kwargs(self) -> dict[str, Any]:
        """The settings of every block (``ResidualBlock``'s fields); raises ``ValueError`` naming a bad one."""
        kwargs = dict(self.block_settings(), features=self.width, num_blocks=self.stack_size)
        fixed = dict(self.block) if isinstance(self.block, Mapping) else getattr(self.block, "keywords", None) or {}
        if fixed.get("kind", "mlp") != "mlp":
            raise ValueError(f"kind: an MLP's blocks have kind 'mlp', got {fixed['kind']!r}")
        resolve_block(self.block, ResidualBlock, kwargs)
        return kwargs

    #: The field that holds the number of blocks (a grid's depth axis: ``resjax.train.grid``).
    depth_field = "num_blocks"

    def _blocks(self, h: jax.Array, train: bool | None, tau: float | jax.Array | None,
                active_depth: int | jax.Array | None = None) -> jax.Array:
        block, kwargs = resolve_block(self.block, ResidualBlock, self.block_kwargs())
        return stack_blocks(block, kwargs, self.stack_size, h, train, tau, scan=self.scan, remat=self.remat,
                            active_depth=active_depth)


class _Classifier(_Stack):
    """An MLP classifier: linear stem ``in -> width`` (activated in the post order), the blocks, linear head."""

    num_classes: int = setting(10)
    stem_init: str | Callable | None = setting(None)  # None: kernel_init
    head_init: str | Callable | None = setting(None)  # None: kernel_init (Fixup: zeros)

    def __post_init__(self):
        check_positive("num_classes", self.num_classes)
        for init in (self.stem_init, self.head_init):
            if init is not None:
                get_initializer(init)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None,
                 active_depth: int | jax.Array | None = None) -> jax.Array:
        """Apply the network: stem, the blocks, head.

        Args:
            x: the inputs, ``(batch, in_features)`` (any leading axes).
            train: as ``resjax.nn``'s docstring sets out.
            tau: a scalar branch scale for this call, shared by every block (a number, or a traced value: a
                sweep over tau is a ``vmap``), in place of the ``tau`` field. Only with ``scaling='tau'`` (else
                ``ValueError``); a concrete tau must be a finite number > 0. ``None`` (default): the field.
            active_depth: a packed depth (a number or a traced value; ``None``, default: every block): the blocks past
                it are the identity (``resjax.nn.residual.stack_blocks``), so runs of several depths share one
                program; 1 .. the model's blocks, and ``remat=False`` (else ``ValueError`` naming it).

        Returns:
            The logits, ``(batch, num_classes)``.

        Collections:
            ``intermediates``: sows ``stem_out`` (the stem's output, activated in the post order) and every
            block's ``block_out`` (unrolled: under ``blocks_k``; scanned: under ``blocks/block`` with a leading
            axis of size K).
        """
        check_call_tau(self, tau)
        init = get_initializer(self.kernel_init if self.stem_init is None else self.stem_init)
        dtypes = {"param_dtype": layer_dtypes(None, self.param_dtype)["param_dtype"]}
        h = nn.Dense(self.width, use_bias=self.use_bias, kernel_init=init,
                     bias_init=get_bias_initializer(self.bias_init, x.shape[-1]), name="stem", **dtypes)(x)
        if self.order == "post":
            h = self.activation(h)
        self.sow("intermediates", "stem_out", h)
        h = self._blocks(h, train, tau, active_depth)
        head_init = get_initializer("zeros" if self.scaling == "fixup" else self.head_init or self.kernel_init)
        head_bias = get_bias_initializer("zeros" if self.scaling == "fixup" else self.bias_init, h.shape[-1])
        return nn.Dense(self.num_classes, kernel_init=head_init, bias_init=head_bias, name="head", **dtypes)(h)


@accept_moved_settings
class ResidualMLP(_Classifier):
    """A residual MLP classifier; see the module docstring. Every field is checked at construction
    (``ValueError`` naming the setting).

    Attributes:
        width: the stem's output and the blocks' width; an integer >= 1. Required.
        num_blocks: K, the residual blocks (also the K of the tau rules and of Fixup); an integer >= 1. Required.
        num_classes: the head's outputs (logits); an integer >= 1. Default 10.
        stem_init, head_init: the stem's and head's kernel initialisers; ``None`` (default): ``kernel_init``.
            With ``scaling='fixup'`` the head starts at zero (kernel and bias).
        scan: ``False`` (default): blocks ``blocks_0`` ... unrolled; ``True``: one ``nn.scan``.
        remat: ``False`` (default): the scan keeps every block's activations for the backward pass. ``True`` or
            a segment length S (an integer >= 1; ``True``: S = isqrt(K)): the blocks are rematerialised in
            segments of S (``resjax.nn.residual.stack_blocks``): the backward pass keeps about K/S + S streams
            instead of every block's, at the cost of a second forward pass. The same parameters (layout and
            ``init`` values), outputs and gradients. Needs ``scan=True`` (else ``ValueError`` naming ``remat``).
        block: the block (a class, a ``functools.partial`` or a mapping of settings); ``None``: ``ResidualBlock``.
        The settings of an ``'mlp'`` block (``MLPSettings``: ``num_layers``, ``bias_init`` and ``CommonSettings``'
        ``order``, ``norm``, ``scaling``, ``tau``, ``kernel_init``, ``use_bias``, ``activation``, ``param_dtype``,
        ...), passed to every block; ``use_bias`` and ``bias_init`` also apply to the stem, ``bias_init`` to the
        head, ``param_dtype`` (``None``: float32) to every parameter. A conv block's settings (``shortcut``,
        ``option_a_*``, ``expansion``, ``kernel_size``, ``kind``) are not the MLP's: passed to it, they go to the
        block with a ``DeprecationWarning``.
    """

    width: int
    num_blocks: int


@accept_moved_settings
class PlainMLP(_Classifier):
    """A plain (no skip) MLP classifier: stem, ``depth`` hidden layers, linear head; see the module docstring.
    Its fields are ``ResidualMLP``'s with ``depth`` for ``num_blocks`` and ``order='post'`` by default; its
    blocks are ``ResidualBlock(skip=False)``. Every field is checked at construction (``ValueError`` naming
    the setting)."""

    width: int
    depth: int
    order: str = setting("post")

    def __post_init__(self):
        check_positive("depth", self.depth)
        super().__post_init__()

    depth_field = "depth"

    @property
    def stack_size(self) -> int:
        return self.depth

    @nn.nowrap
    def block_kwargs(self) -> dict[str, Any]:
        """The settings of every hidden layer: ``ResidualBlock(skip=False)``'s."""
        return dict(super().block_kwargs(), skip=False)


@accept_moved_settings
class ResidualStack(_Stack):
    """``num_blocks`` residual blocks applied to the input itself: no stem, no head.

    The input is the stream h_0 (its last axis must equal ``width``) and is sown as ``'stem_out'``. For
    measurements on the stream itself, e.g. the lecture's variance curves, whose random inputs start at variance 1.
    Its fields are ``ResidualMLP``'s without the stem's and head's.
    """

    width: int
    num_blocks: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None,
                 active_depth: int | jax.Array | None = None) -> jax.Array:
        """Apply the ``num_blocks`` blocks to the stream ``x``, ``(batch, width)``; ``tau`` and ``active_depth``
        as ``ResidualMLP``'s.

        Returns:
            The stream after the last block, the shape of ``x``.

        Raises:
            ValueError: ``x``'s last axis is not ``width`` (names ``inputs``); ``train`` missing with
                BatchNorm; a ``tau`` refused as ``ResidualMLP`` refuses it.

        Collections:
            ``intermediates``: sows ``stem_out`` (the input ``x``) and every block's ``block_out``.
        """
        check_call_tau(self, tau)
        if x.shape[-1] != self.width:
            raise ValueError(f"inputs: last axis {x.shape[-1]} must equal width {self.width} (the input is the stream)")
        self.sow("intermediates", "stem_out", x)
        return self._blocks(x, train, tau, active_depth)
