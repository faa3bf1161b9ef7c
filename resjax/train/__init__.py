"""Training: one core (``resjax.train.core``) and two feeders.

``make_train(config)`` (on-device: the whole run one ``lax.scan``, ``jax.jit(jax.vmap(trainer))(keys)`` over
seeds) and ``make_image_train(config, train_source, test_source)`` (host: batches from a data source) read
the same run config (``run_config``: ``model``, ``train`` = ``train_config()``, ``data``), build the same
optimiser, step the same ``RunState`` with the same ``train_step``, record the same metrics and write the
same checkpoints.
"""

from resjax.train.config import image_train_config, train_config
from resjax.train.core import METRICS, Core, run_config
from resjax.train.distributed import initialize_if_needed, make_data_mesh
from resjax.train.host import ImageTrainer, make_image_train, seed_axis_mode
from resjax.train.ondevice import Trainer, make_train, shard_over_seeds
from resjax.train.optim import make_optimizer
from resjax.train.schedules import make_schedule
from resjax.train.state import RunState, TrainState

__all__ = ["METRICS", "Core", "ImageTrainer", "RunState", "TrainState", "Trainer", "image_train_config",
           "initialize_if_needed", "make_data_mesh", "make_image_train", "make_optimizer", "make_schedule",
           "make_train", "run_config", "seed_axis_mode", "shard_over_seeds", "train_config"]
