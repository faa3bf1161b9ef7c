"""Plain and residual MLPs: stem, hidden layers or residual blocks, linear head.

``PlainMLP(width, depth)``: ``in -> width`` stem with activation, ``depth`` hidden ``width -> width``
layers (each linear -> norm -> activation), and a linear head. ``depth`` counts the hidden
width-to-width layers, as the lecture does: "plain depth 8" has 8 hidden 64-to-64 layers.
``scan=True`` builds the hidden layers as one ``nn.scan`` over ``PlainLayer`` (one ``hidden_layers/layer``
subtree whose leaves have a leading axis of size ``depth``; compile time independent of depth; same
outputs as the unrolled ``hidden_0`` ... for the same parameters). ``stem_init``/``head_init`` (default
``None``: ``kernel_init``) draw the stem and head kernels, as in ``ResidualMLP``.

``ResidualStack(width, num_blocks)``: the same blocks without stem or head (the input is the stream).

``ResidualMLP(width, num_blocks)``: a linear stem ``in -> width``, ``num_blocks`` ``ResidualBlock``s,
and a linear head. With ``order='post'`` the stem is followed by the activation (``h_0 = relu(A x)``,
as in Zhang et al.'s model); with ``order='pre'`` the stem is linear and every branch begins with its
own norm and activation (the udlbook residual MLPs). ``scan=True`` builds the blocks with ``nn.scan``
(compile time independent of depth; same outputs for the same parameters, see
``resjax.nn.residual.stack_unrolled``). With ``scaling='fixup'`` the head starts at zero.

``bias_init`` (default ``'zeros'``; ``'fan_in'`` = N(0, 1/fan_in), fan_in the layer's input size, so a
scalar-input stem gets variance 1) draws every linear layer's bias, stem and head included (Fixup keeps
its biases at zero). A linear layer followed directly by BatchNorm (``norm='batch'``: every hidden layer of
``PlainMLP``; see ``ResidualBlock`` for the blocks) has no bias, whatever ``use_bias`` says: BatchNorm
subtracts the batch mean, so that bias would have no effect on the loss (and drift under Adam); BatchNorm's
shift takes its place. ``ResidualMLP`` and ``ResidualStack`` take ``tau`` at call time only with
``scaling='tau'`` (else ``ValueError``: it would be ignored). ``ResidualMLP`` returns logits, ``ResidualStack``
the stream; both take ``train`` (BatchNorm mode) at call time, and sow their stem output (``stem_out``) and
every block's output into ``'intermediates'`` when it is mutable.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax

from resjax.nn.init import get_bias_initializer, get_initializer
from resjax.nn.norms import check_norm, is_batch_norm, make_norm
from resjax.nn.residual import ResidualBlock, check_call_tau, check_positive, residual_stack


class PlainLayer(nn.Module):
    """One hidden layer of ``PlainMLP``: linear (``hidden``; no bias before BatchNorm) -> norm (``norm``) ->
    activation; sows ``'hidden_out'``.

    Attributes:
        width: the layer's output features. Required.
        norm: a name in ``NORMS`` (``'none'``, the default, ``'batch'``, ``'layer'``, ``'group'``) or a callable
            for ``make_norm``.
        kernel_init: the kernel initialiser (a ``resjax.nn.init`` name or a function). Default ``'he_uniform'``.
        bias_init: the bias initialiser (``'zeros'``, the default, ``'fan_in'``, ``'torch_default'`` or a
            function).
        use_bias: whether the linear layer has a bias (never before BatchNorm). Default ``True``.
        activation: the activation function. Default ``flax.linen.relu``.
    """

    width: int
    norm: str | Callable = "none"
    kernel_init: str | Callable = "he_uniform"
    bias_init: str | Callable = "zeros"
    use_bias: bool = True
    activation: Callable = nn.relu

    @nn.compact
    def __call__(self, h: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the layer: ``activation(norm(linear(h)))``.

        Args:
            h: the input, ``(batch, in_features)`` (any leading axes).
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            ``(batch, width)``: the layer's output.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``hidden_out`` (the output) when the caller makes it mutable.
        """
        use_bias = self.use_bias and not is_batch_norm(self.norm)
        h = nn.Dense(self.width, use_bias=use_bias, kernel_init=get_initializer(self.kernel_init),
                     bias_init=get_bias_initializer(self.bias_init, h.shape[-1]), name="hidden")(h)
        h = self.activation(make_norm(self.norm, train=train, name="norm")(h))
        self.sow("intermediates", "hidden_out", h)
        return h


