"""Signal propagation at initialisation: activation variance and gradient scale through depth.

Activation variance (lecture 000, "Variance growth" ... "Relative size of later branches")
---------------------------------------------------------------------------------------------
``stream_activations(module, variables, inputs)`` runs a residual network once with the
``'intermediates'`` collection mutable and returns the residual stream at every depth, ``(K + 1, B, D)``:
the stem output (``'stem_out'``, or the inputs themselves when the module sows no stem) followed by
every block's ``'block_out'``, in depth order. It works for any module that sows ``'block_out'`` the
way ``resjax.nn.ResidualBlock`` does, unrolled (``blocks_0`` ... ``blocks_{K-1}``, ordered by their
numeric suffix) or under ``nn.scan`` (one ``block_out`` with a leading depth axis). A model of your own
needs only that (``self.sow('intermediates', 'block_out', h)`` in each block, ``'stem_out'`` optionally):
a Linen module or an ``apply_fn(variables, x, **kwargs)``, ``train`` passed only where its ``__call__``
takes it (the protocol: ``resjax.analysis``'s docstring and ``resjax.analysis.protocol``).

On that stream:

- ``variance_through_depth`` returns two curves of length K + 1:
  ``variance``, the variance over all entries of the ``(batch, width)`` activation, the quantity whose
  expectation (over inputs and weights) the lecture's ``2^k`` and ``1 + k`` describe; and
  ``per_unit_variance``, each unit's variance over the batch, averaged over units, which is what the
  udlbook Chapter 11 notebook 11.3 prints (``np.mean(np.var(data, axis=0))``). The two differ by the
  spread of the units' batch means: a branch ``W relu(.)`` gives every unit a nonzero mean over the
  batch (``relu`` is not centred), which the all-entries variance counts and the per-unit one does not.
- ``branch_variance_ratio`` returns, for block j = 1..K, Var(what block j adds to the stream) divided
  by Var(the stream it is added to, h_{j-1}); with k = j - 1 blocks before it, the lecture's "relative
  size of later branches" predicts 1/(k + 1) for BatchNorm at the branch input (stream variance 1 + k,
  branch variance 1). What a block adds is recovered from the stream: ``h_j / c - h_{j-1}`` with
  ``c = 1/sqrt(2)`` for ``scaling='rescale'`` and 1 otherwise; this needs ``order='pre'`` (a
  post-activation block passes the sum through a ReLU, which cannot be undone).
- ``doubling_guide(K)`` = ``v0 * 2^k`` and ``linear_guide(K)`` = ``v0 + k * per_block``, k = 0..K,
  and ``ratio_guide(K)`` = 1/(k + 1), k = 0..K-1: the lecture's guides.

``resjax.nn.ResidualStack`` is a stem-less stack of ``resjax.nn.ResidualBlock``s that sows its input
as ``'stem_out'``: the lecture's "random inputs" are the stream h_0 itself (variance 1, so the guides
start at 1). ``resjax.nn.ResidualMLP`` always has a
learned stem whose He draw doubles a unit-variance input, so it is not used for the lecture's figure;
the functions here accept it all the same.

Gradient scale through depth (lecture 000, "Gradient scale through depth")
-------------------------------------------------------------------------
``random_relu_jacobian(key, width)`` draws the Jacobian of one He-initialised ReLU layer
``y = relu(x @ W)`` (``W``: ``(D, D)``, from ``resjax.nn.get_initializer(kernel_init)``, zero bias) at a
random input ``x ~ N(0, I_D)`` drawn independently for that layer: ``J = diag(m) W^T`` with the ReLU
derivative mask ``m = 1[x @ W > 0]``, rows indexing outputs as in the lecture. Each factor is an
independent draw (an i.i.d. model of a deep network's layers, not one network's chain of inputs).

A gradient g passes back through a layer as ``g <- M^T g`` with ``M = J`` (plain), ``I + J``
(residual) or ``I + J / sqrt(K)`` (small branches). ``product_norms(jacobians, kind)`` applies given
factors to a unit start vector and returns ``|g|`` after each k = 0..depth; ``gradient_scale`` draws
the factors (one fresh draw per layer, the same draw shared by the three kinds so that they are
compared on common random numbers), vmapped over ``num_draws`` independent draws, scanned over depth,
never materialising all factors at once. ``expected_sq_norm_guide`` gives E|g_k|^2 for each kind: 1,
2^k and (1 + 1/K)^k (E J = 0 and E|J^T g|^2 = |g|^2 for He draws).

Every function validates its settings and raises ``ValueError`` naming the setting (width 0, K = 0,
depth 0, an unknown kind, a module that sows no block outputs, a batch of one ...).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resjax.analysis.protocol import applied
from resjax.nn.init import get_initializer
from resjax.nn.mlp import PlainMLP

__all__ = [
    "KINDS", "branch_ratio_of_stream", "branch_variance_ratio", "doubling_guide", "expected_sq_norm_guide",
    "gradient_scale", "linear_guide", "log2_growth_per_block", "percentile_bands", "product_norms",
    "random_relu_jacobian", "ratio_guide", "stream_activations", "sum_scale",
    "variance_through_depth", "variances_of_stream",
]

#: The products a gradient passes back through: ``J``, ``I + J`` and ``I + J / sqrt(K)``.
KINDS = ("plain", "residual", "residual_scaled")


def _check_int(setting: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{setting}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: unknown product {kind!r}; choose one of {KINDS}")


# ---- the stream at every depth -------------------------------------------------------------------


_ORDER_SUFFIX = re.compile(r"^(.*?)_(first|\d+)$")


def _natural_key(name: str):
    """Sort key of a sown path's name: numeric suffixes in numeric order (``blocks_2`` before ``blocks_10``), and
    a stage's ``<name>_first`` before its ``<name>_0`` ... and before ``<name>`` itself (scanned), as resjax's
    ``ResNet`` names each stage's first block and the rest (``stage1_first``, ``stage1_0`` or ``stage1/block``)."""
    name = str(name)
    m = _ORDER_SUFFIX.match(name)
    base, rank, index = (m.group(1), 1, int(m.group(2))) if m and m.group(2) != "first" else \
        ((m.group(1), 0, 0) if m else (name, 1, -1))
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", base)], rank, index


