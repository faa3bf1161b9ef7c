"""MNIST-1D (Greydanus 2020), generated offline and cached.

``load_mnist1d()`` calls the ``mnist1d`` package's ``make_dataset`` with its default arguments
(5,000 examples split 4,000 / 1,000, length 40, seed 42; the package standardises the whole set to mean
0 and standard deviation 1), never its download path, and caches the arrays as ``.npz`` under
``$RESJAX_CACHE`` (default ``~/.cache/resjax``). Generation takes a few seconds; later calls read the
cache.

``load_mnist1d(**args)`` passes the generator's other arguments (``GENERATOR_ARGS``: ``num_samples``,
``train_split``, ``final_seq_length``, ``iid_noise_scale``, ``corr_noise_scale``, ``shear_scale``, ``seed``, ...;
an unknown name raises ``ValueError`` naming it, and ``url`` is refused: nothing is downloaded). The cache is
keyed by them: the default arguments keep the file ``mnist1d_default.npz``, any other set of arguments a
file named by a hash of the full argument set (``cache_path``), so two sets never share a file.

``shuffle_length=True`` is the paper's shuffled variant ("spatial dimension shuffled"): one fixed
permutation of the ``final_seq_length`` positions (``length_permutation``: ``numpy.random.default_rng(
SHUFFLE_SEED).permutation(length)``, ``SHUFFLE_SEED = 0``), the same for every example of train and test, applied
to the generated (and cached) arrays, so the shuffled set is exactly a column permutation of the unshuffled
one. The package's own ``shuffle_seq`` draws its permutation from numpy's global state after generating (a
seed it does not state); resjax's has a stated seed and leaves the unshuffled examples as they are. (The
package standardises after its shuffle; a global mean and standard deviation do not change under a permutation
of positions, so the two orders give the same values.) A cache file that cannot be read (truncated, overwritten, not an ``.npz`` of these arrays, or
holding a non-finite value) is reported with its path and the error (a ``RuntimeWarning``) and generated
again.

``check_finite(dataset)`` refuses a data set with a NaN or infinite value, naming the split and the first
bad example (``load_dataset`` and ``load_mnist1d`` call it, so nothing trains on such data).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import warnings
from typing import Any

import numpy as np

from resjax.data.arrays import Dataset, check_finite

__all__ = ["GENERATOR_ARGS", "SHUFFLE_SEED", "cache_dir", "cache_path", "generator_args", "length_permutation",
           "load_mnist1d"]

#: The seed of the one permutation of positions that ``shuffle_length=True`` applies (``length_permutation``).
SHUFFLE_SEED = 0  # Dataset and check_finite: resjax.data.arrays


def cache_dir() -> pathlib.Path:
    """Where generated data are cached: ``$RESJAX_CACHE``, else ``~/.cache/resjax`` (``resjax.paths.cache_dir``)."""
    from resjax.paths import cache_dir as resjax_cache

    return resjax_cache()


def _defaults() -> dict[str, Any]:
    """The ``mnist1d`` generator's default arguments (``get_dataset_args``), without its download ``url``."""
    from mnist1d.data import get_dataset_args

    args = dict(get_dataset_args(as_dict=True))
    args.pop("url", None)
    return args


#: The generator arguments ``load_mnist1d`` passes on (``mnist1d.data.get_dataset_args``'s, without ``url``).
GENERATOR_ARGS = ("num_samples", "train_split", "template_len", "padding", "scale_coeff", "max_translation",
                  "corr_noise_scale", "iid_noise_scale", "shear_scale", "shuffle_seq", "final_seq_length", "seed")


def generator_args(**args: Any) -> dict[str, Any]:
    """The full argument set of the generator: its defaults with ``args`` in their place. An unknown name (or
    ``url``: nothing is downloaded) raises ``ValueError`` naming it."""
    defaults = _defaults()
    for name in args:
        if name not in defaults:
            raise ValueError(f"load_mnist1d: unknown argument {name!r}; the mnist1d generator's arguments: "
                             f"{tuple(sorted(defaults))}")
    full = {**defaults, **args}
    if not isinstance(full["num_samples"], int) or full["num_samples"] < 10:
        raise ValueError(f"num_samples: must be an integer >= 10 (one example per class), got {full['num_samples']!r}")
    if not 0 < full["train_split"] < 1:
        raise ValueError(f"train_split: must be in (0, 1), got {full['train_split']!r}")
    if not isinstance(full["final_seq_length"], int) or full["final_seq_length"] < 1:
        raise ValueError(f"final_seq_length: must be an integer >= 1, got {full['final_seq_length']!r}")
    return full


