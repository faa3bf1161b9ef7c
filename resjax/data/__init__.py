"""Data sets: your own arrays (:mod:`resjax.data.arrays`, ``from_arrays``: for either feeder, checked when
built); MNIST-1D generated offline (the default everywhere it can serve); MNIST, CIFAR-10/100 and ImageNet
through ``tfds.data_source`` (:mod:`resjax.data.tfds`), with a synthetic stand-in.

Exported here: ``from_arrays``, ``ArrayData``, ``ArraySource``, ``Dataset``, ``check_finite``, ``check_labels``;
``load_dataset`` (by name, ``DATASETS``), ``load_mnist1d``;
``load_image_dataset``, ``synthetic_image_dataset``, ``ImageSource``, ``ImageSpec``, ``IMAGE_DATASETS``,
``DataNotPreparedError``, ``prepared_num_examples`` and ``tfds_data_dir``. The image transforms
(``normalise``, ``random_crop_flip``, ...) stay in :mod:`resjax.data.tfds`. Importing this package does not
import TensorFlow Datasets: ``load_image_dataset`` does, once the data are known to exist.
"""

from __future__ import annotations

from resjax.data.arrays import ArrayData, ArraySource, Dataset, check_finite, check_labels, from_arrays
from resjax.data.mnist1d import load_mnist1d
from resjax.data.tfds import (IMAGE_DATASETS, DataNotPreparedError, ImageSource, ImageSpec, load_image_dataset,
                              prepared_num_examples, synthetic_image_dataset, tfds_data_dir)

#: The data set names ``load_dataset`` knows.
DATASETS = ("mnist1d", "mnist1d_shuffled")


def load_dataset(name: str) -> Dataset:
    """A data set by name, as numpy arrays; every value finite (``check_finite``: a NaN or infinite value is
    refused, naming the split and the first bad example). ``'mnist1d_shuffled'``: MNIST-1D with its positions
    permuted, ``load_mnist1d(shuffle_length=True)``."""
    if name == "mnist1d":
        return check_finite(load_mnist1d())
    if name == "mnist1d_shuffled":
        return check_finite(load_mnist1d(shuffle_length=True))
    raise ValueError(f"data.name: unknown data set {name!r}; choose one of {DATASETS}")


__all__ = ["DATASETS", "IMAGE_DATASETS", "ArrayData", "ArraySource", "DataNotPreparedError", "Dataset", "ImageSource",
           "ImageSpec", "check_finite", "check_labels", "from_arrays", "load_dataset", "load_image_dataset", "load_mnist1d",
           "prepared_num_examples", "synthetic_image_dataset", "tfds_data_dir"]