def _collect(tree, key: str, out: list) -> None:
    """Every value sown under ``key`` in ``tree``, depth-first, children in ``_natural_key`` order."""
    if not isinstance(tree, dict) and not hasattr(tree, "items"):
        return
    for name in sorted(tree.keys(), key=_natural_key):
        value = tree[name]
        if name == key and isinstance(value, tuple):  # a sown value (a module of that name is a dict)
            out.extend(value)
        else:
            _collect(value, key, out)


#: The names of the stream's start that ``stem_key=None`` looks for, in this order: ``'stem_out'`` (the
#: protocol's, ``resjax.nn``'s MLPs) and ``'stem'`` (what ``resjax.nn.ResNet`` sows).
STEM_KEYS = ("stem_out", "stem")


def _sown_stem(inter, stem_key: str | None):
    """The top-level sown stream start (``stem_key``, or the first of ``STEM_KEYS``), or None."""
    for key in (STEM_KEYS if stem_key is None else (stem_key,)):
        value = inter.get(key) if hasattr(inter, "get") else None
        if isinstance(value, tuple) and value:
            return value[0]
    return None


def _shape_str(a) -> str:
    return str(tuple(jnp.shape(a)))


def stream_depths(module: nn.Module | Callable[..., Any], variables: dict, inputs: jnp.ndarray, *,
                  train: bool | None = None, block_key: str = "block_out", stem_key: str | None = None,
                  **apply_kwargs: Any) -> tuple[list, np.ndarray]:
    """The stream at depths 0..K as a list of K + 1 arrays ``(batch, ...)`` and the stage of each depth.

    ``stage[0] = 0`` (the stream's start); blocks belong to stages 1, 2, ...: a new stage begins at each
    block whose output's shape differs from the previous depth's (a convolutional ResNet's stage changes
    the resolution and the width), so an MLP's blocks are all stage 1. The sows are found and checked on
    ``jax.eval_shape`` of the call first, so a model without them is refused before anything is computed.
    See ``stream_activations`` for the arguments.
    """
    per_depth, stage, _ = _stream_parts(module, variables, inputs, train=train, block_key=block_key,
                                        stem_key=stem_key, **apply_kwargs)
    return per_depth, stage


