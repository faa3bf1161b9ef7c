"""MNIST-1D (Greydanus 2020), generated offline and cached.

``load_mnist1d()`` calls the ``mnist1d`` package's ``make_dataset`` with its default arguments
(5,000 examples split 4,000 / 1,000, length 40, seed 42; the package standardises the whole set to mean
0 and standard deviation 1), never its download path, and caches the arrays as ``.npz`` under
``$RESJAX_CACHE`` (default ``~/.cache/resjax``). Generation takes a few seconds; later calls read the
cache.
"""

from __future__ import annotations

import os
import pathlib
from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
    x_train: np.ndarray  # (N, length) float32
    y_train: np.ndarray  # (N,) int32
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("RESJAX_CACHE", pathlib.Path.home() / ".cache" / "resjax"))


def load_mnist1d(cache: bool = True) -> Dataset:
    path = cache_dir() / "mnist1d_default.npz"
    if cache and path.exists():
        with np.load(path) as f:
            return Dataset(*(f[k] for k in Dataset._fields))
    from mnist1d.data import get_dataset_args, make_dataset

    raw = make_dataset(get_dataset_args())
    data = Dataset(raw["x"].astype(np.float32), raw["y"].astype(np.int32),
                   raw["x_test"].astype(np.float32), raw["y_test"].astype(np.int32))
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **data._asdict())
        os.replace(tmp, path)
    return data
