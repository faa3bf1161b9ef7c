"""Data sets: MNIST-1D generated offline (the default everywhere it can serve); MNIST, CIFAR-10/100 and
ImageNet through ``tfds.data_source`` (:mod:`resjax.data.tfds`), with a synthetic stand-in."""

from resjax.data.mnist1d import Dataset, check_finite, load_mnist1d
from resjax.data.tfds import (IMAGE_DATASETS, DataNotPreparedError, ImageSource, load_image_dataset,
                              synthetic_image_dataset)

DATASETS = ("mnist1d",)


def load_dataset(name: str) -> Dataset:
    """A data set by name, as numpy arrays; every value finite (``check_finite``: a NaN or infinite value is
    refused, naming the split and the first bad example)."""
    if name == "mnist1d":
        return check_finite(load_mnist1d())
    raise ValueError(f"data.name: unknown data set {name!r}; choose one of {DATASETS}")


__all__ = ["DATASETS", "IMAGE_DATASETS", "DataNotPreparedError", "Dataset", "ImageSource", "check_finite", "load_dataset",
           "load_image_dataset", "load_mnist1d", "synthetic_image_dataset"]
