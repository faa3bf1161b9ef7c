"""Small labelled arrays for tests of training on a user's data (``resjax.data.from_arrays``)."""

import numpy as np


def separable_arrays(n: int, shape: tuple, classes: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``n`` float32 examples of ``shape``, class ``i % classes`` for example ``i``, each its class's
    fixed prototype plus unit Gaussian noise (learnable in a few epochs)."""
    rng = np.random.default_rng(seed)
    protos = np.random.default_rng(11).normal(size=(classes, *shape))
    y = np.arange(n) % classes
    return (protos[y] + rng.normal(0, 1.0, (n, *shape))).astype(np.float32), y
