"""Depth packing: runs of several depths of one stack of blocks in one program.

A model whose blocks are one stack (``resjax.nn.mlp``'s ``ResidualMLP``, ``PlainMLP``, ``ResidualStack``) is built
at the largest depth of the runs, and each run passes its own depth at call time (``active_depth``): the blocks
past it are the identity (``resjax.nn.residual.active_block``). A trainer packs depths with
``Core.with_packed_depths(depths)`` (``resjax.train.grid`` does it for a depth axis); then ``hparams`` holds
``active_depth`` per run, and:

- ``init_run`` draws a run's variables as the network of that depth alone draws them (the same key, the same
  initialisers, K-dependent ones included) and puts them into the largest network's layout (``embed``): the blocks
  past the run's depth keep the largest network's draws;
- ``train_step`` keeps the blocks past a run's depth exactly as they were (``keep_inactive``): parameters,
  ``batch_stats`` and every optimiser-state entry shaped like the parameters (momentum, Adam's moments), so weight
  decay and optimiser state never move them.

A packed run of depth d then trains the depth-d network's computation: the same parameters, the same operations
on them; the results equal the depth-d network trained alone to float rounding (XLA fuses the two programs
differently: ``tests/test_grid_packing.py`` states the tolerance).

Width packs the same way (``Core.with_packed_widths``, ``hparams['active_width']``): the model is built at the
largest width and a narrower run's variables are its own network's draws padded with zeros (``embed``). A unit
past the run's width is then zero in every example, its weights get zero gradient (their inputs or output
cotangents are zero), and weight decay, momentum and Adam keep zeros at zero: nothing inside the model changes,
and the run computes the narrow network's numbers plus exact zeros (``packable_width`` says where this holds).

The program scans its stack (``nn.scan``, one block compiled) even where the config unrolls it (``scanned``;
``Core._packed`` sets ``scan=True`` and ``packed_unrolled``): an unrolled stack of the largest depth compiles one
block per depth and masks each, and on the 2-core CPU took about twice the compile time and three times the epoch
time (``docs/benchmarks.md``, section 5). The draws are the unrolled network's own (``init_run`` draws in the
config's layout and stacks them), and ``own_run`` gives a run back as its own network holds it
(``GridResult.select``). Where a shallower network's draws are a deeper one's first blocks
(``draws_are_prefixes``), ``init_run`` draws one network per width, not one per depth and width.

Packable (``packable``): the three MLP kinds built by name, unrolled or scanned without ``remat``, whose forward
pass does not depend on the number of blocks (``scaling='tau'`` with a rule of K, ``'1/sqrt(K)'``, is not), with an
optimiser whose update is elementwise per parameter (the built-in ones; a per-leaf norm, as LARS takes, would see
a scanned stack's inactive blocks).
"""

from __future__ import annotations

from typing import Any

import flax.traverse_util as traverse_util
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KINDS", "check_packed", "draws_are_prefixes", "embed", "keep_inactive", "own_run", "packable",
           "packable_width", "scanned", "sized", "unrolled"]

#: The ``build_model`` kinds whose depth packs, and the config field of their depth.
KINDS = {"residual_mlp": "num_blocks", "plain_mlp": "depth", "residual_stack": "num_blocks"}
_STACK = "blocks"  # the MLPs' stack name (``stack_blocks``'s default)


def packable(config: Any, optim: dict | None = None) -> str | None:
    """``None`` when the depth of ``config``'s model (a run config, its model built by name) packs into one
    program, else why not (a sentence)."""
    from resjax.nn.residual import resolve_tau
    from resjax.train.optim import BUILTIN_OPTIMIZERS

    model = config.get("model") if hasattr(config, "get") else None
    if model is None or model.get("kind") not in KINDS:
        kind = None if model is None else model.get("kind")
        return f"the model kind {kind!r} has no packed depth (only {sorted(KINDS)})"
    if model.get("remat", False) is not False:
        return "a rematerialised stack (remat) has no packed depth"
    block = model.get("block", None)
    if block is not None:
        return "a model given its own block has no packed depth"
    if model.get("scaling", "none") == "tau":
        tau = model.get("tau", 1.0)
        if resolve_tau(tau, 1) != resolve_tau(tau, 2):
            return f"its tau rule {tau!r} depends on the number of blocks"
    if optim and optim.get("optimizer") is not None:
        return "an optimiser of your own may not be elementwise"
    if config.train.get("optimizer", "sgd") not in BUILTIN_OPTIMIZERS:
        return f"the optimizer {config.train.get('optimizer')!r} is not one of the built-in elementwise ones"
    return None


