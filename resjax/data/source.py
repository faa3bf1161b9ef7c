"""The batching shared by every host data source: ``BatchSource``.

A source subclasses it and gives ``num_examples``, ``image_shape``, ``name``, ``split`` and three methods:
``read(indices)`` (stored examples and int32 labels), ``preprocess(images, rng, augment, rows, batch_length)``
(stored examples -> a float32 batch) and ``check_finite(batch, indices, epoch, batch_index)``. ``BatchSource``
then gives the epochs: the order, the per-batch augmentation draws, one process's block of each batch and the
stacked epochs of several seeds, each a pure function of ``(seed, epoch)`` (``resjax.data.tfds.ImageSource`` for
TFDS data sets, ``resjax.data.arrays.ArraySource`` for a user's arrays).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["BatchSource"]


class BatchSource:
    """Deterministic epochs of minibatches over a random-access source (see the module docstring)."""

    num_examples: int
    image_shape: tuple[int, ...]
    name: str
    split: str

    def __len__(self) -> int:
        return self.num_examples

    def num_batches(self, batch_size: int, drop_remainder: bool = True) -> int:
        """Batches per epoch: ``num_examples // batch_size``, rounded up when not ``drop_remainder``."""
        _check_batch_size(batch_size)
        if drop_remainder:
            return self.num_examples // batch_size
        return -(-self.num_examples // batch_size)

    def order(self, epoch: int, *, seed: int = 0, shuffle: bool = True) -> np.ndarray:
        """The example indices of an epoch: ``default_rng([seed, epoch, 0]).permutation(n)``, or ``0..n-1``."""
        _check_nonneg("seed", seed)
        _check_nonneg("epoch", epoch)
        if not shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([seed, epoch, 0]).permutation(self.num_examples)

    def epoch(self, epoch: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, augment: bool = False,
              drop_remainder: bool = True, start_batch: int = 0,
              part: tuple[int, int] | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterator over (images float32 [B,H,W,C] normalised, labels int32 [B]).

        Deterministic: a pure function of (seed, epoch) -- the order is
        ``np.random.default_rng([seed, epoch, 0]).permutation(num_examples)`` and batch ``b``'s augmentation
        draws from ``np.random.default_rng([seed, epoch, 1, b])``. This is what makes exact resume of
        training possible (no loader state to save); ``start_batch`` starts at batch ``start_batch``,
        yielding exactly the rest of the full epoch. ``shuffle=False`` gives the split in order
        (evaluation); ``drop_remainder=False`` yields a final short batch. A batch with a NaN or infinite
        value (after normalisation) raises ``ValueError`` naming the split, epoch, batch and example.

        ``part=(i, P)``: only process ``i``'s block of every batch, rows ``[i * B/P, (i+1) * B/P)`` (``B`` =
        ``batch_size``, which ``P`` must divide; a final short batch gives the rows of the block it has,
        perhaps none). Only those examples are read, and they are augmented exactly as in the whole batch,
        so the blocks of ``P`` processes put together are the batch one process reads.
        """
        n_batches = self.num_batches(batch_size, drop_remainder)
        block = slice(0, batch_size)
        if part is not None:
            index, count = part
            if not (isinstance(count, (int, np.integer)) and count >= 1 and 0 <= index < count) or batch_size % count:
                raise ValueError(f"part: want (index, count) with 0 <= index < count and count dividing "
                                 f"batch_size={batch_size}, got {part!r}")
            size = batch_size // count
            block = slice(index * size, (index + 1) * size)
        if n_batches == 0:
            raise ValueError(f"batch_size: {batch_size} exceeds the {self.num_examples} examples of "
                             f"{self.name}/{self.split}, so an epoch with drop_remainder has no batch")
        _check_nonneg("start_batch", start_batch)
        order = self.order(epoch, seed=seed, shuffle=shuffle)

        def batches():
            for b in range(start_batch, n_batches):
                whole = order[b * batch_size:(b + 1) * batch_size]
                rows = slice(*block.indices(len(whole)))
                indices = whole[rows]
                if not len(indices):  # this process's block lies past the end of a short final batch
                    yield np.zeros((0, *self.image_shape), np.float32), np.zeros(0, np.int32)
                    continue
                images, labels = self.read(indices)
                rng = np.random.default_rng([seed, epoch, 1, b]) if augment else None
                batch = self.preprocess(images, rng, augment, rows=rows, batch_length=len(whole))
                self.check_finite(batch, indices, epoch, b)
                yield batch, labels

        return batches()

    def stacked_epoch(self, epoch: int, batch_size: int, seeds: Sequence[int],
                      **kw: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Same, for several seeds at once: yields (images [S,B,H,W,C], labels [S,B]) where row s is
        exactly what ``epoch(..., seed=seeds[s])`` would yield. Used for seed-vmapped training."""
        seeds = list(seeds)
        if not seeds:
            raise ValueError("seeds: need at least one seed")
        if "seed" in kw:
            raise ValueError("seed: give the seeds as `seeds` to stacked_epoch")
        iterators = [self.epoch(epoch, batch_size, seed=s, **kw) for s in seeds]

        def batches():
            for rows in zip(*iterators):
                yield np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

        return batches()


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size: want a positive integer, got {batch_size!r}")


def _check_nonneg(setting: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{setting}: want a non-negative integer, got {value!r}")