def _stream_parts(module, variables, inputs, *, train, block_key="block_out", stem_key=None, **apply_kwargs):
    """``stream_depths``'s list and stages, and the stream stacked ``(K + 1, batch, ...)`` when it has one shape
    (built as the sows give it, so that a one-shape stream is computed as before stages were known), else None.
    """
    model = applied(module, variables, "stream_activations")
    if jnp.ndim(inputs) < 2:
        raise ValueError(f"inputs: need a batch axis and a feature axis, got shape {_shape_str(inputs)}")
    if jnp.shape(inputs)[0] < 2:
        raise ValueError(f"inputs: a batch of {jnp.shape(inputs)[0]} example(s) has no batch variance; need >= 2")
    mutable = ["intermediates"] + (["batch_stats"] if "batch_stats" in variables else [])
    variables = {k: v for k, v in variables.items() if k != "intermediates"}

    def run(v, x):
        return model(v, x, train=train, mutable=mutable, **apply_kwargs)[1].get("intermediates", {})

    raw: list = []  # the stacked stream when it has one shape, built as before stages were known (bit-identical)

    def depths(inter, abstract=False):
        blocks: list = []
        _collect(inter, block_key, blocks)
        if not blocks:
            raise ValueError(f"module: {model.name} sowed no {block_key!r} intermediates; use "
                             f"resjax.nn.ResidualBlock (or sow each block's output: self.sow('intermediates', "
                             f"{block_key!r}, h))")
        stem = _sown_stem(inter, stem_key)
        if stem is None:
            first = blocks[0]
            if jnp.ndim(first) in (jnp.ndim(inputs), jnp.ndim(inputs) + 1) and \
                    jnp.shape(first)[-1] == jnp.shape(inputs)[-1]:
                stem = inputs
            else:
                wanted = " or ".join(repr(k) for k in (STEM_KEYS if stem_key is None else (stem_key,)))
                raise ValueError(f"module: {model.name} sowed no {wanted} (the stream's start) and its inputs "
                                 f"{_shape_str(inputs)} are not the stream (its first block gives "
                                 f"{_shape_str(first)}); sow the stream's start: self.sow('intermediates', "
                                 "'stem_out', h)")
        if not abstract and len(blocks) == 1 and jnp.ndim(blocks[0]) == jnp.ndim(stem) + 1:
            raw.append(jnp.concatenate([stem[None], blocks[0]], axis=0))  # nn.scan: the stream, stacked as sown
        elif not abstract and all(jnp.shape(b) == jnp.shape(stem) for b in blocks):
            raw.append(jnp.concatenate([stem[None], jnp.stack(blocks)], axis=0))
        out = [stem]
        for b in blocks:  # one block, or (nn.scan) a leading axis of blocks
            if jnp.ndim(b) != jnp.ndim(stem) + 1:
                out.append(b)
            elif isinstance(b, jax.ShapeDtypeStruct):
                out.extend([jax.ShapeDtypeStruct(b.shape[1:], b.dtype)] * b.shape[0])
            else:
                out.extend(b[i] for i in range(b.shape[0]))
        return out

    depths(jax.eval_shape(run, variables, inputs), abstract=True)  # the sows, checked before computing
    per_depth = depths(run(variables, inputs))
    stage, current = [0], 1
    for k in range(1, len(per_depth)):
        if k > 1 and jnp.shape(per_depth[k]) != jnp.shape(per_depth[k - 1]):
            current += 1
        stage.append(current)
    return per_depth, np.asarray(stage, np.int32), (raw[0] if raw else None)


def stream_activations(module: nn.Module | Callable[..., Any], variables: dict, inputs: jnp.ndarray, *,
                       train: bool | None = None, block_key: str = "block_out", stem_key: str | None = None,
                       by_stage: bool = False, **apply_kwargs: Any) -> jnp.ndarray | list:
    """The residual stream at depths 0..K, shape ``(K + 1, batch, width)``; see the module docstring.

    ``module``: a Linen module or an ``apply_fn(variables, x, **kwargs)`` with Linen's ``apply``
    conventions (``resjax.analysis.protocol``); NNX objects are refused with a ``TypeError`` saying what
    to pass. ``train`` is passed to a module whose ``__call__`` takes it (BatchNorm: ``True`` uses the
    batch's statistics, as at the first training step; ``False`` the running estimates), and to no other.
    ``train=None`` passes nothing: it is no mode, and a resjax model with BatchNorm applied without
    ``train`` raises ``ValueError`` naming ``train``; models without BatchNorm ignore it. Nothing is
    returned but the activations: the updated ``batch_stats`` are discarded (a pure function).

    ``stem_key``: the top-level sow holding the stream's start; ``None`` (default): ``'stem_out'``, else
    ``'stem'`` (``resjax.nn.ResNet``'s), else the inputs themselves when they have the stream's width.
    A stream that changes shape (a convolutional ResNet's stages) cannot be stacked: it raises
    ``ValueError`` naming the block where it changes, unless ``by_stage=True``, which returns a list of
    stacked stages instead: ``[start (1, batch, ...), stage 1 (n_1, batch, ...), stage 2 ...]`` (see
    ``stream_depths``; an MLP gives ``[start, all K blocks]``).
    """
    per_depth, stage, stacked = _stream_parts(module, variables, inputs, train=train, block_key=block_key,
                                              stem_key=stem_key, **apply_kwargs)
    if by_stage:
        return [jnp.stack([d for d, s in zip(per_depth, stage) if s == i]) for i in range(int(stage[-1]) + 1)]
    for k in range(1, len(per_depth)):
        if jnp.shape(per_depth[k]) != jnp.shape(per_depth[0]):
            raise ValueError(f"module: the stream changes shape at block {k}, from {_shape_str(per_depth[0])} to "
                             f"{_shape_str(per_depth[k])} (a new stage), so it cannot be stacked; use "
                             "stream_activations(..., by_stage=True) or variance_through_depth (a stage per depth)")
    return stacked