class _PlainScanStep(nn.Module):
    """Adapts a ``PlainLayer`` to ``nn.scan``'s ``(carry, *broadcast) -> (carry, out)`` signature."""

    layer_kwargs: Any

    @nn.compact
    def __call__(self, h: jax.Array, train: bool | None) -> tuple[jax.Array, None]:
        return PlainLayer(**dict(self.layer_kwargs), name="layer")(h, train), None


class PlainMLP(nn.Module):
    """A plain (no skip) MLP classifier: stem, ``depth`` hidden layers, linear head; see the module docstring.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        width: the hidden width (the stem's output and every hidden layer); an integer >= 1. Required.
        depth: the number of hidden ``width -> width`` layers; an integer >= 1. Required.
        num_classes: the head's outputs (logits); an integer >= 1. Default 10.
        norm: the hidden layers' normalisation: a name in ``NORMS`` (``'none'``, the default, ``'batch'``,
            ``'layer'``, ``'group'``) or a callable for ``make_norm``. The stem has none.
        kernel_init: the kernel initialiser of the hidden layers (and of the stem and head unless
            ``stem_init``/``head_init`` are given): a ``resjax.nn.init`` name or a function. Default
            ``'he_uniform'``.
        bias_init: every layer's bias initialiser, with the layer's input size as fan-in: ``'zeros'``
            (default), ``'fan_in'``, ``'torch_default'`` or a function.
        use_bias: whether the stem and hidden layers have a bias (hidden layers followed by BatchNorm never
            do; the head always has one). Default ``True``.
        activation: the activation after the stem and every hidden layer. Default ``flax.linen.relu``.
        scan: ``False`` (default): hidden layers ``hidden_0`` ... unrolled; ``True``: one ``nn.scan`` over
            ``PlainLayer`` (``hidden_layers/layer``, leaves with a leading axis of size ``depth``).
        stem_init: the stem's kernel initialiser; ``None`` (default): ``kernel_init``.
        head_init: the head's kernel initialiser; ``None`` (default): ``kernel_init``.
    """

    width: int
    depth: int
    num_classes: int = 10
    norm: str | Callable = "none"
    kernel_init: str | Callable = "he_uniform"
    bias_init: str | Callable = "zeros"
    use_bias: bool = True
    activation: Callable = nn.relu
    scan: bool = False
    stem_init: str | Callable | None = None  # None: kernel_init
    head_init: str | Callable | None = None  # None: kernel_init

    def __post_init__(self):
        check_positive("width", self.width)
        check_positive("depth", self.depth)
        check_positive("num_classes", self.num_classes)
        check_norm(self.norm)
        get_initializer(self.kernel_init)
        for init in (self.stem_init, self.head_init):
            if init is not None:
                get_initializer(init)
        get_bias_initializer(self.bias_init, self.width)
        super().__post_init__()

    def layer_kwargs(self) -> dict[str, Any]:
        """The settings of one hidden layer (``PlainLayer``)."""
        return dict(width=self.width, norm=self.norm, kernel_init=self.kernel_init, bias_init=self.bias_init,
                    use_bias=self.use_bias, activation=self.activation)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Apply the network: stem -> activation -> ``depth`` hidden layers -> head.

        Args:
            x: the inputs, ``(batch, in_features)`` (any leading axes).
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            The logits, ``(batch, num_classes)``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``stem_out`` (the stem's activated output) and ``hidden_out`` (each hidden
            layer's output: ``depth`` entries in order, or with ``scan=True`` one entry under
            ``hidden_layers/layer`` with a leading axis of size ``depth``) when the caller makes it mutable.
        """
        init = get_initializer(self.kernel_init)
        bias = lambda h: get_bias_initializer(self.bias_init, h.shape[-1])  # noqa: E731  (fan-in = input size)
        stem_init = init if self.stem_init is None else get_initializer(self.stem_init)
        h = self.activation(nn.Dense(self.width, use_bias=self.use_bias, kernel_init=stem_init, bias_init=bias(x),
                                     name="stem")(x))
        self.sow("intermediates", "stem_out", h)
        if self.scan:
            stack = nn.scan(
                _PlainScanStep,
                variable_axes={"params": 0, "batch_stats": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,),
                length=self.depth,
            )(layer_kwargs=tuple(sorted(self.layer_kwargs().items())), name="hidden_layers")
            h, _ = stack(h, train)
        else:
            hidden_bias = self.use_bias and not is_batch_norm(self.norm)  # BatchNorm follows: no bias
            for k in range(self.depth):
                h = nn.Dense(self.width, use_bias=hidden_bias, kernel_init=init, bias_init=bias(h),
                             name=f"hidden_{k}")(h)
                h = self.activation(make_norm(self.norm, train=train, name=f"norm_{k}")(h))
                self.sow("intermediates", "hidden_out", h)
        head_init = init if self.head_init is None else get_initializer(self.head_init)
        return nn.Dense(self.num_classes, kernel_init=head_init, bias_init=bias(h), name="head")(h)


class _ResidualFields(nn.Module):
    """The block settings shared by ``ResidualMLP`` and ``ResidualStack`` (see ``ResidualBlock``)."""

    width: int
    num_blocks: int
    num_layers: int = 1
    order: str = "pre"
    norm: str | Callable = "none"
    scaling: str = "none"
    tau: float | str = "1/sqrt(K)"
    kernel_init: str | Callable = "he_uniform"
    bias_init: str | Callable = "zeros"
    use_bias: bool = True
    activation: Callable = nn.relu
    scan: bool = False

    def __post_init__(self):
        self.block_kwargs()  # validates every block setting before anything is traced
        super().__post_init__()

    def block_kwargs(self) -> dict[str, Any]:
        """The settings of every block (``ResidualBlock``); raises ``ValueError`` naming a bad setting."""
        kwargs = dict(features=self.width, num_layers=self.num_layers, order=self.order, norm=self.norm,
                      scaling=self.scaling, tau=self.tau, num_blocks=self.num_blocks,
                      kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
                      activation=self.activation)
        ResidualBlock(**kwargs, parent=None)
        return kwargs


class ResidualStack(_ResidualFields):
    """``num_blocks`` residual blocks applied to the input itself: no stem, no head.

    The input is the stream h_0 (its last axis must equal ``width``) and is sown as ``'stem_out'``.
    For measurements on the stream itself, e.g. the lecture's variance curves, whose random inputs
    start at variance 1.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        width: the stream's width, the ``features`` of every block; an integer >= 1. Required.
        num_blocks: K, the number of residual blocks (also the K of the tau rules and of Fixup); an integer
            >= 1. Required.
        num_layers: linear layers per branch; an integer >= 1. Default 1.
        order: ``'pre'`` (default) or ``'post'`` (``ORDERS``; see ``ResidualBlock``).
        norm: the branches' normalisation: a name in ``NORMS`` (``'none'``, the default, ``'batch'``, ``'layer'``,
            ``'group'``) or a callable for ``make_norm``.
        scaling: the branch scale, one of ``SCALINGS``: ``'none'`` (default), ``'tau'``, ``'rescale'``,
            ``'skipinit'``, ``'fixup'``.
        tau: with ``scaling='tau'``, the branch scale when none is passed at call time: a finite number > 0 or
            a rule of K evaluated at K = ``num_blocks`` (``'1/sqrt(K)'``, the default, ``'1/K'``,
            ``'K^(-1/4)'``, ``'1'``).
        kernel_init: the blocks' kernel initialiser (a ``resjax.nn.init`` name or a function). Default
            ``'he_uniform'``.
        bias_init: the bias initialiser: ``'zeros'`` (default), ``'fan_in'``, ``'torch_default'`` or a function.
        use_bias: whether the linear layers have a bias (never before BatchNorm). Default ``True``.
        activation: the activation function. Default ``flax.linen.relu``.
        scan: ``False`` (default): blocks ``blocks_0`` ... unrolled; ``True``: one ``nn.scan`` (``blocks/block``,
            leaves with a leading axis of size K; see ``stack_unrolled``).
    """

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None) -> jax.Array:
        """Apply the ``num_blocks`` blocks to the stream ``x``.

        Args:
            x: the stream h_0, ``(batch, width)`` (any leading axes; the last must equal ``width``).
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.
            tau: a scalar branch scale for this call, shared by every block (a number, or a traced value: a
                sweep over tau is a ``vmap``), in place of the ``tau`` field. Only with ``scaling='tau'`` (else
                ``ValueError``); a concrete tau must be a finite number > 0. ``None`` (default): the field.

        Returns:
            The stream after the last block, the shape of ``x``.

        Raises:
            ValueError: ``x``'s last axis is not ``width`` (names ``inputs``); ``train`` missing with
                BatchNorm; a ``tau`` refused as above.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``stem_out`` (the input ``x``) and every block's ``block_out`` (unrolled:
            under ``blocks_k``; scanned: under ``blocks/block`` with a leading axis of size K) when the caller
            makes it mutable.
        """
        check_call_tau(self, tau)
        if x.shape[-1] != self.width:
            raise ValueError(f"inputs: last axis {x.shape[-1]} must equal width {self.width} (the input is the stream)")
        self.sow("intermediates", "stem_out", x)
        return residual_stack(self.block_kwargs(), self.num_blocks, x, train, tau, self.scan)


class ResidualMLP(_ResidualFields):
    """A residual MLP classifier: linear stem ``in -> width``, ``num_blocks`` ``ResidualBlock``s, linear head;
    see the module docstring.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        width, num_blocks, num_layers, order, norm, scaling, tau, kernel_init, bias_init, use_bias, activation,
            scan: as in ``ResidualStack`` (``width``: the stem's output and the blocks' width). With
            ``order='post'`` the stem is followed by ``activation``; ``use_bias`` and ``bias_init`` also apply
            to the stem, ``bias_init`` to the head.
        num_classes: the head's outputs (logits); an integer >= 1. Default 10.
        stem_init: the stem's kernel initialiser; ``None`` (default): ``kernel_init``.
        head_init: the head's kernel initialiser; ``None`` (default): ``kernel_init``. With ``scaling='fixup'``
            the head starts at zero (kernel and bias) whatever this says.
    """

    num_classes: int = 10
    stem_init: str | Callable | None = None  # None: kernel_init
    head_init: str | Callable | None = None  # None: kernel_init (Fixup: zeros)

    def __post_init__(self):
        check_positive("num_classes", self.num_classes)
        for init in (self.stem_init, self.head_init):
            if init is not None:
                get_initializer(init)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None) -> jax.Array:
        """Apply the network: stem, the blocks, head.

        Args:
            x: the inputs, ``(batch, in_features)`` (any leading axes).
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.
            tau: a scalar branch scale for this call, shared by every block (a number, or a traced value: a
                sweep over tau is a ``vmap``), in place of the ``tau`` field. Only with ``scaling='tau'`` (else
                ``ValueError``); a concrete tau must be a finite number > 0. ``None`` (default): the field.

        Returns:
            The logits, ``(batch, num_classes)``.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``stem_out`` (the stem's output, activated in the post order) and every
            block's ``block_out`` (unrolled: under ``blocks_k``; scanned: under ``blocks/block`` with a leading
            axis of size K) when the caller makes it mutable.
        """
        check_call_tau(self, tau)
        init = get_initializer(self.kernel_init if self.stem_init is None else self.stem_init)
        h = nn.Dense(self.width, use_bias=self.use_bias, kernel_init=init,
                     bias_init=get_bias_initializer(self.bias_init, x.shape[-1]), name="stem")(x)
        if self.order == "post":
            h = self.activation(h)
        self.sow("intermediates", "stem_out", h)
        h = residual_stack(self.block_kwargs(), self.num_blocks, h, train, tau, self.scan)
        head_init = get_initializer("zeros" if self.scaling == "fixup" else self.head_init or self.kernel_init)
        head_bias = get_bias_initializer("zeros" if self.scaling == "fixup" else self.bias_init, h.shape[-1])
        return nn.Dense(self.num_classes, kernel_init=head_init, bias_init=head_bias, name="head")(h)
