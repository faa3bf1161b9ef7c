"""Data held in numpy arrays: the generic container of both feeders, and a user's own arrays.

``Dataset`` (``x_train, y_train, x_test, y_test``) is what the on-device feeder trains on; MNIST-1D is one.
``from_arrays`` is the way in for one's own arrays, checked once, when the data object is built::

    data = from_arrays(x_train, y_train, x_test, y_test)           # images [N, H, W, C] or vectors [N, D]
    make_train(config, data)                                        # on-device feeder (whole run one program)
    make_image_train(config, data)                                  # host feeder (batches; augmentation)

What it accepts and checks (a ``ValueError`` naming the array, and the first bad example where there is one):

* inputs ``x_*``: ``[N, D]`` feature vectors or ``[N, H, W, C]`` images of any size, ``uint8`` or floating,
  every value finite; ``N >= 1``; the test split has the training split's example shape and kind
  (``uint8`` or float).
* labels ``y_*``: ``[N]`` integers (a float or bool array is refused, also when its values are whole) in
  ``0 .. num_classes - 1``; as many as the split's inputs.
* ``num_classes``: given (at least one more than the largest label) or inferred (the largest label of either
  split, plus one).
* normalisation: ``uint8`` inputs are divided by 255 first (as the TFDS sources do). Then
  ``(x - mean) / std``, with ``mean`` and ``std`` given (a number, or one per channel for images, one per
  feature for vectors) or, by default, computed from the training split: per channel over every training
  pixel for images, per feature for vectors (a feature constant over the training split gets std 1, as in
  scikit-learn's ``StandardScaler``). ``mean=0, std=1`` leaves the inputs as they are. The result is float32.
* ``augment`` (host feeder only; images only): ``'none'``, ``'flip'`` (left-right with probability 1/2) or
  ``'crop_flip'`` (a random ``H x W`` window of the image zero-padded by ``padding`` pixels, then the flip:
  the CIFAR recipe; the padding is 0 after normalisation, i.e. the training mean). The draws are those of
  the TFDS sources: a pure function of ``(seed, epoch, batch)``, so runs resume exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from resjax.data.source import BatchSource

__all__ = ["AUGMENTATIONS", "ArrayData", "ArraySource", "Dataset", "check_finite", "check_labels", "from_arrays"]

#: The augmentations ``from_arrays`` knows (by name).
AUGMENTATIONS = ("none", "flip", "crop_flip")


class Dataset(NamedTuple):
    """A classification data set held in numpy arrays (what the on-device feeder trains on).

    Attributes:
        x_train: ``(N, ...)`` float32 training inputs (MNIST-1D: ``(4000, 40)``).
        y_train: ``(N,)`` int32 training labels.
        x_test: ``(M, ...)`` float32 test inputs (MNIST-1D: ``(1000, 40)``).
        y_test: ``(M,)`` int32 test labels.
    """

    x_train: np.ndarray  # (N, length) float32
    y_train: np.ndarray  # (N,) int32
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        """One more than the largest label in either split."""
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def _first_nonfinite(x: np.ndarray) -> tuple[int, Any] | None:
    """``(example index, value)`` of the first example of ``x`` holding a NaN or infinite value, or None."""
    if not np.issubdtype(x.dtype, np.floating):
        return None
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1) if x.ndim else ~np.isfinite(x)[None]
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    row = np.asarray(x[i]).reshape(-1)
    return i, row[~np.isfinite(row)][0]


def check_finite(data: Any, name: str = "data") -> Any:
    """``data`` itself if every value of ``x_train`` and ``x_test`` is finite; else ``ValueError`` naming the
    split and the first bad example, e.g. ``data.x_train: example 17 has a non-finite value (nan); refusing
    to train on it``."""
    for split in ("x_train", "x_test"):
        bad = _first_nonfinite(np.asarray(getattr(data, split)))
        if bad is not None:
            raise ValueError(f"{name}.{split}: example {bad[0]} has a non-finite value ({bad[1]}); refusing to "
                             "train on it")
    return data


def check_labels(data: Any, num_classes: int | None = None, name: str = "data") -> Any:
    """``data`` itself (a ``Dataset`` or anything with its four arrays) if its labels are ``[N]`` integers
    >= 0, one per example, and every test label is a class of the training split (and, given the model's
    ``num_classes``, below it); else ``ValueError`` naming the array and the first bad example. Without this a
    label 1000 in the test split silently builds a 1001-class model, and -1 trains with a finite loss."""
    yt = _labels(f"{name}.y_train", data.y_train, len(data.x_train), f"{name}.x_train")
    ye = _labels(f"{name}.y_test", data.y_test, len(data.x_test), f"{name}.x_test")
    if len(yt) == 0:
        raise ValueError(f"{name}.y_train: empty; want at least one training example")
    classes = int(data.num_classes) if isinstance(data, ArrayData) else int(yt.max()) + 1  # ArrayData: declared
    if len(ye) and (ye >= classes).any():
        i = int(np.argmax(ye >= classes))
        raise ValueError(f"{name}.y_test: example {i} has label {int(ye[i])}, a class the training split never has "
                         f"(its labels are 0 .. {classes - 1})")
    if num_classes is not None and not (int(yt.max()) < num_classes and (not len(ye) or int(ye.max()) < num_classes)):
        split, y = ("y_train", yt) if int(yt.max()) >= num_classes else ("y_test", ye)
        i = int(np.argmax(y >= num_classes))
        raise ValueError(f"{name}.{split}: example {i} has label {int(y[i])}, outside the model's 0 .. "
                         f"{num_classes - 1} (num_classes={num_classes})")
    return data


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayData:
    """A user's arrays, checked and normalised (build it with :func:`from_arrays`).

    ``x_train``/``x_test`` are float32 and normalised, ``y_train``/``y_test`` int32; ``example_shape`` is
    ``(D,)`` or ``(H, W, C)``; ``mean``/``std`` are the statistics applied (after the 1/255 of ``uint8``
    inputs), one per channel or feature. Both feeders take it: ``make_train(config, data)`` (as a
    :class:`Dataset`: the on-device feeder does not augment) and ``make_image_train(config, data)`` (through
    ``source('train')`` and ``source('test')``)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: np.ndarray
    std: np.ndarray
    augment: str = "none"
    padding: int = 4
    name: str = "arrays"

    @property
    def example_shape(self) -> tuple[int, ...]:
        """The shape of one example: ``(D,)`` or ``(H, W, C)``."""
        return tuple(self.x_train.shape[1:])

    def source(self, split: str = "train") -> ArraySource:
        """A host data source of split ``'train'`` or ``'test'`` (the interface of ``ImageSource``)."""
        if split not in ("train", "test"):
            raise ValueError(f"split: want 'train' or 'test', got {split!r}")
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_test, self.y_test)
        return ArraySource(self, split, x, y)

    def __repr__(self) -> str:
        return (f"ArrayData({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"example_shape={self.example_shape}, num_classes={self.num_classes}, augment={self.augment!r})")


