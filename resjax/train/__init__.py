"""Training: ``make_train(config)`` builds a pure, jittable, vmappable ``train(key, hparams)``."""

from resjax.train.loop import METRICS, Carry, Trainer, default_config, make_train, shard_over_seeds
from resjax.train.state import TrainState

__all__ = ["METRICS", "Carry", "TrainState", "Trainer", "default_config", "make_train", "shard_over_seeds"]
