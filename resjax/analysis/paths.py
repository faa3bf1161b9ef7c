"""The exact path expansion of a residual network's Jacobian, grouped by path length, and path counts.

A residual stack ``x_k = x_{k-1} + f_k(x_{k-1})``, k = 1..K, has the stream Jacobian

    d x_K / d x_0 = (I + J_K) ... (I + J_1),       J_k = d f_k / d x at x_{k-1}

(lecture 000, "Gradients through the identity", "Expanding the product"). Multiplied out it is a sum of
2^K terms, one per path: a path takes the branch at a chosen subset of m blocks and the skip at the
others, and contributes the product of the chosen blocks' Jacobians, later blocks on the left. Grouped
by the number m of branches a path passes through (its length),

    d x_K / d x_0 = sum_m E_m(K),     E_m(k) = E_m(k-1) + J_k E_{m-1}(k-1),    E_0(0) = I, E_m(0) = 0 (m > 0)

This recursion is exact and costs K (K + 1) matrix products, never 2^K: ``expand_by_length`` runs it with
``lax.scan`` over blocks and one batched product over m per block. The matrix-free forms apply it to a
vector with JVPs (``expand_jvp``: ``e_m = E_m v``) or VJPs (``expand_vjp``: ``r_m = E_m^T u``, the
gradient that reaches ``x_0`` through paths of length m when ``u = dL/dx_K``), so they work for wide and
convolutional streams whose Jacobians would not fit in memory.

Two levels of use:

- any residual stack: a ``BranchStack(branch, thetas, num_blocks)`` with ``branch(theta_k, x) =
  f_k(x)`` for one example ``x`` (no batch axis) and ``thetas`` a pytree whose leaves have a leading axis
  of size K (block k's parameters). ``block_jacobians``, ``expand_jvp``, ``expand_vjp`` take it, and
  ``path_expansion(stack, x0)`` for a batch. ``branch_stack([(f_1, params_1), ..., (f_K, params_K)])``
  builds one from your own blocks ``x <- x + f_k(params_k, x)`` (any functions, no resjax module);
- a resjax ``ResidualMLP`` (``order='pre'``, any norm, unrolled or ``scan=True``): ``residual_stack_of``
  builds the stack from the module itself: each branch is the module's own ``ResidualBlock`` applied with
  block k's ``params``/``batch_stats``, minus its input (``f_k(x) = block_k(x) - x``); BatchNorm runs in
  evaluation mode (running estimates), so examples do not couple and per-example Jacobians exist.
  ``stream_input`` gives ``x_0`` (the stem's output) and ``path_expansion`` does it all for a batch.
  Precision: since a branch is ``block(x) - x``, ``J_k v`` carries a float32 rounding error of about
  eps |v| (the skip's share), so terms are accurate relative to the expansion's overall size (about
  1e-7 of ``sum_m |E_m|``), not each to eps of itself when branch Jacobians are far below 1.

Path counts: ``C(K, m)`` of the 2^K paths have length m (``path_counts``, ``path_length_shares``);
``central_band(K)`` is the shortest run of lengths holding half of all paths (25 to 29 for K = 54) and
``share_of_paths(K, lo, hi)`` the share in a range (5 to 17 of 54: 0.45%).

Veit et al. (2016)'s measure of how much gradient each length carries is not the exact sum: the typical
magnitude of one path of length m times the number C(K, m) of such paths (magnitudes, so no
cancellation). ``sampled_path_magnitudes`` estimates the typical magnitude by sampling random subsets of
m blocks (``random_path_masks``) and multiplying their Jacobians, identity elsewhere (``path_magnitudes``).

Everything here is a pure function of arrays (jit- and vmap-able); bad input (K = 0, a module without
residual blocks, shapes that do not match) raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resjax.analysis.protocol import applied
from resjax.nn.block import ResidualBlock
from resjax.nn.residual import stack_unrolled
from resjax.nn.resnet import ResNet, TakiResNet
from resjax.nn.signal import ResNet1D

__all__ = [
    "BranchStack", "PathExpansion", "branch_stack", "residual_stack_of", "stream_input", "trajectory", "block_jacobians", "expand_by_length",
    "expand_jvp", "expand_vjp", "path_expansion", "contributions_by_length", "expansion_rel_error",
    "random_path_masks", "path_magnitudes", "sampled_path_magnitudes", "path_counts", "path_length_shares",
    "central_band", "share_of_paths",
]


class BranchStack(NamedTuple):
    """K residual blocks ``x <- x + branch(thetas[k], x)``; ``x`` is one example (no batch axis).

    Attributes:
        branch: ``branch(theta_k, x) = f_k(x)``, block k's branch applied to one example with its parameters
            ``theta_k``; the output has the shape of ``x``.
        thetas: a pytree whose leaves have a leading axis of size K (block k's parameters at index k - 1).
        num_blocks: K, at least 1.
    """

    branch: Callable[[Any, jnp.ndarray], jnp.ndarray]
    thetas: Any
    num_blocks: int


def _same_structure(params: list) -> bool:
    first = jax.tree_util.tree_structure(params[0])
    shapes = [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree_util.tree_leaves(params[0])]
    return all(jax.tree_util.tree_structure(p) == first
               and [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree_util.tree_leaves(p)] == shapes
               for p in params[1:])


def branch_stack(branches: Any) -> BranchStack:
    """A ``BranchStack`` from your own residual stack: ``[(f_1, params_1), ..., (f_K, params_K)]``.

    Block k is ``x <- x + f_k(params_k, x)`` on one example ``x`` (no batch axis), ``f_k``'s output of the
    shape of ``x``: for a Linen branch module ``b`` with parameters ``p``, ``f_k = lambda p, x: b.apply({'params':
    p}, x[None])[0]``. When every ``f_k`` is the same function and every ``params_k`` has the same tree and
    shapes, the parameters are stacked (one branch under ``lax.scan``, as resjax's own stacks); otherwise
    block k's branch is chosen by ``lax.switch`` with its parameters held as constants. Either way the
    analyses (``path_expansion(stack, x0)``, ``block_jacobians``, ``expand_jvp``, ``expand_vjp``) give the
    exact expansion of ``(I + J_K) ... (I + J_1)``.

    Raises:
        ValueError: no branches, or an entry that is not a ``(function, params)`` pair.
    """
    if isinstance(branches, BranchStack):
        return branches
    branches = list(branches)
    if not branches:
        raise ValueError("branch_stack: no branches (K = 0); a residual stack needs at least one block")
    for k, entry in enumerate(branches):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[0])):
            raise ValueError(f"branch_stack: entry {k} is not a (branch_function, params) pair: "
                             f"{type(entry).__name__}")
    fns = [f for f, _ in branches]
    params = [p for _, p in branches]
    if all(f is fns[0] for f in fns) and _same_structure(params):
        thetas = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params)
        return BranchStack(fns[0], thetas, len(branches))
    closed = [(lambda x, f=f, p=p: f(p, x)) for f, p in branches]

    def branch(index, x):
        return jax.lax.switch(index, closed, x)

    return BranchStack(branch, jnp.arange(len(branches)), len(branches))


# ---- building a stack from a resjax module -----------------------------------------------------------


def _block_names(collection: dict, name: str) -> tuple[str, int]:
    """('unrolled' | 'scanned', K) for the blocks of ``collection``; ValueError when there are none."""
    if name in collection and isinstance(collection[name], dict) and "block" in collection[name]:
        leaves = jax.tree_util.tree_leaves(collection[name]["block"])
        return "scanned", (int(leaves[0].shape[0]) if leaves else 0)
    ks = sorted(int(m.group(1)) for key in collection if (m := re.fullmatch(rf"{name}_(\d+)", key)))
    if ks and ks != list(range(len(ks))):
        raise ValueError(f"residual blocks: expected {name}_0 ... {name}_{len(ks) - 1}, found indices {ks}")
    return "unrolled", len(ks)


def _resnet_stage(module: ResNet, stage: Any) -> int:
    """``stage`` checked against a ``ResNet``'s stages: an integer 1..N whose stage has blocks after its first.

    Each refusal says how to get a path expansion: a post-order ResNet (the default of ``cifar_resnet`` and
    ``imagenet_resnet``) is refused first, naming ``order='pre'`` and the ``stage=`` values that model would
    take; a ResNet with no stage of two or more blocks names the depth it needs; a missing ``stage`` lists
    the stages to pass."""
    num = len(module.stage_sizes)
    usable = [s for s in range(1, num + 1) if module.stage_sizes[s - 1] >= 2]
    stages = (f"stage={usable[0]}" if len(usable) == 1 else
              "stage=" + ", ".join(str(s) for s in usable[:-1]) + f" or {usable[-1]}") if usable else None
    deeper = (f"no stage of this ResNet has blocks after its first (stage_sizes={tuple(module.stage_sizes)}); "
              "path expansion needs a stage of 2 or more blocks (stage_sizes >= 2, e.g. cifar_resnet(14) or "
              "deeper)")
    if module.order != "pre":
        raise ValueError(f"path expansion: order={module.order!r} puts an activation after each block's sum, so a "
                         f"block is not x + f(x): build the model with order='pre' (e.g. build_model(dict(kind=..., "
                         f"order='pre')) or cifar_resnet(depth, order='pre')) and pass "
                         + (f"{stages} (a stage's blocks after its first)" if stages else
                            f"stage=s; also, {deeper}"))
    if stage is None:
        if not usable:
            raise ValueError(f"stage: {deeper}")
        raise ValueError(f"stage: a ResNet's stream changes shape from stage to stage, so its path expansion is "
                         f"one stage's: pass {stages} (the stages with blocks after their first)")
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 1 <= stage <= num:
        raise ValueError(f"stage: must be an integer in 1..{num} (the ResNet's stages), got {stage!r}")
    if module.stage_sizes[stage - 1] < 2:
        raise ValueError(f"stage: stage {stage} of the ResNet has {module.stage_sizes[stage - 1]} block, its first "
                         "(which may change the shape); path expansion needs blocks after it (stage_sizes >= 2)"
                         + (f"; pass {stages}" if stages else f"; {deeper}"))
    return int(stage)


def residual_stack_of(module: nn.Module, variables: dict, *, tau: float | jax.Array | None = None,
                      block: ResidualBlock | None = None, name: str = "blocks",
                      stage: int | None = None) -> BranchStack:
    """The residual stack of a resjax module, built from its own ``ResidualBlock`` and parameters.

    Block k's branch is ``f_k(x) = block(x) - x``: the ``ResidualBlock`` applied to one example with block
    k's ``params`` and ``batch_stats``, in evaluation mode (``train=False``: BatchNorm uses the running
    estimates, so examples do not couple).

    Args:
        module: a ``ResidualMLP`` or ``ResidualStack``: anything with ``block_kwargs()``, from which the
            ``ResidualBlock`` is rebuilt; a ``TakiResNet`` (its ``TakiBlock``s, on the stream of images
            ``(H, W, C)``). Any other module needs ``block`` (and, unless its blocks are
            named ``blocks``, ``name``); its ``num_blocks``, if it has one, must equal the blocks found.
        variables: the module's variables: ``'params'`` (required) and ``'batch_stats'`` (read when
            present and non-empty, in the same layout as ``'params'``).
        tau: the call-time tau of ``scaling='tau'`` blocks (may be traced); None: the block's own field.
        block: the ``ResidualBlock`` (same fields) that every block of ``module`` is, for a module without
            ``block_kwargs()``; it replaces the one rebuilt from ``block_kwargs()``.
        name: the blocks' name in the parameter tree (default ``'blocks'``, as ``ResidualMLP`` and
            ``resjax.nn.stack_blocks`` name them).
        stage: for a convolutional ``resjax.nn.ResNet`` (required there, refused elsewhere): the stage
            s = 1..N whose blocks after its first (``stage{s}_0`` ... or scanned ``stage{s}/block``: identity
            shortcuts, one shape) form the stack; its stream x_0 is the output of the stage's first block
            (``stream_input(..., stage=s)``). The blocks must be ``x + f(x)``: ``order='pre'``.

    Accepted layouts of ``variables['params']``, K >= 1 blocks:

    - scanned: ``params[name]`` is a dict holding ``'block'``, whose leaves have a leading axis of size K:
      blocks applied with ``nn.scan`` under the name ``name``, the scanned module inside called ``block``
      (``ResidualMLP(scan=True)``: ``blocks/block``). K is read from the first leaf's leading axis;
    - unrolled: top-level entries ``{name}_0`` ... ``{name}_{K-1}`` (``blocks_0`` ...), numbered from 0
      without gaps; they are stacked into the scanned layout (``stack_unrolled``).

    The error messages say the same: a module without ``block_kwargs()`` and no ``block`` is refused
    ("pass a ResidualMLP (or block=ResidualBlock(...) ...)"), and parameters holding neither
    ``'{name}_<k>'`` nor ``'{name}/block'`` are "no residual blocks (K = 0)". So a module of resjax
    residual blocks under another name, or scanned with an inner module not called ``block``, needs
    ``block=`` and ``name=`` (and, for the latter, renaming its inner module to ``block``).

    Returns:
        A ``BranchStack`` of the K blocks; ``thetas`` holds ``{'params', 'batch_stats'}`` per block.

    Raises:
        ValueError: ``module`` has no ``block_kwargs()`` and no ``block`` is given; the block is not of the
            form ``x + f(x)``: ``order='post'`` (an activation after the sum) or ``scaling='rescale'`` (the
            sum times 1/sqrt(2)); ``variables`` has no ``'params'``; unrolled indices that do not run
            0 ... K-1; no blocks found (K = 0); ``module.num_blocks`` differs from the blocks found.
    """
    applied(module, variables, "residual_stack_of")  # an NNX object: say what to pass
    expected = None
    if isinstance(module, ResNet):
        stage = _resnet_stage(module, stage)
        if block is None:
            block_cls, kwargs = module._block(stage - 1, 1)  # the stage's identity-shortcut block
            block = block_cls(**kwargs, parent=None)
        name, expected = f"stage{stage}", module.stage_sizes[stage - 1] - 1
    elif isinstance(module, TakiResNet) and stage is None:  # one stack of TakiBlocks, x + conv(act(N(x)))
        if block is None:
            block_cls, kwargs = module._block()
            block = block_cls(**kwargs, parent=None)
    elif stage is not None:
        raise ValueError(f"stage: only a resjax.nn.ResNet has stages, got {type(module).__name__}")
    if block is None:
        if not hasattr(module, "block_kwargs"):
            raise ValueError(f"path expansion: {type(module).__name__} has no residual blocks; pass a ResidualMLP "
                             "(or block=ResidualBlock(...) for a module built from resjax residual blocks; for a "
                             "stack of your own, branch_stack([(f_1, params_1), ...]))")
        block = ResidualBlock(**module.block_kwargs(), parent=None)
    if not getattr(block, "skip", True):  # a PlainMLP: resjax's blocks without their skips
        raise ValueError(f"path expansion: {type(module).__name__} has no residual blocks (its blocks have no skip)")
    if block.order != "pre":
        raise ValueError(f"path expansion: order={block.order!r} puts an activation after the sum, so a block is "
                         "not x + f(x); use order='pre' (pre-activation blocks)")
    if block.scaling == "rescale":
        raise ValueError("path expansion: scaling='rescale' multiplies the sum by 1/sqrt(2), so a block is not "
                         "x + f(x); use scaling 'none', 'tau', 'skipinit' or 'fixup'")
    if "params" not in variables:
        raise ValueError("path expansion: variables have no 'params' collection")
    layout, num = _block_names(variables["params"], name)
    if num == 0:
        raise ValueError(f"path expansion: {type(module).__name__} has no residual blocks (K = 0): no "
                         f"'{name}_<k>' or '{name}/block' parameters")
    expected = getattr(module, "num_blocks", num) if expected is None else expected
    if expected != num:
        raise ValueError(f"path expansion: module has num_blocks={expected} but its parameters hold {num} blocks")
    thetas = {}
    for col in ("params", "batch_stats"):
        if col in variables and variables[col]:
            c = variables[col] if layout == "scanned" else stack_unrolled(variables[col], num, name)
            thetas[col] = c[name]["block"]

    def branch(theta, x):
        return block.apply(theta, x[None], train=False, tau=tau)[0] - x

    return BranchStack(branch, thetas, num)


def stream_input(module: nn.Module | Callable[..., Any], variables: dict, inputs: jnp.ndarray, *,
                 tau: float | jax.Array | None = None, stage: int | None = None) -> jnp.ndarray:
    """``x_0``, the stream before the first block (a ``ResidualMLP``'s stem output), for a batch of inputs.

    Runs ``module`` (a Linen module or an ``apply_fn``, ``resjax.analysis.protocol``) once, in evaluation
    mode (``train=False``) where its ``__call__`` takes ``train``, and reads its sown ``'stem_out'``
    (top level: ``self.sow('intermediates', 'stem_out', h)``): shape ``(B, D)`` for inputs
    ``(B, in_features)``. ``ValueError`` if the module sows no ``'stem_out'``. A convolutional
    ``resjax.nn.ResNet`` needs ``stage`` (1..N): x_0 of that stage's stack (``residual_stack_of``) is the
    output of the stage's first block (sown ``stage{s}_first/block_out``), ``(B, H, W, C)``.
    """
    model = applied(module, variables, "stream_input")
    kwargs = {} if tau is None else {"tau": tau}
    train = {"train": False} if model.train_mode == "named" else {}
    variables = {k: v for k, v in variables.items() if k != "intermediates"}
    if isinstance(module, ResNet):
        stage = _resnet_stage(module, stage)
    elif stage is not None:
        raise ValueError(f"stage: only a resjax.nn.ResNet has stages, got {model.name}")
    _, state = model.apply(variables, inputs, mutable=["intermediates"], **train, **kwargs)
    if stage is not None:
        return state["intermediates"][f"stage{stage}_first"]["block_out"][0]
    sown = state.get("intermediates", {}).get("stem_out")
    if sown is None:
        raise ValueError(f"path expansion: {model.name} does not sow 'stem_out'; sow it with "
                         "self.sow('intermediates', 'stem_out', h) or compute x_0 yourself")
    return sown[0]


# ---- the expansion -----------------------------------------------------------------------------------


def _check(stack: BranchStack, x0, vector=None, vector_name: str = "v") -> None:
    if not isinstance(stack.num_blocks, int) or stack.num_blocks < 1:
        raise ValueError(f"path expansion: K = {stack.num_blocks}; a residual stack needs at least one block")
    leaves = jax.tree_util.tree_leaves(stack.thetas)
    for leaf in leaves:
        if jnp.shape(leaf)[:1] != (stack.num_blocks,):
            raise ValueError(f"path expansion: a parameter leaf of shape {jnp.shape(leaf)} has no leading axis of "
                             f"size K = {stack.num_blocks}")
    theta0 = jax.tree_util.tree_map(lambda a: a[0], stack.thetas)
    out = jax.eval_shape(stack.branch, theta0, jax.ShapeDtypeStruct(jnp.shape(x0), jnp.result_type(x0)))
    if out.shape != jnp.shape(x0):
        raise ValueError(f"path expansion: a branch maps the stream shape {jnp.shape(x0)} to {out.shape}; "
                         "skip and branch must have equal shapes")
    if vector is not None and jnp.shape(vector) != jnp.shape(x0):
        raise ValueError(f"path expansion: {vector_name} has shape {jnp.shape(vector)}, the stream x_0 has "
                         f"{jnp.shape(x0)}; they must be equal")


def trajectory(stack: BranchStack, x0: jnp.ndarray) -> jnp.ndarray:
    """The stream ``x_0 ... x_K`` of one example, shape ``(K + 1, *x0.shape)``."""
    _check(stack, x0)

    def step(x, theta):
        x = x + stack.branch(theta, x)
        return x, x

    _, xs = jax.lax.scan(step, x0, stack.thetas)
    return jnp.concatenate([x0[None], xs])


def block_jacobians(stack: BranchStack, x0: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Dense ``J_k = d f_k / d x`` at ``x_{k-1}`` on the forward trajectory, by ``jax.jacfwd``.

    Returns ``(J, xs)``: ``J`` of shape ``(K, D, D)`` with ``D = x0.size`` (the stream flattened) and the
    trajectory ``xs`` of shape ``(K + 1, *x0.shape)``. Memory is K D^2: for small widths.
    """
    _check(stack, x0)
    shape, d = jnp.shape(x0), int(np.prod(jnp.shape(x0)))

    def step(x, theta):
        flat = lambda z: stack.branch(theta, z.reshape(shape)).reshape(d)  # noqa: E731
        jac = jax.jacfwd(flat)(x.reshape(d))
        x = x + stack.branch(theta, x)
        return x, (jac, x)

    _, (jacs, xs) = jax.lax.scan(step, x0, stack.thetas)
    return jacs, jnp.concatenate([x0[None], xs])


def expand_by_length(jacobians: jnp.ndarray) -> jnp.ndarray:
    """``E_m(K)`` for m = 0..K from dense block Jacobians ``(K, D, D)`` (block 1 first): ``(K + 1, D, D)``.

    ``E_m`` is the sum of the C(K, m) path terms through exactly m branches; ``E.sum(0)`` is the full
    stream Jacobian ``(I + J_K) ... (I + J_1)``. Recursion ``E_m(k) = E_m(k-1) + J_k E_{m-1}(k-1)`` under
    ``lax.scan`` over k, one batched product over m per block: O(K^2 D^3), never 2^K terms.
    """
    jacobians = jnp.asarray(jacobians)
    if jacobians.ndim != 3 or jacobians.shape[1] != jacobians.shape[2]:
        raise ValueError(f"expand_by_length: block Jacobians must have shape (K, D, D), got {jacobians.shape}")
    num, d = jacobians.shape[0], jacobians.shape[1]
    if num < 1:
        raise ValueError("expand_by_length: K = 0; a residual stack needs at least one block")
    e0 = jnp.zeros((num + 1, d, d), jacobians.dtype).at[0].set(jnp.eye(d, dtype=jacobians.dtype))

    def step(e, jac):
        shifted = jnp.concatenate([jnp.zeros_like(e[:1]), e[:-1]])  # E_{m-1}(k-1) in slot m
        return e + jnp.einsum("ij,mjk->mik", jac, shifted), None

    e, _ = jax.lax.scan(step, e0, jacobians)
    return e


def _shift(e):
    return jnp.concatenate([jnp.zeros_like(e[:1]), e[:-1]])


def expand_jvp(stack: BranchStack, x0: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    """Matrix-free ``e_m = E_m(K) v`` for m = 0..K by JVPs: ``e_m(k) = e_m(k-1) + J_k e_{m-1}(k-1)``.

    ``x0`` and ``v`` have the stream's shape (any shape: vectors, images). Returns ``(K + 1, *x0.shape)``;
    ``e.sum(0)`` is ``d x_K / d x_0 @ v``. Costs K + 1 JVPs per block (one linearisation, vmapped).
    """
    _check(stack, x0, v, "v")
    num = stack.num_blocks
    e0 = jnp.zeros((num + 1, *jnp.shape(x0)), jnp.result_type(x0, v)).at[0].set(v)

    def step(carry, theta):
        x, e = carry
        fx, lin = jax.linearize(lambda z: stack.branch(theta, z), x)
        return (x + fx, e + jax.vmap(lin)(_shift(e))), None

    (_, e), _ = jax.lax.scan(step, (x0, e0), stack.thetas)
    return e


def expand_vjp(stack: BranchStack, x0: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """Matrix-free ``r_m = E_m(K)^T u`` for m = 0..K by VJPs (backward through the blocks).

    With ``u = dL/dx_K``, ``r_m`` is the part of the gradient ``dL/dx_0`` carried by paths through
    exactly m branches, and ``r.sum(0)`` is the gradient itself. Returns ``(K + 1, *x0.shape)``.
    """
    _check(stack, x0, u, "u")
    num = stack.num_blocks
    xs = trajectory(stack, x0)[:-1]  # x_{k-1} for k = 1..K
    r0 = jnp.zeros((num + 1, *jnp.shape(x0)), jnp.result_type(x0, u)).at[0].set(u)

    def step(r, inputs):
        theta, x = inputs
        _, vjp = jax.vjp(lambda z: stack.branch(theta, z), x)
        return r + jax.vmap(lambda c: vjp(c)[0])(_shift(r)), None

    r, _ = jax.lax.scan(step, r0, (stack.thetas, xs), reverse=True)
    return r


class PathExpansion(NamedTuple):
    """``path_expansion``'s result for a batch of B inputs: a stack of K blocks on a stream of width D.

    Attributes:
        terms: ``(B, K + 1, D, D)``. ``terms[b, m]`` = E_m(K) at example b: the sum of the products of the
            block Jacobians along all C(K, m) paths through exactly m branches (``expand_by_length``).
            Summed over m (``terms[b].sum(0)``) it is the full stream Jacobian
            d x_K / d x_0 = (I + J_K) ... (I + J_1) at example b.
        jacobians: ``(B, K, D, D)``. ``jacobians[b, k - 1]`` = J_k = d f_k / d x at x_{k-1}, block k's
            branch Jacobian at example b (rows index outputs), k = 1..K (``block_jacobians``).
        stream: ``(B, K + 1, D)``. ``stream[b, k]`` = x_k at example b: x_0 (the stem's output) ... x_K.
    """

    terms: jnp.ndarray  # (B, K + 1, D, D): E_m(K) per example
    jacobians: jnp.ndarray  # (B, K, D, D)
    stream: jnp.ndarray  # (B, K + 1, D): x_0 ... x_K


def path_expansion(module: nn.Module | BranchStack | list, variables: Any, inputs: jnp.ndarray | None = None, *,
                   tau: float | jax.Array | None = None, stage: int | None = None) -> PathExpansion:
    """Dense block Jacobians and the expansion by length of a residual stack at each of a batch of inputs.

    Two forms:

    - ``path_expansion(module, variables, inputs)``: ``module`` a ``ResidualMLP`` (or ``ResidualStack``)
      with ``order='pre'`` and the stack's blocks named ``blocks`` (``residual_stack_of`` with its
      defaults); ``inputs``: ``(B, in_features)``; ``tau``: the call-time tau of ``scaling='tau'`` models.
      BatchNorm in evaluation mode (each example on its own). A convolutional ``resjax.nn.ResNet``
      (``order='pre'``): ``inputs`` images ``(B, H, W, C)`` (a ``ResNet1D``: signals ``(B, L)`` or ``(B, L, C)``,
      the stream ``(L_s, C_s)``) and ``stage`` s (required): the expansion of
      stage s's blocks after its first, on the stream ``(H_s, W_s, C_s)`` flattened to D (``terms.sum(1)``
      is the Jacobian of that part of the stage; ``stream`` keeps the image shape: ``(B, K + 1, H_s, W_s, C_s)``);
      a post-order ResNet (``cifar_resnet``'s and ``imagenet_resnet``'s default) is refused, naming ``order='pre'``
      and the stages to pass. A ``TakiResNet`` (``x + conv(act(N(x)))`` blocks, one shape): images, no ``stage``,
      the stream ``(H, W, C)`` flattened to D as above;
    - ``path_expansion(stack, x0)``: your own residual stack, a ``BranchStack`` or a list of
      ``(branch_function, params)`` pairs (``branch_stack``), and the stream before its first block for a
      batch, ``x0``: ``(B, D)`` (e.g. ``stream_input(model, variables, inputs)`` of a model that sows
      ``'stem_out'``). No ``inputs`` and no ``tau``.

    Returns a ``PathExpansion`` (``terms`` ``(B, K + 1, D, D)``, ``jacobians`` ``(B, K, D, D)``, ``stream``
    ``(B, K + 1, D)``); memory is about 2 B K D^2 values, for small widths.
    """
    if isinstance(module, (BranchStack, list, tuple)):
        if inputs is not None or tau is not None or stage is not None:
            raise ValueError("path_expansion: a stack of your own takes path_expansion(stack, x0): the stream x0 "
                             "(B, D) before its first block, no inputs and no tau")
        stack = branch_stack(module)
        x0 = jnp.asarray(variables)
        if x0.ndim < 2:
            raise ValueError(f"path_expansion: x0 must be a batch of streams (B, D), got shape {x0.shape}")
    else:
        if inputs is None:
            raise ValueError("path_expansion: inputs (B, in_features) needed: path_expansion(module, variables, "
                             "inputs)")
        inputs = jnp.asarray(inputs)
        stack = residual_stack_of(module, variables, tau=tau, stage=stage)  # the model's blocks, checked first
        # a ResNet: images (B, H, W, C) or signals (B, L, C); a ResNet1D: signals (B, L, C) or (B, L)
        ranks = (((2, 3) if isinstance(module, ResNet1D) else (3, 4)) if isinstance(module, ResNet) else
                 (4,) if isinstance(module, TakiResNet) else (2,))
        if inputs.ndim not in ranks:
            want = ("signals (B, L) or (B, L, C)" if isinstance(module, ResNet1D) else
                    "images (B, H, W, C) or signals (B, L, C)" if isinstance(module, ResNet) else
                    "images (B, H, W, C)" if isinstance(module, TakiResNet) else
                    "a batch (B, in_features)")
            raise ValueError(f"path_expansion: inputs must be {want}, got shape {inputs.shape}")
        x0 = stream_input(module, variables, inputs, tau=tau, stage=stage)
    _check(stack, x0[0])
    jacs, xs = jax.vmap(lambda x: block_jacobians(stack, x))(x0)
    return PathExpansion(jax.vmap(expand_by_length)(jacs), jacs, xs)


def contributions_by_length(terms: jnp.ndarray, vector: jnp.ndarray, transpose: bool = False) -> jnp.ndarray:
    """``|E_m v|`` (or ``|E_m^T v|`` with ``transpose``) for m = 0..K from dense terms ``(K + 1, D, D)``."""
    if terms.ndim != 3 or jnp.shape(vector) != terms.shape[1:2]:
        raise ValueError(f"contributions_by_length: terms (K + 1, D, D) and vector (D,) needed, got "
                         f"{terms.shape} and {jnp.shape(vector)}")
    out = jnp.einsum("mji,j->mi" if transpose else "mij,j->mi", terms, vector)
    return jnp.linalg.norm(out, axis=-1)


def expansion_rel_error(terms: jnp.ndarray, full: jnp.ndarray) -> jnp.ndarray:
    """``|sum_m E_m - full| / sum_m |E_m|`` (Frobenius): exactness relative to the terms' own size, which
    stays meaningful when the product itself is huge or the terms cancel."""
    if terms.shape[1:] != jnp.shape(full):
        raise ValueError(f"expansion_rel_error: terms {terms.shape} do not match the full Jacobian {jnp.shape(full)}")
    norms = jnp.sqrt(jnp.sum(terms.reshape(terms.shape[0], -1) ** 2, axis=-1))
    return jnp.linalg.norm((terms.sum(0) - full).ravel()) / jnp.sum(norms)


def random_path_masks(key: jax.Array, num_blocks: int, num_samples: int) -> jnp.ndarray:
    """Random single paths of every length: ``(K + 1, num_samples, K)`` booleans, row ``[m, s]`` a uniformly
    random subset of exactly m of the K blocks (the blocks where the path takes the branch)."""
    num = _check_k(num_blocks)
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples: must be an integer >= 1, got {num_samples!r}")
    u = jax.random.uniform(key, (num + 1, num_samples, num))
    ranks = jnp.sum(u[..., None, :] < u[..., :, None], axis=-1)  # rank of each block's draw (no sort)
    return ranks < jnp.arange(num + 1)[:, None, None]


def path_magnitudes(jacobians: jnp.ndarray, vector: jnp.ndarray, masks: jnp.ndarray,
                    transpose: bool = False) -> jnp.ndarray:
    """Mean ``|P v|`` over the given single paths of each length (Veit et al.'s path magnitude).

    ``masks``: ``(L, S, K)`` booleans (``random_path_masks``), row ``[l, s]`` the blocks where path s of
    group l takes the branch; ``P = prod_{k in path} J_k`` (later blocks on the left, identity elsewhere).
    ``transpose`` gives ``|P^T v|``, the gradient a path carries back to ``x_0`` from ``v = dL/dx_K``.
    Returns ``(L,)``: the mean over S paths per group.
    """
    jacobians = jnp.asarray(jacobians)
    if jacobians.ndim != 3 or jacobians.shape[1] != jacobians.shape[2] or jnp.shape(vector) != jacobians.shape[1:2]:
        raise ValueError(f"path_magnitudes: Jacobians (K, D, D) and vector (D,) needed, got "
                         f"{jacobians.shape} and {jnp.shape(vector)}")
    num = jacobians.shape[0]
    if num < 1:
        raise ValueError("path_magnitudes: K = 0; a residual stack needs at least one block")
    if jnp.ndim(masks) != 3 or jnp.shape(masks)[-1] != num:
        raise ValueError(f"path_magnitudes: masks must have shape (L, S, K = {num}), got {jnp.shape(masks)}")
    masks = jnp.asarray(masks, bool)
    r0 = jnp.broadcast_to(vector, (*masks.shape[:2], vector.shape[0]))
    eq = "ji,lsj->lsi" if transpose else "ij,lsj->lsi"

    def step(r, inputs):
        jac, take = inputs
        return jnp.where(take[..., None], jnp.einsum(eq, jac, r), r), None

    # forward (J_k v, block 1 first) or backward (J_k^T v, block K first).
    r, _ = jax.lax.scan(step, r0, (jacobians, jnp.moveaxis(masks, -1, 0)), reverse=transpose)
    return jnp.mean(jnp.linalg.norm(r, axis=-1), axis=1)


def sampled_path_magnitudes(jacobians: jnp.ndarray, vector: jnp.ndarray, key: jax.Array, num_samples: int = 64,
                            transpose: bool = False) -> jnp.ndarray:
    """Mean ``|P v|`` over ``num_samples`` random single paths of each length m = 0..K: ``(K + 1,)``.

    Times ``path_counts(K)`` this is Veit et al.'s gradient per length (m = 0 and m = K are exact).
    """
    jacobians = jnp.asarray(jacobians)
    if jacobians.ndim != 3:
        raise ValueError(f"sampled_path_magnitudes: Jacobians must have shape (K, D, D), got {jacobians.shape}")
    if jacobians.shape[0] < 1:
        raise ValueError("sampled_path_magnitudes: K = 0; a residual stack needs at least one block")
    masks = random_path_masks(key, jacobians.shape[0], num_samples)
    return path_magnitudes(jacobians, vector, masks, transpose)


# ---- counting paths ----------------------------------------------------------------------------------


def _check_k(num_blocks) -> int:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
        raise ValueError(f"path counts: K must be an integer >= 1, got {num_blocks!r}")
    return int(num_blocks)


def path_counts(num_blocks: int) -> list[int]:
    """``[C(K, 0), ..., C(K, K)]``, exact integers: the number of paths through exactly m branches."""
    k = _check_k(num_blocks)
    return [math.comb(k, m) for m in range(k + 1)]


def path_length_shares(num_blocks: int) -> np.ndarray:
    """``C(K, m) / 2^K`` for m = 0..K (float64): the share of all paths through exactly m branches."""
    k = _check_k(num_blocks)
    return np.array([float(Fraction(c, 2 ** k)) for c in path_counts(k)])


def share_of_paths(num_blocks: int, lo: int, hi: int) -> float:
    """The share of all 2^K paths whose length m satisfies ``lo <= m <= hi``."""
    k = _check_k(num_blocks)
    if not (0 <= lo <= hi <= k):
        raise ValueError(f"share_of_paths: need 0 <= lo <= hi <= K = {k}, got lo={lo}, hi={hi}")
    return float(Fraction(sum(math.comb(k, m) for m in range(lo, hi + 1)), 2 ** k))


def central_band(num_blocks: int, mass: float = 0.5) -> tuple[int, int]:
    """The shortest run of lengths ``(lo, hi)`` holding at least ``mass`` of all paths (the most-filled
    one among equally short runs): the lecture's "central band holding half of all paths"."""
    k = _check_k(num_blocks)
    if not 0 < mass <= 1:
        raise ValueError(f"central_band: mass must be in (0, 1], got {mass}")
    counts = path_counts(k)
    target = Fraction(mass).limit_denominator(10 ** 12) * 2 ** k
    for width in range(1, k + 2):
        best = max(range(k + 2 - width), key=lambda lo: (sum(counts[lo:lo + width]), -abs(2 * lo + width - 1 - k)))
        if sum(counts[best:best + width]) >= target:
            return best, best + width - 1
    return 0, k