def packable_width(config: Any, optim: dict | None = None) -> str | None:
    """``None`` when the width of ``config``'s model packs into one program (``embed``: a narrower run's units past
    its width are zero and stay zero), else why not. Needs every op to keep a unit that is zero everywhere at zero:
    BatchNorm or no norm (a layer or group norm mixes the units), an activation with f(0) = 0, no Fixup scalar
    biases; and the MLP with a stem (``residual_stack`` takes its width from its input)."""
    from resjax.nn import build_model

    why = packable(config, optim)
    if why is not None:
        return why
    model = config.model
    if model.kind not in ("residual_mlp", "plain_mlp"):
        return f"the model kind {model.kind!r} takes its width from its input"
    if model.get("norm", "none") not in ("batch", "none"):
        return f"norm {model.get('norm')!r} mixes the units (only 'batch' or 'none' keep a zero unit at zero)"
    if model.get("scaling", "none") == "fixup":
        return "Fixup's scalar biases move the units past a run's width"
    built = build_model(model.to_dict() if hasattr(model, "to_dict") else dict(model), num_classes=2)
    if float(built.activation(jnp.zeros((), jnp.float32))) != 0.0:
        return "its activation does not map 0 to 0"
    return None


def _corner(shape: tuple) -> tuple:
    """The index of a leaf's leading corner of ``shape`` (where ``embed`` puts a smaller network's leaf)."""
    return tuple(slice(0, n) for n in shape)


def draws_are_prefixes(model: Any, field: str, example_shape: tuple) -> bool:
    """Whether ``model`` (an MLP of ``KINDS``) at depth 1 draws, from one key, exactly the variables of its depth-3
    self's stem, head and first block (each leaf the leading corner of the deeper one's). Then a packed program
    draws each run's network once per width, at the largest depth, instead of once per depth and width
    (``Core.init_run``): an unrolled stack names its blocks' draws by position. Not so where an initialiser
    depends on the number of blocks (Fixup's K^(-1/(2m-2))) or a scanned stack splits its key by the depth;
    checked by drawing both (a small network, eagerly), not assumed."""
    x = jnp.zeros((2, *example_shape), jnp.float32)
    key = jax.random.key(0)
    rngs = {"params": key, "dropout": jax.random.fold_in(key, 1)}
    small, big = (dict(jax.tree_util.tree_flatten_with_path(model.clone(**{field: k}).init(rngs, x, train=False))[0])
                  for k in (1, 3))
    return all(path in big and np.array_equal(big[path][_corner(np.shape(leaf))], leaf)
               for path, leaf in small.items())


def _block_index(path: tuple) -> tuple[str, int | None]:
    """``('scan', None)`` for a leaf of a scanned stack, ``('unrolled', k)`` for block k's, ``('other', None)``."""
    if path and path[0] == _STACK and len(path) > 1 and path[1] == "block":
        return "scan", None
    if path and path[0].startswith(_STACK + "_") and path[0][len(_STACK) + 1:].isdigit():
        return "unrolled", int(path[0][len(_STACK) + 1:])
    return "other", None


def embed(small: dict, big: dict) -> dict:
    """The variables ``small`` (one collection or a dict of them, of a network of depth d and width w) in the layout
    of ``big`` (the same network at a larger depth or width): every leaf of ``small`` as it is, a scanned stack's
    leaves extended by ``big``'s blocks past d, the unrolled blocks past d ``big``'s, and a narrower leaf padded
    with zeros (the units past w: zero in, zero out, zero gradient)."""
    fs, fb = traverse_util.flatten_dict(small), traverse_util.flatten_dict(big)
    out = {}
    for path, b in fb.items():
        s = fs.get(path)
        if s is None:
            out[path] = b
        elif s.shape == b.shape:
            out[path] = s
        elif _block_index(path)[0] == "scan" and s.shape[1:] == b.shape[1:]:  # a scanned stack: d blocks of K
            out[path] = jnp.concatenate([s, b[s.shape[0]:]])
        else:  # narrower: zeros past its width (and past its depth)
            out[path] = jnp.zeros_like(b).at[_corner(s.shape)].set(s.astype(b.dtype))
    return traverse_util.unflatten_dict(out)


def _keep(new: Any, old: Any, active_depth: jax.Array) -> Any:
    """``new`` where a leaf belongs to a block below ``active_depth`` (or to no block), else ``old``."""
    if not isinstance(new, dict) or not new:
        return new
    fn, fo = traverse_util.flatten_dict(new), traverse_util.flatten_dict(old)
    out = {}
    for path, n in fn.items():
        kind, k = _block_index(path)
        if kind == "scan":
            on = (jnp.arange(n.shape[0]) < active_depth).reshape((-1,) + (1,) * (n.ndim - 1))
            out[path] = jnp.where(on, n, fo[path])
        elif kind == "unrolled":
            out[path] = jnp.where(k < active_depth, n, fo[path])
        else:
            out[path] = n
    return traverse_util.unflatten_dict(out)


