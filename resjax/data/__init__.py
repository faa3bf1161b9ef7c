"""Data sets: MNIST-1D generated offline (the default everywhere it can serve)."""

from resjax.data.mnist1d import Dataset, load_mnist1d

DATASETS = ("mnist1d",)


def load_dataset(name: str) -> Dataset:
    """A data set by name, as numpy arrays."""
    if name == "mnist1d":
        return load_mnist1d()
    raise ValueError(f"data.name: unknown data set {name!r}; choose one of {DATASETS}")


__all__ = ["DATASETS", "Dataset", "load_dataset", "load_mnist1d"]