def variances_of_stream(stream: jnp.ndarray) -> dict:
    """``{'variance', 'per_unit_variance'}`` of a ``(depths, batch, ...features)`` stream, per depth."""
    flat = stream.reshape(stream.shape[0], stream.shape[1], -1)
    return {
        "variance": jnp.var(flat, axis=(1, 2)),
        "per_unit_variance": jnp.mean(jnp.var(flat, axis=1), axis=-1),
    }


def variance_through_depth(module: nn.Module | Callable[..., Any], variables: dict, inputs: jnp.ndarray, *,
                           train: bool | None = None, **apply_kwargs: Any) -> dict:
    """Activation variance after each depth k = 0..K: ``{'variance', 'per_unit_variance', 'stage'}``, each ``(K + 1,)``.

    ``variance``: over all entries of the ``(batch, ...)`` activation; ``per_unit_variance``: each unit's
    (each position and channel of an image stream) batch variance, averaged over units (udlbook notebook
    11.3's printout); ``stage``: the stage of each depth (``stream_depths``: 0 for the stream's start, then
    1, 2, ... where the stream changes shape; an MLP's blocks are all stage 1), so a convolutional ResNet's
    curve reads per stage (``variance[stage == s]``). ``train``, ``stem_key``: as ``stream_activations``.
    """
    per_depth, stage, stacked = _stream_parts(module, variables, inputs, train=train, **apply_kwargs)
    if stacked is not None:  # one shape throughout: the stacked stream, as before stages were known
        return {**variances_of_stream(stacked), "stage": stage}
    curves = [variances_of_stream(d[None]) for d in per_depth]
    return {"variance": jnp.concatenate([c["variance"] for c in curves]),
            "per_unit_variance": jnp.concatenate([c["per_unit_variance"] for c in curves]),
            "stage": stage}


def sum_scale(module: nn.Module) -> float:
    """c in ``h_j = c (h_{j-1} + branch)``: 1/sqrt(2) for ``scaling='rescale'``, else 1 (``order='pre'`` only)."""
    if isinstance(module, PlainMLP):
        raise ValueError("skip: PlainMLP's blocks have no skip, so no block adds a branch to a stream; "
                         "branch_variance_ratio needs residual blocks")
    scaling = getattr(module, "scaling", "none")
    order = getattr(module, "order", "pre")
    if order != "pre":
        raise ValueError(f"order: branch outputs can only be recovered from the stream for order='pre', got {order!r}")
    return 1.0 / math.sqrt(2.0) if scaling == "rescale" else 1.0