def _inputs(name: str, x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name}: want uint8 or floating inputs, got dtype {x.dtype}")
    if x.ndim not in (2, 4):
        raise ValueError(f"{name}: want [N, D] feature vectors or [N, H, W, C] images, got shape {x.shape} "
                         f"(rank {x.ndim}){'; add a channel axis: x[..., None]' if x.ndim == 3 else ''}")
    if len(x) == 0 or 0 in x.shape[1:]:
        raise ValueError(f"{name}: empty (shape {x.shape}); want at least one example of at least one value")
    bad = _first_nonfinite(x)
    if bad is not None:
        raise ValueError(f"{name}: example {bad[0]} has a non-finite value ({bad[1]}); refusing to train on it")
    return x


def _labels(name: str, y: Any, n: int, inputs: str) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{name}: want integer class labels, got dtype {y.dtype}"
                         f"{' (convert whole-valued floats with .astype(int))' if y.dtype.kind == 'f' else ''}")
    if y.ndim != 1:
        raise ValueError(f"{name}: want [N] labels, got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name}: {len(y)} labels for the {n} examples of {inputs}")
    if (y < 0).any():
        i = int(np.argmax(y < 0))
        raise ValueError(f"{name}: example {i} has label {int(y[i])}; labels must be 0 .. num_classes - 1")
    return y


def _statistic(setting: str, value: Any, channels: int) -> np.ndarray:
    v = np.asarray(value, np.float64)
    if v.ndim > 1 or v.size not in (1, channels):
        raise ValueError(f"{setting}: want a number or {channels} values (one per channel or feature), got shape "
                         f"{v.shape}")
    v = np.broadcast_to(v.reshape(-1), (channels,)).copy()
    if not np.isfinite(v).all() or (setting == "std" and (v <= 0).any()):
        raise ValueError(f"{setting}: must be finite{' and > 0' if setting == 'std' else ''}, got {value!r}")
    return v


