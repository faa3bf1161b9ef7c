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
* targets ``y_*``, as many as the split's inputs, either class labels: ``[N]`` integers in
  ``0 .. num_classes - 1``, every test label a class of the training split (the checks of ``check_labels``,
  shared with ``Dataset``), where labels that do not start at 0 or skip a class get a warning naming the classes
  (the model still has ``num_classes`` outputs, some never trained on); or floating targets of any shape
  ``[N, ...]`` (regression values, soft labels), every value finite, the same per-example shape in both splits,
  for an objective of your own or the built-in ``'mse'`` (``resjax.train.objective``). A bool array is refused.
* ``num_classes``: given (at least one more than the largest label) or inferred (the largest label of either
  split, plus one); for floating targets, the model's output width: ``K`` of ``[N, K]`` targets (1 for ``[N]``).
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
import warnings
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
    y_train: np.ndarray  # (N,) int32 (or floating targets [N, ...] for an objective of one's own)
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        """One more than the largest label in either split; for floating targets, the model's output width
        (``K`` of ``[N, K]`` targets, 1 for ``[N]``)."""
        if np.asarray(self.y_train).dtype.kind == "f":
            return _width(np.asarray(self.y_train))
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
    _class_checks(yt, ye, name, num_classes, "the model's ", warn=False)
    return data


def _class_checks(yt: np.ndarray, ye: np.ndarray, name: str, num_classes: int | None, whose: str,
                  warn: bool) -> None:
    """The class-label checks ``check_labels`` (``Dataset``, the trainers) and ``from_arrays`` share: a training
    split of at least one example; no test label above the training split's largest (``ValueError``); every label
    below ``num_classes``; with ``warn`` (``from_arrays``), a warning naming the classes when the labels do not start
    at 0 or skip one, and one naming the test classes the training split skips."""
    if len(yt) == 0:
        raise ValueError(f"{name}.y_train: empty; want at least one training example")
    if num_classes is not None and not (int(yt.max()) < num_classes and (not len(ye) or int(ye.max()) < num_classes)):
        split, y = ("y_train", yt) if int(yt.max()) >= num_classes else ("y_test", ye)
        i = int(np.argmax(y >= num_classes))
        raise ValueError(f"{name}.{split}: example {i} has label {int(y[i])}, outside {whose}0 .. "
                         f"{num_classes - 1} (num_classes={num_classes})")
    classes = int(yt.max()) + 1
    if len(ye) and (ye >= classes).any():
        i = int(np.argmax(ye >= classes))
        raise ValueError(f"{name}.y_test: example {i} has label {int(ye[i])}, a class the training split never has "
                         f"(its labels are 0 .. {classes - 1})")
    if warn:
        seen = set(np.unique(yt).tolist())
        unseen_test = sorted(set(np.unique(ye).tolist()) - seen)
        if unseen_test:
            warnings.warn(f"{name}.y_test: the classes {_ranges(unseen_test)} never occur in {name}.y_train; the "
                          "model never trains on them", stacklevel=3)
        present = sorted(seen | set(np.unique(ye).tolist()))
        missing = sorted(set(range(max(present) + 1)) - set(present))
        if present[0] != 0 or missing:
            warnings.warn(f"{name}.y_train, y_test: the labels are the classes {_ranges(present)}, which "
                          f"{'do not start at 0' if present[0] else 'skip ' + _ranges(missing)}; the model gets "
                          f"{num_classes} outputs, {num_classes - len(present)} of them for classes that never "
                          "occur (map the labels to 0 .. K-1, e.g. np.unique(y, return_inverse=True))", stacklevel=3)


def _ranges(values: list) -> str:
    """``[0, 1, 2, 5]`` as ``'0..2, 5'``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}..{v}")
            start = None
    return ", ".join(out)


def _width(y: np.ndarray) -> int:
    """The output width floating targets ask of a model: ``K`` of ``[N, K]``, the product of the rest, 1 for [N]."""
    return int(np.prod(y.shape[1:])) if y.ndim > 1 else 1


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


def _targets(name: str, y: Any, n: int, inputs: str) -> np.ndarray:
    """Class labels (``_labels``) or floating targets ``[N, ...]``, finite, one per example of ``inputs``."""
    y = np.asarray(y)
    if y.dtype.kind != "f":
        return _labels(name, y, n, inputs)
    if y.ndim == 0 or len(y) != n:
        raise ValueError(f"{name}: {len(y) if y.ndim else 0} targets for the {n} examples of {inputs}")
    bad = _first_nonfinite(y)
    if bad is not None:
        raise ValueError(f"{name}: example {bad[0]} has a non-finite target ({bad[1]}); refusing to train on it")
    return y


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
    yt = _targets("y_train", y_train, len(xt), "x_train")
    if x_test is None:
        xe, ye = xt, yt
    else:
        xe = _inputs("x_test", x_test)
        ye = _targets("y_test", y_test, len(xe), "x_test")
        if (ye.dtype.kind == "f") != (yt.dtype.kind == "f") or ye.shape[1:] != yt.shape[1:]:
            raise ValueError(f"y_test: targets {ye.dtype}{list(ye.shape[1:])} per example, but y_train's are "
                             f"{yt.dtype}{list(yt.shape[1:])}; both splits need the same kind and shape")
        if xe.shape[1:] != xt.shape[1:]:
            raise ValueError(f"x_test: examples of shape {xe.shape[1:]}, but x_train's are {xt.shape[1:]}")
        if (xe.dtype == np.uint8) != (xt.dtype == np.uint8):
            raise ValueError(f"x_test: dtype {xe.dtype} but x_train is {xt.dtype}; both uint8 or both floating "
                             "(uint8 inputs are divided by 255)")
    if augment != "none" and xt.ndim != 4:
        raise ValueError(f"augment: {augment!r} needs images [N, H, W, C]; x_train holds vectors {xt.shape}")
    if num_classes is not None and (not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool)
                                    or num_classes < 1):
        raise ValueError(f"num_classes: want a positive integer, got {num_classes!r}")
    if yt.dtype.kind == "f":  # regression values or soft labels: the output width
        if num_classes is not None and num_classes != _width(yt):
            raise ValueError(f"num_classes: {num_classes}, but the floating targets y_train ask for {_width(yt)} "
                             f"outputs (shape {yt.shape})")
        num_classes = _width(yt)
    else:
        if num_classes is None:
            num_classes = int(max(yt.max(), ye.max())) + 1
        _class_checks(yt, ye, "data", int(num_classes), "", warn=True)

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
    kind = np.float32 if yt.dtype.kind == "f" else np.int32
    return ArrayData(xt_n, yt.astype(kind), xe_n, ye.astype(kind), int(num_classes), mean, std,
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
        """The normalised float32 examples and their targets (int32 labels, or float32 targets) at ``indices``."""
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