def branch_variance_ratio(module: nn.Module | Callable[..., Any], variables: dict, inputs: jnp.ndarray, *,
                          train: bool | None = None, **apply_kwargs: Any) -> jnp.ndarray:
    """For block j = 1..K: Var(what block j adds) / Var(h_{j-1}), variances over all entries; ``(K,)``.

    Compare with ``ratio_guide(K)`` = 1/(k + 1), k = j - 1 (BatchNorm at the branch input). A block that
    changes the stream's shape (the first of a convolutional ResNet's later stages, whose shortcut is a
    projection) adds nothing that the stream shows: its entry is NaN, and a ``UserWarning`` names those blocks
    (``ratio[j - 1]`` is block j's; the warning is raised when the call is traced, once per ``jax.jit`` trace).
    """
    c = sum_scale(module)
    per_depth, stage, stacked = _stream_parts(module, variables, inputs, train=train, **apply_kwargs)
    if stacked is not None:
        return branch_ratio_of_stream(stacked, c)
    ratios, undefined = [], []
    for j, (before, after) in enumerate(zip(per_depth[:-1], per_depth[1:]), start=1):
        if jnp.shape(before) != jnp.shape(after):
            ratios.append(jnp.full((1,), jnp.nan, jnp.result_type(after)))
            undefined.append(j)
        else:
            ratios.append(branch_ratio_of_stream(jnp.stack([before, after]), c))
    if undefined:
        warnings.warn(f"branch_variance_ratio: block(s) {undefined} change the stream's shape (a stage's first "
                      "block, whose shortcut is a projection), so what they add cannot be read from the stream: "
                      "their ratios are NaN (ratio[j - 1] is block j's)", UserWarning, stacklevel=2)
    return jnp.concatenate(ratios)


def branch_ratio_of_stream(stream: jnp.ndarray, c: float = 1.0) -> jnp.ndarray:
    """Var(h_j / c - h_{j-1}) / Var(h_{j-1}), j = 1..K, of a ``(K + 1, batch, ...)`` stream (see ``sum_scale``)."""
    flat = stream.reshape(stream.shape[0], -1)
    added = flat[1:] / c - flat[:-1]
    return jnp.var(added, axis=1) / jnp.var(flat[:-1], axis=1)


def doubling_guide(num_blocks: int, v0: float = 1.0) -> np.ndarray:
    """``v0 * 2^k``, k = 0..K: the expected variance with every branch added (lecture "Exponential growth")."""
    k = np.arange(_check_int("num_blocks", num_blocks) + 1)
    return v0 * 2.0 ** k


def linear_guide(num_blocks: int, v0: float = 1.0, per_block: float = 1.0) -> np.ndarray:
    """``v0 + k * per_block``, k = 0..K: BatchNorm at each branch input (lecture "Linear variance growth")."""
    k = np.arange(_check_int("num_blocks", num_blocks) + 1)
    return v0 + per_block * k


def ratio_guide(num_blocks: int) -> np.ndarray:
    """1/(k + 1) for the branch of block k + 1, k = 0..K-1 (lecture "Relative size of later branches")."""
    return 1.0 / (np.arange(_check_int("num_blocks", num_blocks)) + 1.0)


def log2_growth_per_block(variance: jnp.ndarray) -> jnp.ndarray:
    """Mean log2 growth per block of a variance curve ``(..., K + 1)``: log2(v_K / v_0) / K."""
    num_blocks = variance.shape[-1] - 1
    _check_int("num_blocks", num_blocks)
    return (jnp.log2(variance[..., -1]) - jnp.log2(variance[..., 0])) / num_blocks


# ---- gradient scale through depth ----------------------------------------------------------------


def random_relu_jacobian(key: jax.Array, width: int, kernel_init: str | Callable = "he_normal") -> jnp.ndarray:
    """One ReLU layer's Jacobian ``J = diag(1[x W > 0]) W^T`` at a random input x ~ N(0, I), ``(D, D)``.

    ``W`` is a ``(D, D)`` flax kernel (inputs on axis 0) drawn from ``kernel_init``; zero bias.
    """
    width = _check_int("width", width)
    k_w, k_x = jax.random.split(key)
    kernel = get_initializer(kernel_init)(k_w, (width, width), jnp.float32)
    x = jax.random.normal(k_x, (width,))
    mask = (x @ kernel > 0).astype(kernel.dtype)
    return mask[:, None] * kernel.T


def _step(kind: str, g: jnp.ndarray, jacobian: jnp.ndarray, scale: float) -> jnp.ndarray:
    back = g @ jacobian  # J^T g: the gradient passed back through the layer
    if kind == "plain":
        return back
    if kind == "residual":
        return g + back
    return g + scale * back


def _unit_start(key: jax.Array, width: int) -> jnp.ndarray:
    v = jax.random.normal(key, (width,))
    return v / jnp.linalg.norm(v)


