"""Training: ``make_train(config)`` builds a pure, jittable, vmappable ``train(key, hparams)``;
``make_image_train(config, model, source)`` trains image models fed by a host data loader."""

from resjax.train.distributed import initialize_if_needed, make_data_mesh
from resjax.train.image import ImageState, ImageTrainer, image_train_config, make_image_train
from resjax.train.loop import METRICS, Carry, Trainer, default_config, make_train, shard_over_seeds
from resjax.train.optim import make_optimizer
from resjax.train.schedules import make_schedule
from resjax.train.state import TrainState

__all__ = ["METRICS", "Carry", "ImageState", "ImageTrainer", "TrainState", "Trainer", "default_config",
           "image_train_config", "initialize_if_needed", "make_data_mesh", "make_image_train", "make_optimizer",
           "make_schedule", "make_train", "shard_over_seeds"]
