"""Shared plumbing of the image-training experiments (``cifar_tau``, ``taki_cifar``): data sources, one
seed-vmapped training cell with checkpoints, and the 'data not prepared' stand-in.

Data. ``config.data`` is ``'real'`` (the TFDS data set named by each cell, read with
``resjax.data.load_image_dataset``; ``config.data_dir`` or ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``)
or ``'synthetic'`` (``resjax.data.synthetic_image_dataset`` of the same shape and classes, ``config.synthetic_examples``
training and a quarter as many test examples, the same class prototypes in both splits; the ``--quick`` runs and tests). ``missing_data(module,
config)`` returns the preparation message of the first data set that is not on disk (``None`` when all
are); ``experiments.reproduce`` then runs the experiment's ``--quick`` version on the synthetic stand-in and
marks its claims "not measured".

Cells. ``train_cell`` trains ``len(seeds)`` copies of one model together (``ImageTrainer.fit`` with a list
of seeds: one vmapped step on accelerators, the single-seed step per seed on the CPU), data-parallel over
every device when the batch size divides their number, checkpointing into
``<checkpoint_dir>/<cell>-<hash of its settings>`` (``--checkpoint_dir``, default ``<out>/checkpoints``; see
``experiments.checkpoints``): a full run that is stopped resumes where it stopped, bit for bit, and a run with
changed settings never meets an old checkpoint. It returns the history (a leading seed axis) and the wall time.
"""

from __future__ import annotations

import hashlib
import pathlib
import time

import jax
import numpy as np

from experiments import checkpoints
from resjax.data import DataNotPreparedError, load_image_dataset, synthetic_image_dataset
from resjax.data.tfds import prepared_num_examples
from resjax.train import make_data_mesh, make_image_train, planning, run_config

DATA_MODES = ("real", "synthetic")
STAND_IN = "stand_in"  # metrics key set when a run used the synthetic stand-in instead of the named data


def check_cells(config, datasets, train_configs=()) -> None:
    """Preflight of an image experiment (``experiments.common.preflight``): the data and scan modes, and for
    every data set the train configs (``config.train`` and ``train_configs``; the library's checks) with their
    batch size within its training examples (``synthetic_examples``, or the prepared split's size read from
    its ``dataset_info.json``: a data set that is not prepared raises ``DataNotPreparedError`` here)."""
    from experiments import common

    check_data_mode(config)
    if config.scan not in SCAN_MODES:
        raise ValueError(f"scan: unknown value {config.scan!r}; choose one of {SCAN_MODES}")
    for dataset in datasets:
        with common.setting_prefix("dataset"):
            if config.data == "synthetic":
                n = config.synthetic_examples
            else:
                n = prepared_num_examples(dataset, "train", data_dir=config.get("data_dir") or None)
        for train in (config.train, *train_configs):
            common.check_train(train, n)


def check_data_mode(config) -> None:
    if config.data not in DATA_MODES:
        raise ValueError(f"data: unknown value {config.data!r}; choose one of {DATA_MODES}")


def sources(dataset: str, config):
    """(train, test) sources of ``dataset`` under ``config.data``."""
    check_data_mode(config)
    if config.data == "synthetic":
        n = config.synthetic_examples
        return (synthetic_image_dataset(dataset, n, seed=0, split="train"),
                synthetic_image_dataset(dataset, max(n // 4, 1), seed=0, split="test"))
    data_dir = config.get("data_dir") or None
    return (load_image_dataset(dataset, "train", data_dir=data_dir),
            load_image_dataset(dataset, "test", data_dir=data_dir))


def missing_data(module, config) -> str | None:
    """The preparation message for the first data set ``module`` needs under ``config`` that is not on disk."""
    if config.get("data") != "real":
        return None
    for name in module.required_data(config):
        try:
            load_image_dataset(name, "train", data_dir=config.get("data_dir") or None)
        except DataNotPreparedError as err:
            return str(err)
    return None


SCAN_MODES = ("auto", "yes", "no")


def use_scan(config) -> bool:
    """``config.scan``: 'yes' / 'no', or 'auto' = ``nn.scan`` over the blocks on accelerators and unrolled
    blocks on the CPU. On XLA:CPU (jaxlib 0.10.2) the backward pass of a convolution inside a scan is about
    30x slower than unrolled (``benchmarks.resnet`` measures it; a 6-conv ``lax.scan`` gradient took 4.7 s
    against 0.15 s unrolled), while on accelerators scanning keeps deep networks' compile time flat."""
    if config.scan not in SCAN_MODES:
        raise ValueError(f"scan: unknown value {config.scan!r}; choose one of {SCAN_MODES}")
    if config.scan == "auto":
        return planning.backend() != "cpu"  # a TPU plan (benchmarks.tpu_plan) builds what the chip runs
    return config.scan == "yes"


def data_mesh(batch_size: int):
    """A data-parallel mesh over every device (of every host), or None on one device or when the batch does
    not split evenly over them."""
    n = jax.device_count()
    return make_data_mesh() if n > 1 and batch_size % n == 0 else None


def train_cell(model, train_config, train, test, seeds, out_dir: pathlib.Path, cell: str) -> tuple[dict, float]:
    """Train ``model`` from each of ``seeds`` (one vmapped program); returns ``(history, seconds)``."""
    start = time.time()
    trainer = make_image_train(run_config(train=train_config), train, test, model=model,
                               mesh=data_mesh(train_config.batch_size))
    name = checkpoint_name(cell, model, train_config, train, seeds)
    if checkpoints.current() is None:  # run() called directly: out_dir/checkpoints, as always
        directory = out_dir / checkpoints.DEFAULT_FOLDER / name
    else:  # run_experiment's --checkpoint_dir (or none), --fresh, messages
        directory = checkpoints.fit_dir(cell, name, trainer)
    _, history = trainer.fit(list(seeds), checkpoint_dir=directory, progress=cell)
    checkpoints.cell_done()
    return history, time.time() - start


def checkpoint_name(cell: str, model, train_config, train, seeds) -> str:
    """``<cell>-<hash>``: the hash covers the model, the training config, the data and the seeds, so a
    rerun with the same settings resumes its checkpoints and a changed setting starts afresh."""
    text = repr((model, sorted(train_config.to_dict().items()), train.name, train.split, train.num_examples,
                 list(seeds)))
    return f"{cell}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def error_pct(error) -> list:
    """Error (fraction) to percent, per seed; NaN (diverged) stays NaN."""
    return (100.0 * np.asarray(error, np.float64)).tolist()


def not_measured(metrics: dict) -> bool:
    return bool(metrics.get(STAND_IN))