def from_arrays(x_train: Any, y_train: Any, x_test: Any = None, y_test: Any = None, *, num_classes: int | None = None,
                mean: float | Sequence[float] | None = None, std: float | Sequence[float] | None = None,
                augment: str = "none", padding: int = 4, name: str = "arrays") -> ArrayData:
    """Your own arrays as a data set for either feeder (see the module docstring for what is accepted).

    ``x_test``/``y_test``: the evaluation split (both or neither; without them the test metrics of a run are
    those of the training split). Everything is checked here, before any training: a ``ValueError`` names the
    array (``x_train``, ``y_test``, ...) or setting and, for a bad value, the first example holding it.
    """
    if (x_test is None) != (y_test is None):
        raise ValueError("x_test, y_test: give both or neither")
    if augment not in AUGMENTATIONS:
        raise ValueError(f"augment: unknown augmentation {augment!r}; choose one of {AUGMENTATIONS}")
    if not isinstance(padding, (int, np.integer)) or padding < 0:
        raise ValueError(f"padding: want a non-negative integer, got {padding!r}")
    xt = _inputs("x_train", x_train)
    yt = _labels("y_train", y_train, len(xt), "x_train")
    if x_test is None:
        xe, ye = xt, yt
    else:
        xe = _inputs("x_test", x_test)
        ye = _labels("y_test", y_test, len(xe), "x_test")
        if xe.shape[1:] != xt.shape[1:]:
            raise ValueError(f"x_test: examples of shape {xe.shape[1:]}, but x_train's are {xt.shape[1:]}")
        if (xe.dtype == np.uint8) != (xt.dtype == np.uint8):
            raise ValueError(f"x_test: dtype {xe.dtype} but x_train is {xt.dtype}; both uint8 or both floating "
                             "(uint8 inputs are divided by 255)")
    if augment != "none" and xt.ndim != 4:
        raise ValueError(f"augment: {augment!r} needs images [N, H, W, C]; x_train holds vectors {xt.shape}")
    largest = int(max(yt.max(), ye.max()))
    if num_classes is None:
        num_classes = largest + 1
    elif not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"num_classes: want a positive integer, got {num_classes!r}")
    for label_name, y in (("y_train", yt), ("y_test", ye)):
        if (y >= num_classes).any():
            i = int(np.argmax(y >= num_classes))
            raise ValueError(f"{label_name}: example {i} has label {int(y[i])}, outside 0 .. {num_classes - 1} "
                             f"(num_classes={num_classes})")

    scale = np.float64(255.0) if xt.dtype == np.uint8 else np.float64(1.0)
    channels = xt.shape[-1]
    axes = tuple(range(xt.ndim - 1))  # every axis but the channel (feature) axis
    if mean is None:  # accumulated in float64 without a float64 copy of the inputs
        mean = np.mean(xt, axis=axes, dtype=np.float64) / scale
    if std is None:
        std = np.std(xt, axis=axes, dtype=np.float64) / scale
        std = np.where(std > 0, std, 1.0)
    mean, std = _statistic("mean", mean, channels), _statistic("std", std, channels)

    def normalised(x: np.ndarray) -> np.ndarray:  # in float32: one float32 copy of the inputs
        with np.errstate(over="ignore"):  # an overflow is reported below, naming the example
            return (x.astype(np.float32) / np.float32(scale) - mean.astype(np.float32)) / std.astype(np.float32)

    xt_n = normalised(xt)
    xe_n = xt_n if x_test is None else normalised(xe)
    for array_name, x in (("x_train", xt_n), ("x_test", xe_n)):  # a tiny std can overflow float32
        bad = _first_nonfinite(x)
        if bad is not None:
            raise ValueError(f"{array_name}: example {bad[0]} is not finite after normalisation ({bad[1]}); check "
                             "mean and std")
    return ArrayData(xt_n, yt.astype(np.int32), xe_n, ye.astype(np.int32), int(num_classes), mean, std,
                     augment, int(padding), str(name))


class ArraySource(BatchSource):
    """One split of an :class:`ArrayData` as a host data source: the interface of ``ImageSource`` (``epoch``,
    ``stacked_epoch``, ``num_batches``, ``order``, ``read``; ``num_examples``, ``num_classes``,
    ``image_shape``), with the same pure ``(seed, epoch, batch)`` order and augmentation draws."""

    def __init__(self, data: ArrayData, split: str, x: np.ndarray, y: np.ndarray) -> None:
        self.data, self.name, self.split = data, data.name, split
        self.num_examples = len(y)
        self.num_classes = data.num_classes
        self.image_shape = tuple(x.shape[1:])
        self._x, self._y = x, y

    def __repr__(self) -> str:
        return (f"ArraySource({self.name!r}, split={self.split!r}, num_examples={self.num_examples}, "
                f"image_shape={self.image_shape}, num_classes={self.num_classes})")

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The normalised float32 examples and int32 labels at ``indices``."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        return self._x[indices], self._y[indices]

    def preprocess(self, images: np.ndarray, rng: np.random.Generator | None, augment: bool,
                   rows: slice | None = None, batch_length: int | None = None) -> np.ndarray:
        """The normalised examples, augmented when ``augment`` (by ``data.augment``; see the module docstring)."""
        from resjax.data.tfds import random_crop_flip

        batch = np.asarray(images)
        kind = self.data.augment if augment else "none"
        if kind == "crop_flip":
            return random_crop_flip(batch, rng, self.data.padding, batch_length=batch_length, rows=rows)
        if kind == "flip":
            rows = slice(0, len(batch)) if rows is None else rows
            flip = (rng.random(len(batch) if batch_length is None else batch_length) < 0.5)[rows]
            return np.where(flip[:, None, None, None], batch[:, :, ::-1], batch)
        return batch

    def check_finite(self, batch: np.ndarray, indices: Any, epoch: int, batch_index: int) -> None:
        """Nothing to do: the arrays were checked when the data object was built."""
