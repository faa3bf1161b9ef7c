"""The run state: ``ModelState`` (parameters, BatchNorm statistics, optimiser state, step) inside
``RunState`` (plus the run's key, data seed, epoch, divergence and the epoch history), one pytree.

``ModelState`` was called ``TrainState`` before; that is Flax's name (``flax.training.train_state.TrainState``)
for another class, one that holds ``apply_fn`` and ``tx`` and has ``apply_gradients``. ``TrainState`` still
imports from here and from ``resjax.train``, as the same class, with a ``DeprecationWarning``. Checkpoints
written with the old name restore unchanged: Orbax stores the pytree by its keys (the field names), which did
not change.

``batch_stats`` is ``{}`` for a model without BatchNorm. The model and the optax transformation are not
in the state (they are static); the learning rate and weight decay live in the optimiser state
(``optax.inject_hyperparams``), so they can differ between seeds of one vmapped program. A ``RunState`` is
everything a run is: a checkpoint of it resumes bit-identically, with either feeder.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["ModelState", "RunState", "guarded_step", "take_row", "first_rows"]


# Rows of every leaf in one compiled program, not one eager slice per leaf: with runs sharded over several
# devices each eager slice is a program of its own with a collective in it, and on CPU devices (which share one
# thread pool) dozens of them queued asynchronously can starve a rendezvous until XLA aborts the process.
def take_row(tree: Any, i: int) -> Any:
    """Row ``i`` of every leaf of ``tree`` (a leading run axis), as one compiled program."""
    return _take_row(tree, jnp.int32(i))


@jax.jit
def _take_row(tree, i):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


@functools.partial(jax.jit, static_argnums=1)
def first_rows(tree: Any, n: int) -> Any:
    """The first ``n`` rows of every leaf of ``tree`` (a leading run axis), as one compiled program."""
    return jax.tree_util.tree_map(lambda a: a[:n], tree)


class ModelState(flax.struct.PyTreeNode):
    """One model's training state, a pytree (formerly ``TrainState``; not Flax's ``TrainState``: no
    ``apply_fn`` or ``tx``, which resjax keeps outside the state as static parts of the program).

    Attributes:
        step: int32, the optimiser steps taken.
        params: the model's ``'params'``.
        batch_stats: the model's ``'batch_stats'`` (``{}`` without BatchNorm).
        opt_state: the optax state; ``opt_state.hyperparams`` holds the injected ``learning_rate`` and
            ``weight_decay``.
    """

    step: jnp.ndarray
    params: Any
    batch_stats: Any
    opt_state: Any

    def variables(self) -> dict:
        """The ``apply`` variables: ``{'params', 'batch_stats'}`` (the latter only if non-empty)."""
        if self.batch_stats:
            return {"params": self.params, "batch_stats": self.batch_stats}
        return {"params": self.params}


class RunState(NamedTuple):
    """One run (a leading seed axis on every leaf when several runs are stepped together)."""

    state: ModelState
    key: jax.Array  # typed PRNG key: on-device permutations fold_in(key, epoch); model RNG fold_in(key, step)
    data_seed: jnp.ndarray  # int32: the host data source's seed
    epoch: jnp.ndarray  # epochs completed
    diverged_epoch: jnp.ndarray  # 1-based epoch of divergence, -1 if none
    history: dict  # metric name -> float32[epochs], NaN where not yet run (``resjax.train.core.METRICS``)

    @property
    def num_runs(self) -> int | None:
        """The length of the leading seed axis, or None for a single run (no seed axis)."""
        return int(self.epoch.shape[0]) if jnp.ndim(self.epoch) else None

    def select(self, i: int) -> RunState:
        """Run ``i`` of a state with a seed axis (``Trainer.sweep``, ``ImageTrainer.fit`` of several seeds): every
        leaf's row ``i`` (params, batch_stats, optimiser state, key, epoch, history), a single run to evaluate,
        export (``run.select(0).state.variables()``) or continue (``fit(run.select(0))``)."""
        n = self.num_runs
        if n is None:
            raise ValueError("select: this run state has no seed axis (it is one run already)")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise ValueError(f"select: want a run index in [0, {n}), got {i!r}")
        return take_row(self, i)


def guarded_step(state: ModelState, tx: optax.GradientTransformation, grads: Any, loss: jax.Array, batch_stats: Any,
                 diverged_epoch: jax.Array, epoch: jax.Array) -> tuple[ModelState, jnp.ndarray]:
    """One optimiser step that records divergence instead of raising: when the loss or any gradient entry
    is non-finite, or the run had already diverged, the state is kept as it was (``jnp.where``, so it works
    per seed under ``vmap``), and a first divergence sets ``diverged_epoch`` to ``epoch + 1`` (1-based).
    Returns ``(state, diverged_epoch)``."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = ModelState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     batch_stats=batch_stats, opt_state=opt_state)
    # One check over the loss and every gradient entry, concatenated: XLA:CPU then runs it as one kernel instead of
    # a reduction per parameter leaf (which also split the gradients' fusions): a depth-32 MLP step launched 491
    # kernels with a check per leaf, 295 so (benchmarks.throughput, section 5).
    entries = [jnp.ravel(loss)] + [jnp.ravel(g) for g in jax.tree_util.tree_leaves(grads)]
    bad = ~jnp.all(jnp.isfinite(jnp.concatenate(entries)))
    was_diverged = diverged_epoch >= 0
    frozen = was_diverged | bad
    state = jax.tree_util.tree_map(lambda old, upd: jnp.where(frozen, old, upd), state, new)
    return state, jnp.where(~was_diverged & bad, epoch + 1, diverged_epoch)


#: Old names of this module's classes: still importable, with a ``DeprecationWarning`` naming the new one.
DEPRECATED_NAMES = {"TrainState": "ModelState"}


def deprecated_name(module: str, name: str) -> Any:
    """The object an old name of ``DEPRECATED_NAMES`` stands for, with a ``DeprecationWarning`` (for a module's
    ``__getattr__``); ``AttributeError`` for any other name, as Python gives."""
    if name in DEPRECATED_NAMES:
        import warnings

        new = DEPRECATED_NAMES[name]
        warnings.warn(f"{module}.{name} is deprecated: it is now {module}.{new} (the same class; Flax's "
                      f"TrainState is another one)", DeprecationWarning, stacklevel=3)
        return globals()[new]
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    return deprecated_name(__name__, name)