def product_norms(jacobians: jnp.ndarray, kind: str, num_blocks: int | None = None,
                  start: jnp.ndarray | None = None) -> jnp.ndarray:
    """``|g_k|`` for k = 0..depth, g_0 a unit vector and ``g_k = M_k^T g_{k-1}``; shape ``(depth + 1,)``.

    ``jacobians``: ``(depth, D, D)``; ``M_k = J_k`` (plain), ``I + J_k`` (residual), ``I + J_k / sqrt(K)``
    (residual_scaled, needs ``num_blocks`` = K). ``start`` defaults to ``(1, ..., 1)/sqrt(D)``.
    """
    _check_kind(kind)
    if jnp.ndim(jacobians) != 3 or jacobians.shape[1] != jacobians.shape[2]:
        raise ValueError(f"jacobians: need shape (depth, D, D), got {tuple(jnp.shape(jacobians))}")
    _check_int("depth", jacobians.shape[0])
    width = _check_int("width", jacobians.shape[1])
    scale = 1.0
    if kind == "residual_scaled":
        if num_blocks is None:
            raise ValueError("num_blocks: kind='residual_scaled' needs K for I + J/sqrt(K)")
        scale = 1.0 / math.sqrt(_check_int("num_blocks", num_blocks))
    g0 = jnp.full((width,), 1.0 / math.sqrt(width)) if start is None else start / jnp.linalg.norm(start)

    def body(g, j):
        g = _step(kind, g, j, scale)
        return g, jnp.linalg.norm(g)

    _, norms = jax.lax.scan(body, g0, jacobians)
    return jnp.concatenate([jnp.ones((1,), norms.dtype), norms])


def gradient_scale(key: jax.Array, depth: int, width: int, num_draws: int, num_blocks: int | None = None,
                   kinds: tuple = KINDS, kernel_init: str | Callable = "he_normal") -> dict:
    """Gradient norms after k = 0..depth layers for every kind: ``{kind: (num_draws, depth + 1)}``.

    Draw d uses ``keys[d] = split(key, num_draws)[d]``: its start vector (uniform on the unit sphere)
    from ``fold_in(keys[d], 0)`` and layer k's Jacobian (``random_relu_jacobian``) from
    ``fold_in(keys[d], k)``, k = 1..depth, shared by every kind. ``num_blocks`` is the K of
    ``I + J/sqrt(K)`` (default: ``depth``). Draws are vmapped; depth is a ``lax.scan``.
    """
    depth = _check_int("depth", depth)
    width = _check_int("width", width)
    num_draws = _check_int("num_draws", num_draws)
    num_blocks = depth if num_blocks is None else _check_int("num_blocks", num_blocks)
    for kind in kinds:
        _check_kind(kind)
    if not kinds:
        raise ValueError("kinds: need at least one of " + str(KINDS))
    get_initializer(kernel_init)
    scale = 1.0 / math.sqrt(num_blocks)

    def one_draw(k):
        g0 = _unit_start(jax.random.fold_in(k, 0), width)

        def body(gs, layer):
            jac = random_relu_jacobian(jax.random.fold_in(k, layer), width, kernel_init)
            gs = tuple(_step(kind, g, jac, scale) for kind, g in zip(kinds, gs))
            return gs, jnp.stack([jnp.linalg.norm(g) for g in gs])

        _, norms = jax.lax.scan(body, tuple(g0 for _ in kinds), jnp.arange(1, depth + 1))
        return jnp.concatenate([jnp.ones((1, len(kinds))), norms], axis=0)  # (depth + 1, kinds)

    norms = jax.vmap(one_draw)(jax.random.split(key, num_draws))
    return {kind: norms[:, :, i] for i, kind in enumerate(kinds)}


def expected_sq_norm_guide(kind: str, depth: int, num_blocks: int | None = None) -> np.ndarray:
    """E|g_k|^2, k = 0..depth: 1 (plain), 2^k (residual), (1 + 1/K)^k (residual_scaled, K = num_blocks)."""
    _check_kind(kind)
    k = np.arange(_check_int("depth", depth) + 1)
    if kind == "plain":
        return np.ones(k.shape)
    if kind == "residual":
        return 2.0 ** k
    K = depth if num_blocks is None else _check_int("num_blocks", num_blocks)
    return (1.0 + 1.0 / K) ** k


def percentile_bands(norms: jnp.ndarray, percentiles: Sequence[float] = (10, 50, 90)) -> dict:
    """``{'p10': ..., 'median': ..., 'p90': ...}`` over draws (axis 0) of a ``(draws, depth + 1)`` array."""
    out = {}
    for p in percentiles:
        name = "median" if p == 50 else f"p{p:g}"
        out[name] = jnp.percentile(norms, p, axis=0)
    return out
