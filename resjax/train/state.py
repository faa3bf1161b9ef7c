"""The training state: parameters, BatchNorm statistics and optimiser state as one pytree.

``batch_stats`` is ``{}`` for a model without BatchNorm. The model and the optax transformation are not
in the state (they are static); the learning rate lives in the optimiser state
(``optax.inject_hyperparams``), so it can differ between seeds of one vmapped program.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


class TrainState(flax.struct.PyTreeNode):
    step: jnp.ndarray
    params: Any
    batch_stats: Any
    opt_state: Any

    def variables(self) -> dict:
        """The ``apply`` variables: ``{'params', 'batch_stats'}`` (the latter only if non-empty)."""
        if self.batch_stats:
            return {"params": self.params, "batch_stats": self.batch_stats}
        return {"params": self.params}


def guarded_step(state: TrainState, tx: optax.GradientTransformation, grads, loss, batch_stats,
                 diverged_epoch, epoch) -> tuple[TrainState, jnp.ndarray]:
    """One optimiser step that records divergence instead of raising: when the loss or any gradient entry
    is non-finite, or the run had already diverged, the state is kept as it was (``jnp.where``, so it works
    per seed under ``vmap``), and a first divergence sets ``diverged_epoch`` to ``epoch + 1`` (1-based).
    Returns ``(state, diverged_epoch)``."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     batch_stats=batch_stats, opt_state=opt_state)
    finite = [jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]
    bad = ~jnp.all(jnp.stack([jnp.isfinite(loss), *finite]))
    was_diverged = diverged_epoch >= 0
    frozen = was_diverged | bad
    state = jax.tree_util.tree_map(lambda old, upd: jnp.where(frozen, old, upd), state, new)
    return state, jnp.where(~was_diverged & bad, epoch + 1, diverged_epoch)