def keep_inactive(new_state: Any, old_state: Any, active_depth: jax.Array) -> Any:
    """``new_state`` (a ``ModelState`` after a step) with the blocks at or past ``active_depth`` as in
    ``old_state``: their parameters, ``batch_stats`` and every optimiser-state entry shaped like the parameters."""
    params_def = jax.tree_util.tree_structure(new_state.params)

    def like_params(node: Any) -> bool:
        return isinstance(node, dict) and jax.tree_util.tree_structure(node) == params_def

    opt = jax.tree_util.tree_map(lambda n, o: _keep(n, o, active_depth) if like_params(n) else n,
                                 new_state.opt_state, old_state.opt_state, is_leaf=like_params)
    return new_state.replace(params=_keep(new_state.params, old_state.params, active_depth),
                              batch_stats=_keep(new_state.batch_stats, old_state.batch_stats, active_depth),
                              opt_state=opt)


def check_packed(name: str, values: Any, packed: tuple) -> None:
    """``ValueError`` naming ``hparams.<name>`` unless every value is one of the ``packed`` ones."""
    v = np.asarray(values, np.float64).reshape(-1)
    bad = sorted({float(x) for x in v if not any(x == d for d in packed)})
    if bad:
        what = "depths" if name == "active_depth" else "widths"
        raise ValueError(f"hparams.{name}: {bad} not among the program's packed {what} {list(packed)}")


def _has_stack(node: Any) -> bool:
    """Whether ``node`` is a dict holding a stack of blocks, unrolled (``blocks_0`` ...) or scanned
    (``blocks/block``)."""
    return isinstance(node, dict) and (f"{_STACK}_0" in node or (isinstance(node.get(_STACK), dict)
                                                                 and "block" in node[_STACK]))


def _convert(tree: Any, convert: Any) -> Any:
    """``tree`` (any pytree) with ``convert`` applied to every dict that holds a stack of blocks (a variable
    collection, the parameters, an optimiser-state entry shaped like them)."""
    return jax.tree_util.tree_map(lambda n: convert(n) if _has_stack(n) else n, tree, is_leaf=_has_stack)


def scanned(tree: Any, num_blocks: int) -> Any:
    """``tree`` (variables, a ``ModelState``, a ``RunState``) with every unrolled stack of ``num_blocks`` blocks
    (``blocks_0`` ...) in the scanned layout (``blocks/block``, a leading block axis; ``stack_unrolled``). A packed
    program scans the stack that a config unrolls (``Core._packed``): one block in the program instead of one per
    depth (see the module docstring); ``unrolled`` gives a run back in the config's layout."""
    from resjax.nn.residual import stack_unrolled

    return _convert(tree, lambda d: stack_unrolled(d, num_blocks, _STACK) if f"{_STACK}_0" in d else d)


def unrolled(tree: Any, num_blocks: int) -> Any:
    """The inverse of ``scanned``."""
    from resjax.nn.residual import unstack_scanned

    return _convert(tree, lambda d: unstack_scanned(d, num_blocks, _STACK) if _STACK in d else d)


def sized(config: Any, depth: int | None = None, width: int | None = None) -> Any:
    """A copy of the run config ``config`` with its model at ``depth`` (``KINDS``' field) and ``width`` (``None``:
    as it is)."""
    import ml_collections

    out = ml_collections.ConfigDict(config.to_dict())
    if depth is not None:
        out.model[KINDS[out.model.kind]] = int(depth)
    if width is not None:
        out.model.width = int(width)
    return out


def own_run(trainer: Any, run: Any, depth: int | None, width: int | None) -> Any:
    """One run (no seed axis) of the packed program ``trainer`` as its own network holds it: the config's layout
    (``unrolled``), the blocks past ``depth`` and the units past ``width`` left out (each leaf the leading corner of
    the packed one, where ``embed`` put it). What ``GridResult.select`` returns: the run's own network, built from
    the config at that depth and width, applies to it."""
    if trainer.packed_unrolled:
        run = unrolled(run, max(trainer.packed_depths))
    config = sized(trainer.config, depth, width)
    if trainer.packed_unrolled:
        config.model.scan = False
    own = jax.eval_shape(trainer.with_config(config).init_run, jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(own)
    big = dict(jax.tree_util.tree_flatten_with_path(run)[0])
    return jax.tree_util.tree_unflatten(treedef, [big[path][_corner(np.shape(leaf))]
                                                  for path, leaf in leaves])
