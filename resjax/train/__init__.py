"""Training: one core (``resjax.train.core``) and two feeders.

``make_train(config)`` (on-device: the whole run one ``lax.scan``, ``jax.jit(jax.vmap(trainer))(keys)`` over
seeds) and ``make_image_train(config, train_source, test_source)`` (host: batches from a data source) read
the same run config (``run_config``: ``model``, ``train`` = ``train_config()``, ``data``), build the same
optimiser, step the same ``RunState`` with the same ``train_step``, record the same metrics and write the
same checkpoints.

Exported here: the feeders and their builders (``Trainer``, ``make_train``, ``shard_over_seeds``;
``ImageTrainer``, ``make_image_train``, ``seed_axis_mode``), the configs (``run_config``, ``train_config``,
``image_train_config``, ``check_train_config``), the state (``RunState``, ``ModelState``: formerly
``TrainState``, a name that still imports, with a ``DeprecationWarning``), the core
(``Core``, ``METRICS``), grids of runs (``grid``, ``fit_grid``, ``Grid``, ``GridResult``: seeds x hyperparameters,
labelled results), the optimiser and schedule builders, run logs (``RunLog``, ``log_to``: ``metrics.jsonl`` and
TensorBoard as training goes), independent sweeps one per device (``side_by_side``), checkpoints (``Checkpoints``,
``CheckpointError``), the stop-signal exit (``Preempted``) and data parallelism (``make_data_mesh``,
``initialize_if_needed``). Everything else stays in its submodule (``resjax.train.checkpoint.save`` ...),
each of which lists its public names in ``__all__``.
"""

from __future__ import annotations

from resjax.train.checkpoint import CheckpointError, Checkpoints
from resjax.train.config import check_train_config, image_train_config, train_config
from resjax.train.core import METRICS, Core, run_config
from resjax.train.distributed import initialize_if_needed, make_data_mesh
from resjax.train.grid import Grid, GridResult, fit_grid, zipped
# ``resjax.train.grid`` is the module, callable as its function ``grid(...)``: a function of the same name would
# shadow the module (``resjax.train.grid.fit_grid`` an AttributeError, ``help`` the function's docstring only)
from resjax.train import grid  # noqa: E402  (the module, callable)
from resjax.train.host import ImageTrainer, make_image_train, seed_axis_mode
from resjax.train.monitor import RunLog, log_to
from resjax.train.ondevice import Trainer, make_train, shard_over_seeds
from resjax.train.optim import make_optimizer
from resjax.train.preemption import Preempted
from resjax.train.schedules import make_schedule
from resjax.train.side_by_side import side_by_side
from resjax.train.state import ModelState, RunState
from resjax.train.state import deprecated_name as _deprecated_name

__all__ = ["METRICS", "CheckpointError", "Checkpoints", "Core", "Grid", "GridResult", "ImageTrainer", "ModelState",
           "Preempted", "RunLog", "RunState", "Trainer", "check_train_config", "fit_grid", "grid", "image_train_config",
           "initialize_if_needed", "log_to", "make_data_mesh",
           "make_image_train", "make_optimizer", "make_schedule", "make_train", "run_config", "seed_axis_mode",
           "shard_over_seeds", "side_by_side", "train_config", "zipped"]


def __getattr__(name: str):  # the old ``TrainState``: the same class as ``ModelState``, with a DeprecationWarning
    return _deprecated_name(__name__, name)
