"""MNIST-1D (Greydanus 2020), generated offline and cached.

``load_mnist1d()`` calls the ``mnist1d`` package's ``make_dataset`` with its default arguments
(5,000 examples split 4,000 / 1,000, length 40, seed 42; the package standardises the whole set to mean
0 and standard deviation 1), never its download path, and caches the arrays as ``.npz`` under
``$RESJAX_CACHE`` (default ``~/.cache/resjax``). Generation takes a few seconds; later calls read the
cache. A cache file that cannot be read (truncated, overwritten, not an ``.npz`` of these arrays, or
holding a non-finite value) is reported with its path and the error (a ``RuntimeWarning``) and generated
again.

``check_finite(dataset)`` refuses a data set with a NaN or infinite value, naming the split and the first
bad example (``load_dataset`` and ``load_mnist1d`` call it, so nothing trains on such data).
"""

from __future__ import annotations

import os
import pathlib
import warnings

import numpy as np

from resjax.data.arrays import Dataset, check_finite

__all__ = ["cache_dir", "load_mnist1d"]  # Dataset and check_finite: resjax.data.arrays


def cache_dir() -> pathlib.Path:
    """Where generated data are cached: ``$RESJAX_CACHE``, else ``~/.cache/resjax``."""
    return pathlib.Path(os.environ.get("RESJAX_CACHE", pathlib.Path.home() / ".cache" / "resjax"))


def _read_cache(path: pathlib.Path) -> Dataset | None:
    """The cached data set, or None (with a warning naming the file and the error) when it cannot be read."""
    try:
        with np.load(path) as f:
            data = Dataset(*(np.asarray(f[k]) for k in Dataset._fields))
        shapes = [a.shape for a in data]
        if shapes != [(4000, 40), (4000,), (1000, 40), (1000,)]:  # the package's default arguments
            raise ValueError(f"arrays of shapes {shapes} are not the default MNIST-1D data set")
        dtypes = [a.dtype for a in data]
        if dtypes != [np.float32, np.int32, np.float32, np.int32]:
            raise ValueError(f"arrays of dtypes {[str(d) for d in dtypes]}, not float32 inputs and int32 labels")
        for name, y in (("y_train", data.y_train), ("y_test", data.y_test)):
            if y.min() < 0 or y.max() > 9:
                raise ValueError(f"{name} holds labels {int(y.min())} .. {int(y.max())}, not the classes 0 .. 9")
        return check_finite(data)  # generated data are finite: a NaN here is damage
    except Exception as err:  # noqa: BLE001 (zip, pickle, key and shape errors alike mean "rebuild it")
        warnings.warn(f"MNIST-1D cache {path} is unreadable ({type(err).__name__}: {err}); generating the data "
                      "again and rewriting it", RuntimeWarning, stacklevel=3)
        return None


def load_mnist1d(cache: bool = True) -> Dataset:
    """MNIST-1D with the ``mnist1d`` package's default arguments (see the module docstring).

    With ``cache`` it is read from ``cache_dir() / 'mnist1d_default.npz'`` when that file exists and is
    readable (else a ``RuntimeWarning`` naming the file, and the data are generated again), and written
    there after generating; ``cache=False`` always generates and writes nothing. Every value is checked
    finite (``check_finite``).
    """
    path = cache_dir() / "mnist1d_default.npz"
    if cache and path.exists():
        data = _read_cache(path)
        if data is not None:
            return data
    from mnist1d.data import get_dataset_args, make_dataset

    raw = make_dataset(get_dataset_args())
    data = Dataset(raw["x"].astype(np.float32), raw["y"].astype(np.int32),
                   raw["x_test"].astype(np.float32), raw["y_test"].astype(np.int32))
    if cache:
        _write_cache(path, data)
    return check_finite(data)


def _write_cache(path: pathlib.Path, data: Dataset) -> None:
    """Write the cache file atomically; a cache that cannot be written (a read-only or full disk, a path
    through a file) is a warning and leaves no temporary file: the data is generated again next time."""
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, **data._asdict())
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"mnist1d cache: could not write {path} ({err}); going on without it (the data is generated "
                      "again next time; RESJAX_CACHE chooses the folder)", stacklevel=3)
    finally:
        if tmp.exists():
            tmp.unlink()
