"""Mocked TFDS data for tests: ``tfds.testing.mock_data`` on the committed metadata.

``mocked_tfds()`` (a context manager; ``test_tfds.py``'s ``mocked`` fixture wraps it): inside it,
``load_image_dataset(name, split, data_dir=META)`` reads the committed ``dataset_info.json`` (real split
sizes) and serves the mock's random examples. It carries the same workaround for tfds 4.9.10, whose
``mock_data`` sets ``__getitems__`` to a ``functools.partial`` that MagicMock never binds, so ``self`` is
never passed: ``mocking._getitems`` (looked up when ``data_source`` is called) is replaced by a version
without ``self``.

``mocked_examples(name, split, n)`` reads the first ``n`` mocked examples through ``load_image_dataset``
and returns them as an in-memory ``ImageSource`` (same normalisation and augmentation), so a test can
train on a few examples without the mock staying active.
"""

from __future__ import annotations

import contextlib
import pathlib

import numpy as np
import pytest

META = pathlib.Path(__file__).parent / "data" / "tfds"


@contextlib.contextmanager
def mocked_tfds():
    """Inside: ``tfds.data_source`` serves random examples for the committed metadata's real splits.
    Yields the data directory to pass to ``load_image_dataset``."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.testing import mocking

    def getitems(record_keys, generator, serialized=False):
        assert not serialized
        return [generator[k] for k in record_keys]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mocking, "_getitems", getitems)
        with tfds.testing.mock_data(num_examples=1, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=str(META)):
            yield META


def mocked_examples(name: str, split: str, num_examples: int):
    """The first ``num_examples`` examples of mocked ``name``/``split`` (read with ``load_image_dataset``)
    as an in-memory ``ImageSource``."""
    from resjax.data import ImageSource, load_image_dataset

    with mocked_tfds() as data_dir:
        source = load_image_dataset(name, split, data_dir=data_dir)
        images, labels = source.read(np.arange(num_examples))
    return ImageSource.from_arrays(name, np.stack(images), labels, split=split)
