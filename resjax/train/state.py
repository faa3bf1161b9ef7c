"""The training state: parameters, BatchNorm statistics and optimiser state as one pytree.

``batch_stats`` is ``{}`` for a model without BatchNorm. The model and the optax transformation are not
in the state (they are static); the learning rate lives in the optimiser state
(``optax.inject_hyperparams``), so it can differ between seeds of one vmapped program.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp


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