def _split_sizes(args: dict[str, Any]) -> tuple[int, int]:
    """(training, test) examples the generator makes for ``args``: ``num_samples // 10`` per class, split at
    ``int(total * train_split)``, as ``make_dataset`` does."""
    total = (args["num_samples"] // 10) * 10
    train = int(total * args["train_split"])
    return train, total - train


def cache_path(**args: Any) -> pathlib.Path:
    """The cache file of the data set that ``load_mnist1d(**args)`` generates (without ``shuffle_length``, which
    permutes the cached arrays): ``mnist1d_default.npz`` for the default arguments, else
    ``mnist1d_<hash>.npz``, the hash (SHA-256, 16 hex digits) of the full argument set as sorted JSON."""
    full = generator_args(**args)
    if full == _defaults():
        return cache_dir() / "mnist1d_default.npz"
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"mnist1d_{digest}.npz"


def length_permutation(length: int = 40) -> np.ndarray:
    """The permutation of the ``length`` positions that ``shuffle_length=True`` applies: ``numpy.random.
    default_rng(SHUFFLE_SEED).permutation(length)``; position ``i`` of a shuffled example is position
    ``perm[i]`` of the unshuffled one."""
    return np.random.default_rng(SHUFFLE_SEED).permutation(length)


def _read_cache(path: pathlib.Path, args: dict[str, Any] | None = None) -> Dataset | None:
    """The cached data set, or None (with a warning naming the file and the error) when it cannot be read."""
    try:
        args = _defaults() if args is None else args
        with np.load(path) as f:
            data = Dataset(*(np.asarray(f[k]) for k in Dataset._fields))
        shapes = [a.shape for a in data]
        (n_train, n_test), length = _split_sizes(args), args["final_seq_length"]
        if shapes != [(n_train, length), (n_train,), (n_test, length), (n_test,)]:
            raise ValueError(f"arrays of shapes {shapes} are not the MNIST-1D data set of these arguments")
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


def load_mnist1d(cache: bool = True, shuffle_length: bool = False, **args: Any) -> Dataset:
    """MNIST-1D made by the ``mnist1d`` package's generator with its default arguments, or with ``args`` in
    their place (see the module docstring; an unknown argument raises ``ValueError`` naming it).

    With ``cache`` it is read from ``cache_path(**args)`` (``cache_dir() / 'mnist1d_default.npz'`` for the
    default arguments) when that file exists and is readable (else a ``RuntimeWarning`` naming the file, and
    the data are generated again), and written there after generating; ``cache=False`` always generates and
    writes nothing. ``shuffle_length=True``: every example of train and test with its positions permuted by the
    one permutation ``length_permutation(final_seq_length)`` (seed ``SHUFFLE_SEED``). Every value is checked
    finite (``check_finite``).
    """
    if not isinstance(shuffle_length, bool):
        raise ValueError(f"shuffle_length: must be True or False, got {shuffle_length!r}")
    full = generator_args(**args)
    path = cache_path(**args)
    data = _read_cache(path, full) if cache and path.exists() else None
    if data is None:
        from mnist1d.data import make_dataset
        from mnist1d.utils import ObjectView

        raw = make_dataset(ObjectView(dict(full)))
        data = Dataset(raw["x"].astype(np.float32), raw["y"].astype(np.int32),
                       raw["x_test"].astype(np.float32), raw["y_test"].astype(np.int32))
        if cache:
            _write_cache(path, data)
        data = check_finite(data)
    if shuffle_length:
        perm = length_permutation(full["final_seq_length"])
        data = data._replace(x_train=np.ascontiguousarray(data.x_train[:, perm]),
                             x_test=np.ascontiguousarray(data.x_test[:, perm]))
    return data


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
