"""The residual contract: one shape-checked addition, the branch scalings, the merge, stacks of blocks.

``residual_add(skip, branch)`` is the only place in resjax where a skip and a branch are added. It
checks with chex that the two have exactly equal shapes (a ``(B, 1)`` branch on a ``(B, D)`` stream is
an error, not a broadcast) and raises ``ValueError`` naming both shapes. The check holds whether or not
chex asserts are enabled: after ``chex.disable_asserts()`` the same comparison is made in plain Python
(shapes are static), with the same message.

The pieces every residual block (``resjax.nn.block.ResidualBlock``) is made of, for writing new ones:
``scale_branch`` (the branch scale ``s``) and ``close_block`` (the merge; ``computed_once`` keeps a merge that
ends in an elementwise op from being recomputed in every later block), and the stacking of blocks
(``stack_blocks``, unrolled or ``nn.scan``, optionally rematerialised in segments: ``remat``;
``stack_unrolled``/``unstack_scanned`` between the layouts).
The branch scale ``s`` comes from ``scaling``:

- ``none``: s = 1;
- ``tau``: s = tau, a traced value passed at call time (so a sweep over tau is a ``vmap``), or, when
  none is passed, the block's ``tau`` field: a number or a rule of the number of blocks K
  (``'1/sqrt(K)'``, ``'1/K'``, ``'K^(-1/4)'``, ``'1'``). A rule that needs K needs ``num_blocks`` (the
  blocks of the whole network; the stacks pass theirs): a standalone ``ResidualBlock(scaling='tau')``
  without it raises ``ValueError`` naming ``num_blocks`` when the rule is used. A concrete tau (field or
  call argument) must be a finite number > 0; a traced tau cannot be checked by value (a traced 0 gives
  the identity network). A tau passed at call time to a block or model whose ``scaling`` is not
  ``'tau'`` raises ``ValueError`` (it would be ignored: a tau sweep would train identical copies);
- ``rescale``: the sum is multiplied by 1/sqrt(2): ``(x + f(x)) / sqrt(2)``, which keeps the variance
  of a sum of independent equal-variance terms constant;
- ``skipinit``: s is a learned scalar ``alpha`` initialised at 0 (De & Smith 2020);
- ``fixup``: Fixup (Zhang, Dauphin & Ma 2019): a learned scalar multiplier (init 1) at the end of the
  branch, with the block's scalar biases and rescaled initialisation (``fixup_kernel_init``); the
  network zeroes its classifier.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resjax.nn.init import get_initializer

#: A block's orders (``order``); in ``'pre'`` each branch layer follows its norm and activation, nothing after the
#: sum; in ``'post'`` each layer is followed by its norm (and activation), the activation after the sum.
ORDERS = ("pre", "post")
#: The branch scales (``scaling``), in order none, ``tau``, the sum times 1/sqrt(2), SkipInit's learned scalar
#: from 0 and Fixup's learned scalar from 1 (with its biases and initialisation).
SCALINGS = ("none", "tau", "rescale", "skipinit", "fixup")


def residual_add(skip: jnp.ndarray, branch: jnp.ndarray) -> jnp.ndarray:
    """``skip + branch`` after checking that both have exactly the same shape: with chex (its message is
    the ``ValueError``'s cause) and, since ``chex.disable_asserts()`` turns chex's checks off, again in
    plain Python, so the check holds either way (shapes are static: no cost at run time)."""
    skip_shape, branch_shape = tuple(jnp.shape(skip)), tuple(jnp.shape(branch))

    def error() -> ValueError:
        return ValueError(f"residual_add: skip shape {skip_shape} and branch shape {branch_shape} differ"
                          f"{_vmap_note(skip, branch)}; project the skip or fix the branch (resjax never "
                          "broadcasts a residual addition)")

    try:
        chex.assert_equal_shape([skip, branch])
    except AssertionError as err:
        raise error() from err
    if skip_shape != branch_shape:  # chex asserts disabled
        raise error()
    return skip + branch


def _vmap_note(*arrays: Any) -> str:
    """A remark for shape errors raised inside ``jax.vmap``, where shapes are per example.

    A ``jax.vmap``-ed function sees its arguments without the mapped axes, so the shapes in the message
    are not the ones the caller passed. The mapped axes are added back where the tracer shows them; a
    ``jax.jit`` inside the ``vmap`` traces per-example shapes too and cannot be told apart from a plain
    ``jit``, so any traced array gets the general remark."""
    tracers = [a for a in arrays if isinstance(a, jax.core.Tracer)]
    # vmap's tracer (jax's BatchTracer, not public) holds the full array as ``val`` and the mapped axis as an
    # integer ``batch_dim`` (not an integer for an unmapped argument).
    def mapped(a: Any) -> bool:
        return isinstance(getattr(a, "batch_dim", None), int) and hasattr(a, "val")

    def outermost(a: Any) -> tuple:
        while mapped(a):  # nested vmaps: each level's ``val`` carries one more mapped axis
            a = a.val
        return tuple(jnp.shape(a))

    batched = [a for a in tracers if mapped(a)]
    if batched:
        full = " and ".join(str(outermost(a)) for a in batched)
        return (f" (shapes per example: this call is inside jax.vmap, which hides the mapped axes; with them "
                f"the mapped arguments have shapes {full})")
    if tracers:
        return " (if this runs inside jax.vmap, these are per-example shapes, without the mapped axes)"
    return ""


def concat_merge(*tensors: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """Concatenate along ``axis`` (channels, flax's last axis) after asserting that every other axis
    matches: the concatenating twin of ``residual_add`` (DenseNet blocks, U-Net skips)."""
    if len(tensors) < 2:
        raise ValueError(f"concat_merge: need at least two tensors, got {len(tensors)}")
    shapes = [tuple(jnp.shape(t)) for t in tensors]
    ndim = len(shapes[0])
    ax = axis % ndim if ndim else 0
    others = {tuple(d for i, d in enumerate(sh) if i != ax) if len(sh) == ndim else None for sh in shapes}
    if len(others) != 1 or None in others:
        raise ValueError(f"concat_merge: shapes {shapes} differ outside axis {axis}; resample or crop before merging")
    return jnp.concatenate(tensors, axis=axis)


_TAU_RULES: dict[str, Callable[[int], float]] = {
    "1": lambda k: 1.0,
    "1/sqrt(K)": lambda k: 1.0 / math.sqrt(k),
    "1/K": lambda k: 1.0 / k,
    "K^(-1/4)": lambda k: k ** -0.25,
    "K^(-1/2)": lambda k: k ** -0.5,
    "K^(-1)": lambda k: 1.0 / k,
}


#: The rules that do not depend on the number of blocks.
_RULES_WITHOUT_K = ("1",)


def resolve_tau(tau: float | str, num_blocks: int | None = None) -> float:
    """tau as a number: a number is returned as it is; a rule is evaluated at K = ``num_blocks``.

    Rules may name the number of blocks K or L: ``'1/sqrt(L)'`` is ``'1/sqrt(K)'``. A tau that is not a
    finite number > 0 (``0``, ``-1``, ``nan``, ``'inf'``) raises ``ValueError`` naming ``tau``; a rule
    that needs K with ``num_blocks=None`` raises ``ValueError`` naming ``num_blocks``. (A traced tau
    passed at call time never comes here: its value is unknown at trace time; see ``check_tau_value``.)
    """
    if isinstance(tau, str):
        rule = re.sub(r"\s+", "", tau).replace("L", "K")
        if rule not in _TAU_RULES:
            try:
                value = float(rule)
            except ValueError:
                raise ValueError(f"tau: unknown rule {tau!r}; use a number or one of {tuple(_TAU_RULES)}") from None
        elif rule in _RULES_WITHOUT_K:
            value = _TAU_RULES[rule](num_blocks)
        else:
            if num_blocks is None:
                raise ValueError(f"num_blocks: the tau rule {tau!r} needs the number of blocks K, and num_blocks was "
                                 "not given; pass num_blocks (the residual blocks of the whole network), a number "
                                 "for tau, or a tau at call time")
            check_positive("num_blocks", num_blocks)
            value = _TAU_RULES[rule](num_blocks)
    else:
        try:
            value = float(tau)
        except (TypeError, ValueError):
            raise ValueError(f"tau: must be a finite number > 0 or a rule, got {tau!r}") from None
        if isinstance(tau, bool):
            raise ValueError(f"tau: must be a finite number > 0 or a rule, got {tau!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"tau: must be a finite number > 0, got {tau!r}")
    return value


def check_tau_value(tau: float | jax.Array | None, setting: str = "tau") -> None:
    """Raise ``ValueError`` naming ``setting`` unless a concrete tau (a number or an array) is finite and
    > 0 everywhere. ``None`` and a traced tau (under ``jit``/``vmap``/``grad``) pass: a traced value is
    unknown at trace time, so it cannot be checked by value (a traced 0 gives the identity network)."""
    if tau is None or isinstance(tau, jax.core.Tracer):
        return
    try:
        a = np.asarray(tau, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{setting}: must be a finite number > 0, got {tau!r}") from None
    if a.size == 0 or isinstance(tau, bool) or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{setting}: must be a finite number > 0, got {tau!r}")


def check_call_tau(module: nn.Module, tau: float | jax.Array | None, check_value: bool = True) -> None:
    """The ``tau`` call argument of a residual block or model (anything with a ``scaling`` field): ``None``
    passes; on a module whose ``scaling`` is not ``'tau'`` any tau, traced or not, raises ``ValueError``
    (it would be ignored, so a tau sweep would train identical copies); a concrete tau must be a finite
    number > 0 (``check_tau_value``; ``check_value=False`` skips that, for a learned tau that a model
    passes on to its blocks). Runs at trace time."""
    if tau is None:
        return
    if module.scaling != "tau":
        raise ValueError(f"tau: {type(module).__name__} has scaling={module.scaling!r} and does not use tau; a tau "
                         "passed at call time would be ignored (a tau sweep would train identical copies). Pass tau "
                         "only to a model with scaling='tau'")
    if check_value:
        check_tau_value(tau)


def check_choice(setting: str, value: Any, choices: tuple) -> None:
    """Raise ``ValueError`` naming ``setting`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{setting}: unknown value {value!r}; choose one of {choices}")


def check_positive(setting: str, value: int) -> None:
    """Raise ``ValueError`` naming ``setting`` unless ``value`` is an integer >= 1 (``bool`` is refused)."""
    if not isinstance(value, (int,)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{setting}: must be an integer >= 1, got {value!r}")


def check_input_width(block: nn.Module, x: jax.Array, width: int, what: str) -> None:
    """Raise ``ValueError`` naming both widths unless ``x``'s last axis is ``width`` (``what`` says where
    ``width`` comes from, e.g. ``features=16`` or ``its parameters``): a block checks its input where it
    enters, so another width after init gives this message instead of a broadcasting error in a norm."""
    if jnp.ndim(x) == 0 or jnp.shape(x)[-1] != width:
        label = type(block).__name__ + (f" {block.name!r}" if block.name else "")
        got = jnp.shape(x)[-1] if jnp.ndim(x) else "none (a scalar)"
        raise ValueError(f"inputs: {label} takes inputs of width {width} ({what}), got width {got} "
                         f"(input shape {tuple(jnp.shape(x))})")


def check_tau_field(tau: float | str, num_blocks: int | None) -> None:
    """A module's ``tau`` field, at construction (whatever its ``scaling``): a number must be finite and > 0,
    a rule must be known. A rule that needs K is evaluated when the block is called (with ``num_blocks``
    ``None`` it raises then, unless a tau is passed at call time)."""
    resolve_tau(tau, num_blocks if num_blocks is not None else 1)


def close_block(block: nn.Module, skip: jax.Array | None, branch: jax.Array, sow: bool = True) -> jax.Array:
    """The merge every residual block ends with: ``residual_add(skip, branch)`` (just ``branch`` when ``skip`` is
    ``None``: a block without skip), times 1/sqrt(2) when ``block.scaling == 'rescale'``, then
    ``block.activation`` when ``block.post_activation`` (``None`` or absent: in the post order); sown as
    ``intermediates/block_out`` (unless ``sow=False``). A merge that ends in the rescale or an activation is
    computed once (``computed_once``), except in a scanned stack, where the stream is the scan's carry and XLA keeps
    it anyway (there the select only cost time: 3% of a depth-100 tau network's epoch). Call from the block's
    compact method."""
    out = summed = branch if skip is None else residual_add(skip, branch)
    if block.scaling == "rescale":
        out = out * (1.0 / math.sqrt(2.0))
    post_activation = getattr(block, "post_activation", None)
    if block.order == "post" if post_activation is None else post_activation:
        out = block.activation(out)
    if skip is not None and out is not summed and not _SCANNED.get():
        out = computed_once(out, summed)
    if sow:
        block.sow("intermediates", "block_out", out)
    return out


def computed_once(out: jax.Array, summed: jax.Array) -> jax.Array:
    """``out``, bit for bit, as one array that XLA computes once (its derivative too, up to the sign of a zero).

    ``out`` is an elementwise function of one operand (times a constant, an activation) of ``summed``, a block's
    skip plus branch. XLA fuses such a one-operand op into every consumer, duplicating it, and the sum before it
    along with it, and so on back through the blocks: in K unrolled blocks that end so (the 1/sqrt(2) rescale, the
    post order), each block's fusions recomputed the stream from the stem, and the backward pass its cotangents,
    O(K^2) work and compilation. On XLA:CPU a depth-32 rescaled MLP trained at 2.7x the time of the unscaled one,
    its fusions taking up to 97 operands (``optimization_barrier`` does not stop it there). A select has two full
    operands, which XLA does not duplicate; its predicate is true except where ``summed`` is NaN, and there ``out``
    is NaN as well."""
    return jnp.where(summed == summed, out, summed)


def fixup_kernel_init(kernel_init: str | Callable, layer: int, num_layers: int, num_blocks: int) -> Callable:
    """Fixup's initialiser for layer ``layer`` of an ``num_layers``-layer branch in a network of ``num_blocks``
    residual branches: zero for the last layer, ``kernel_init`` times ``num_blocks^(-1/(2m-2))`` before it."""
    if layer == num_layers - 1:
        return get_initializer("zeros")
    return get_initializer(kernel_init, gain=num_blocks ** (-1.0 / (2 * num_layers - 2)))


def scalar_param_dtype(module: nn.Module, h: jax.Array) -> Any:
    """The dtype of a module's scalar parameter (tau, SkipInit, Fixup, scalar biases) on a stream ``h``: the
    module's ``param_dtype`` when set, else ``h``'s but at least float32 (mixed precision)."""
    param_dtype = getattr(module, "param_dtype", None)
    if param_dtype is not None:
        return jnp.dtype(param_dtype)
    return jnp.promote_types(h.dtype, jnp.float32)


def scale_branch(block: nn.Module, h: jax.Array, tau: float | jax.Array | None = None,
                 bias: Callable[[jax.Array], jax.Array] = lambda h: h, check_value: bool = True) -> jax.Array:
    """The branch scaling every residual block shares (``block.scaling``): ``tau`` (the traced ``tau`` when
    given, else ``resolve_tau(block.tau, block.num_blocks)``), ``skipinit`` (a scalar gain starting at 0),
    ``fixup`` (a scalar multiplier starting at 1), ``none``/``rescale`` (unchanged here; ``rescale`` acts on
    the sum in ``close_block``). ``bias`` is the block's output bias: applied before the tau factor (as
    the tau-ResNet code adds it) and after the scalar gains (as Fixup adds it). Call from a compact method.
    ``tau`` is checked by ``check_call_tau`` (refused on a block whose scaling is not ``'tau'``; a concrete
    tau must be finite and > 0, unless ``check_value=False``: a learned tau the model passes on). The scalar
    parameters are at least float32 (float32 when ``h`` is half precision: ``resjax.nn.precision``) and cast
    to ``h``'s dtype where used."""
    check_call_tau(block, tau, check_value)
    if block.scaling == "tau":
        t = resolve_tau(block.tau, block.num_blocks) if tau is None else tau
        return bias(h) * jnp.asarray(t, h.dtype)
    if block.scaling == "skipinit":
        h = h * block.param("skipinit_alpha", nn.initializers.zeros, (), scalar_param_dtype(block, h)).astype(h.dtype)
    elif block.scaling == "fixup":
        h = h * block.param("fixup_scale", nn.initializers.ones, (), scalar_param_dtype(block, h)).astype(h.dtype)
    return bias(h)


#: The collections a scanned stack of blocks splits over its leading block axis (``nn.scan``'s ``variable_axes``).
_SCAN_AXES = {"params": 0, "batch_stats": 0, "intermediates": 0}


#: True while a block is traced as the body of a scanned stack (``_scanned_body``): its output is the scan's carry,
#: which XLA computes once per block without ``computed_once``.
_SCANNED = contextvars.ContextVar("resjax_scanned_block", default=False)


@contextlib.contextmanager
def _scanned_body():
    """Inside it, blocks are traced as the body of a scanned stack (``close_block`` leaves out ``computed_once``)."""
    token = _SCANNED.set(True)
    try:
        yield
    finally:
        _SCANNED.reset(token)


class _ScanStep(nn.Module):
    """Adapts a block class to ``nn.scan``'s ``(carry, *broadcast) -> (carry, out)`` signature."""

    block_cls: Any
    block_kwargs: Any

    @nn.compact
    def __call__(self, x: jax.Array, *broadcast: Any) -> tuple[jax.Array, None]:
        with _scanned_body():
            return self.block_cls(**dict(self.block_kwargs), name="block")(x, *broadcast), None


def check_remat(remat: int | bool, scan: bool = True) -> None:
    """Raise ``ValueError`` naming ``remat`` unless it is ``False``, ``True`` or a segment length (an integer
    >= 1), and, when it is not ``False``, unless ``scan`` is true (only a scanned stack is rematerialised)."""
    if not (remat is False or remat is True or (isinstance(remat, int) and remat >= 1)):
        raise ValueError(f"remat: must be False, True or a segment length (an integer >= 1), got {remat!r}")
    if remat is not False and not scan:
        raise ValueError(f"remat: rematerialising the blocks (remat={remat!r}) needs scan=True; an unrolled stack "
                         "(scan=False) keeps every block's activations")


def remat_segment(remat: int | bool, num_blocks: int) -> int | None:
    """The blocks per rematerialised segment of a stack of ``num_blocks``: ``None`` for ``remat=False`` (no
    rematerialisation), ``max(1, isqrt(num_blocks))`` for ``True``, else ``remat`` itself (checked by
    ``check_remat``)."""
    check_remat(remat)
    if remat is False:
        return None
    return max(1, math.isqrt(num_blocks)) if remat is True else remat


def _scan_blocks(module: nn.Module, x: jax.Array, broadcast: tuple, lengths: tuple[int, ...],
                 remat: bool) -> jax.Array:
    """``module.block`` applied ``prod(lengths)`` times on ``module``'s own scope: an ``nn.scan`` over
    ``lengths[0]`` steps, each an ``nn.scan`` over ``lengths[1:]`` (the variables get one leading axis per
    length), the inner scans checkpointed (``nn.remat``) when ``remat``. ``broadcast`` is closed over (passed
    unchanged to every block, never traced by the checkpoint: ``train`` stays a Python value)."""
    if not lengths:  # the body of the innermost scan
        with _scanned_body():
            return module.block(x, *broadcast)

    def step(m: nn.Module, h: jax.Array) -> tuple[jax.Array, None]:
        inner = lambda m2, h2: _scan_blocks(m2, h2, broadcast, lengths[1:], False)  # noqa: E731
        if remat:  # inside a scan: no CSE barrier needed (flax's advice for nn.remat under nn.scan)
            inner = nn.remat(inner, prevent_cse=False)
        return inner(m, h), None

    return nn.scan(step, variable_axes=_SCAN_AXES, split_rngs={"params": True}, length=lengths[0])(module, x)[0]


class _Blocks(nn.Module):
    """A scope holding one ``block`` child, for ``_scan_blocks`` (a segment view of ``_RematScan``)."""

    block_cls: Any
    block_kwargs: Any

    def setup(self):
        self.block = self.block_cls(**dict(self.block_kwargs))


class _RematScan(nn.Module):
    """``length`` blocks scanned as ``nn.scan(_ScanStep)`` would scan them, with the same variables (one
    ``block`` subtree, leaves with a leading axis of size ``length``; ``init`` draws them exactly as the
    plain scan does), but applied in checkpointed segments of ``segment`` blocks.

    Outside ``init`` the variables are viewed (``nn.map_variables``) as ``head/block`` with leading axes
    ``(length // segment, segment)`` and ``rest/block`` with ``(1, length % segment)``; each is an ``nn.scan``
    over segments of a checkpointed ``nn.scan`` over a segment's blocks. The backward pass keeps every
    segment's input and one segment's activations at a time (about ``length / segment + segment`` streams,
    ``2 sqrt(length)`` at ``segment = sqrt(length)``) instead of every block's; the forward pass runs twice.
    Updated ``batch_stats`` and sown ``intermediates`` are joined back into the one-axis layout (with flax's
    ``capture_intermediates``, this module's own ``__call__`` output is the stream, not ``nn.scan``'s
    ``(stream, None)``)."""

    block_cls: Any
    block_kwargs: Any
    length: int
    segment: int

    def setup(self):
        self.block = self.block_cls(**dict(self.block_kwargs))
        self.head = _Blocks(self.block_cls, self.block_kwargs)
        self.rest = _Blocks(self.block_cls, self.block_kwargs)

    def __call__(self, x: jax.Array, *broadcast: Any) -> jax.Array:
        if self.is_initializing():  # the plain scan's variables, drawn from the same keys
            return _scan_blocks(self, x, broadcast, (self.length,), False)
        whole, rest = divmod(self.length, self.segment)
        cut = whole * self.segment

        def split(variables: dict) -> dict:
            out = {}
            for col, tree in variables.items():
                if col not in _SCAN_AXES or "block" not in tree:
                    out[col] = tree
                    continue
                stacked, view = tree["block"], {k: v for k, v in tree.items() if k != "block"}
                if whole:
                    view["head"] = {"block": jax.tree_util.tree_map(
                        lambda a: a[:cut].reshape(whole, self.segment, *a.shape[1:]), stacked)}
                if rest:
                    view["rest"] = {"block": jax.tree_util.tree_map(lambda a: a[cut:][None], stacked)}
                out[col] = view
            return out

        def join(variables: dict) -> dict:
            out = {}
            for col, tree in variables.items():
                parts = [jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), tree[part]["block"])
                         for part in ("head", "rest") if "block" in tree.get(part, {})]
                if col not in _SCAN_AXES or not parts:
                    out[col] = tree
                    continue
                out[col] = {k: v for k, v in tree.items() if k not in ("head", "rest")}
                out[col]["block"] = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)
            return out

        def segments(m: nn.Module, h: jax.Array) -> jax.Array:
            if whole:
                h = _scan_blocks(m.head, h, broadcast, (whole, self.segment), True)
            if rest:
                h = _scan_blocks(m.rest, h, broadcast, (1, rest), True)
            return h

        return nn.map_variables(segments, True, split, join, mutable=True)(self, x)


class _ActiveScanStep(nn.Module):
    """``_ScanStep`` with a per-block flag ``on``: a block that is off is the identity (``active_block``)."""

    block_cls: Any
    block_kwargs: Any

    @nn.compact
    def __call__(self, x: jax.Array, on: jax.Array, *broadcast: Any) -> tuple[jax.Array, None]:
        with _scanned_body():
            block = self.block_cls(**dict(self.block_kwargs), name="block")
            return active_block(block, on, x, *broadcast), None


def active_block(block: nn.Module, on: jax.Array, x: jax.Array, *broadcast: Any) -> jax.Array:
    """``block(x, *broadcast)`` where ``on``, else ``x`` unchanged (the identity): the block of a stack built at a
    larger depth than a run's (a packed depth, ``stack_blocks(..., active_depth=d)``). A block that is off is fed zeros,
    so its computation stays finite and its parameters get exactly zero gradient; where it is on, the input and
    output are the block's own, bit for bit (``jnp.where`` selects, it does not compute)."""
    y = block(jnp.where(on, x, jnp.zeros_like(x)), *broadcast)
    return jnp.where(on, y, x)


def check_packed_depth(depth: Any, num_blocks: int, remat: int | bool = False) -> None:
    """A packed depth (``stack_blocks(..., active_depth=d)``): a concrete one must be an integer in 1 .. ``num_blocks``
    (``ValueError`` naming ``active_depth``); a rematerialised stack cannot take one (names ``remat``)."""
    if remat is not False:
        raise ValueError(f"remat: a packed depth (active_depth= at call time) needs remat=False, got remat={remat!r}")
    if isinstance(depth, jax.core.Tracer):
        return
    d = np.asarray(depth)
    if d.ndim != 0 or d != np.round(d) or not 1 <= d <= num_blocks:
        raise ValueError(f"active_depth: a packed depth must be an integer in 1 .. {num_blocks} (the stack's blocks), "
                         f"got {depth!r}")


def stack_blocks(block_cls: type[nn.Module], block_kwargs: dict, num_blocks: int, x: jax.Array, *broadcast: Any,
                 scan: bool, name: str = "blocks", remat: int | bool = False,
                 active_depth: int | jax.Array | None = None) -> jax.Array:
    """Apply ``num_blocks`` blocks ``block_cls(**block_kwargs)(x, *broadcast)`` one after another, unrolled
    (``name_0`` ... ``name_{K-1}``) or with ``nn.scan`` (one ``name/block`` subtree whose leaves have a
    leading axis of size K; ``broadcast`` is passed unchanged to every block).

    ``remat`` (only with ``scan=True``; else ``ValueError`` naming ``remat``): ``False`` (default): a plain
    ``nn.scan``, whose backward pass keeps every block's activations. ``True`` or an integer S >= 1: the
    blocks are rematerialised in segments of S blocks (``True``: S = ``max(1, isqrt(K))``; the last segment
    has the ``K mod S`` left over): the backward pass keeps every segment's input and recomputes one segment's
    activations at a time, about K/S + S streams instead of every block's (the forward pass runs twice).
    The parameters (and ``batch_stats``, ``intermediates``) have the same layout as without ``remat`` (one
    ``name/block`` subtree, leading axis K), ``init`` draws the same values from the same key, and the
    outputs and gradients are the same computation, in the same order (bit for bit on CPU for resjax's MLPs).

    ``active_depth`` (a packed depth: a number or a traced value, ``remat=False`` only): the stack is built with its
    ``num_blocks`` blocks, and block ``k`` (0-based) is the identity where ``k >= active_depth`` (``active_block``):
    runs of several depths, vmapped, share one program. The parameters are those of ``num_blocks`` blocks; the
    blocks past ``active_depth`` get zero gradient (their ``batch_stats`` still see their zero input in training:
    a trainer keeps them as they were, ``resjax.train.packing.keep_inactive``).

    Must be called inside a ``@nn.compact`` method. ``unstack_scanned``/``stack_unrolled`` convert
    between the two parameter layouts. ``num_blocks = 0`` returns ``x`` (a one-block ResNet stage).
    """
    check_remat(remat, scan)
    if num_blocks == 0:
        return x
    if active_depth is not None:
        check_packed_depth(active_depth, num_blocks, remat)
        if scan:
            stack = nn.scan(_ActiveScanStep, variable_axes=_SCAN_AXES, split_rngs={"params": True},
                            in_axes=(0,) + (nn.broadcast,) * len(broadcast), length=num_blocks,
                            )(block_cls=block_cls, block_kwargs=tuple(sorted(block_kwargs.items())), name=name)
            return stack(x, jnp.arange(num_blocks) < active_depth, *broadcast)[0]
        for k in range(num_blocks):
            x = active_block(block_cls(**block_kwargs, name=f"{name}_{k}"), k < active_depth, x, *broadcast)
        return x
    if scan:
        kwargs = tuple(sorted(block_kwargs.items()))
        segment = remat_segment(remat, num_blocks)
        if segment is not None:
            return _RematScan(block_cls, kwargs, num_blocks, segment, name=name)(x, *broadcast)
        stack = nn.scan(
            _ScanStep,
            variable_axes=_SCAN_AXES,
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * len(broadcast),
            length=num_blocks,
        )(block_cls=block_cls, block_kwargs=kwargs, name=name)
        x, _ = stack(x, *broadcast)
        return x
    for k in range(num_blocks):
        x = block_cls(**block_kwargs, name=f"{name}_{k}")(x, *broadcast)
    return x


def stack_unrolled(collection: dict, num_blocks: int, name: str = "blocks") -> dict:
    """Convert an unrolled collection (``blocks_0`` ...) into the scanned layout (``blocks/block``)."""
    import jax

    out = {k: v for k, v in collection.items() if not re.fullmatch(rf"{name}_\d+", k)}
    per_block = [collection[f"{name}_{k}"] for k in range(num_blocks)]
    out[name] = {"block": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per_block)}
    return out


def unstack_scanned(collection: dict, num_blocks: int, name: str = "blocks") -> dict:
    """Inverse of ``stack_unrolled``."""
    import jax

    out = {k: v for k, v in collection.items() if k != name}
    for k in range(num_blocks):
        out[f"{name}_{k}"] = jax.tree_util.tree_map(lambda a: a[k], collection[name]["block"])
    return out

