"""The batching shared by every host data source: ``BatchSource``, a Grain pipeline.

A source subclasses it and gives ``num_examples``, ``image_shape``, ``name``, ``split`` and three methods:
``read(indices)`` (stored examples and int32 labels), ``preprocess(images, rng, augment, rows, batch_length)``
(stored examples -> a float32 batch) and ``check_finite(batch, indices, epoch, batch_index)``. ``BatchSource``
then gives the epochs: the order, the per-batch augmentation draws, one process's block of each batch and the
stacked epochs of several seeds, each a pure function of ``(seed, epoch)`` (``resjax.data.tfds.ImageSource`` for
TFDS data sets, ``resjax.data.arrays.ArraySource`` for a user's arrays).

The epochs are Grain pipelines (``grain.MapDataset``, https://github.com/google/grain): random access to
the epoch's batches (``epoch_dataset``: ``ds[b]`` is batch ``b``), Grain's slicing for the per-process blocks
(``ds[i::P]``), its reader threads and worker processes (``loader(threads=, workers=)``) and its iterator state
(``get_state``/``set_state``: ``{'next_index': batches yielded}``). What stays this module's own: the order
(Grain's ``shuffle`` is another permutation than ``default_rng([seed, epoch, 0]).permutation``, which every
run and result so far used) and the augmentation draws (Grain's ``random_map`` seeds each element, not each
batch), so the batches are bit-identical to those of the hand-written loader this replaced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from resjax._quiet import quiet_import

if TYPE_CHECKING:  # imported where used: importing grain imports JAX
    import grain

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

    #: Grain worker processes making the batches (``IterDataset.mp_prefetch``); 0: the calling process. Set with
    #: ``loader``. Each epoch starts its workers afresh (spawned, the source pickled to each), which costs
    #: seconds; ``python -m benchmarks.host_input`` measures when that pays.
    workers: int = 0
    #: Grain reader threads (``ReadOptions.num_threads``) in the process making the batches; 0: each batch is
    #: made when asked for, in the calling thread (one ``read`` per batch, in order). Set with ``loader``.
    threads: int = 0
    #: Batches each reader thread or worker makes ahead (``ReadOptions.prefetch_buffer_size``,
    #: ``MultiprocessingOptions.per_worker_buffer_size``). Set with ``loader``.
    buffer: int = 2

    def loader(self, *, workers: int | None = None, threads: int | None = None,
               buffer: int | None = None) -> BatchSource:
        """A copy of this source whose epochs are made by ``workers`` Grain worker processes and ``threads``
        reader threads, each ``buffer`` batches ahead (unset: as this one). The batches are the same (the
        order and augmentation are functions of ``(seed, epoch, batch)``, not of who makes them); only where
        and when they are made changes. With threads, ``read`` may be called from them, several batches at
        once; with workers, in other processes (so nothing it records comes back). Workers are started with
        ``spawn``: a script using them needs the ``if __name__ == "__main__":`` guard, an epoch left unfinished
        should be ``close()``-d, and the first use marks absl's flags parsed (Grain 0.2.18 reads one of them
        in its workers and fails on unparsed flags, google/grain#1355). On this project's 2-core CPU neither
        threads nor workers made a CIFAR epoch faster (``python -m benchmarks.host_input``)."""
        import copy

        out = copy.copy(self)
        for setting, value in (("workers", workers), ("threads", threads), ("buffer", buffer)):
            if value is not None:
                _check_nonneg(setting, value)
                setattr(out, setting, int(value))
        if out.buffer < 1:
            raise ValueError(f"buffer: want a positive integer, got {out.buffer!r}")
        return out

    def epoch_dataset(self, epoch: int, batch_size: int, *, seed: int = 0, seeds: Sequence[int] | None = None,
                      shuffle: bool = True, augment: bool = False, drop_remainder: bool = True,
                      part: tuple[int, int] | None = None) -> grain.MapDataset:
        """The epoch's batches as a ``grain.MapDataset``: ``ds[b]`` is batch ``b`` (this process's block of it
        with ``part``), made when read; ``len(ds)`` is ``num_batches``. ``epoch`` iterates over it. With
        ``seeds`` (a list), each element is the batches of those seeds stacked (``stacked_epoch``). The other
        arguments are ``epoch``'s."""
        grain = quiet_import("grain")  # imported when used, leaving no handler on the root logger (resjax._quiet)

        stacked = seeds is not None
        seeds = list(seeds) if stacked else [seed]
        if not seeds:
            raise ValueError("seeds: need at least one seed")
        n_batches = self.num_batches(batch_size, drop_remainder)
        index, count = 0, 1
        if part is not None:
            index, count = part
            if not (isinstance(count, (int, np.integer)) and count >= 1 and 0 <= index < count) or batch_size % count:
                raise ValueError(f"part: want (index, count) with 0 <= index < count and count dividing "
                                 f"batch_size={batch_size}, got {part!r}")
        if n_batches == 0:
            raise ValueError(f"batch_size: {batch_size} exceeds the {self.num_examples} examples of "
                             f"{self.name}/{self.split}, so an epoch with drop_remainder has no batch")
        orders = [self.order(epoch, seed=s, shuffle=shuffle) for s in seeds]  # checks epoch and the seeds
        make = _MakeBatch(self, orders, [int(s) for s in seeds], int(epoch), int(batch_size), int(count),
                          bool(augment), stacked)
        # one element per (batch, process block) -- batch b's block p is element b * count + p -- of which
        # Grain's slicing (its way of sharding a MapDataset) keeps this process's: elements b * count + index
        units = grain.MapDataset.range(n_batches * int(count))[int(index)::int(count)]
        return units.map(make)

    def epoch(self, epoch: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, augment: bool = False,
              drop_remainder: bool = True, start_batch: int = 0,
              part: tuple[int, int] | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterator over (images float32 [B,H,W,C] normalised, labels int32 [B]).

        Deterministic: a pure function of (seed, epoch) -- the order is
        ``np.random.default_rng([seed, epoch, 0]).permutation(num_examples)`` and batch ``b``'s augmentation
        draws from ``np.random.default_rng([seed, epoch, 1, b])``. This is what makes exact resume of
        training possible (no loader state to save beyond the position); ``start_batch`` starts at batch
        ``start_batch``, yielding exactly the rest of the full epoch without reading the first batches.
        ``shuffle=False`` gives the split in order (evaluation); ``drop_remainder=False`` yields a final short
        batch. A batch with a NaN or infinite value (after normalisation) raises ``ValueError`` naming the
        split, epoch, batch and example.

        ``part=(i, P)``: only process ``i``'s block of every batch, rows ``[i * B/P, (i+1) * B/P)`` (``B`` =
        ``batch_size``, which ``P`` must divide; a final short batch gives the rows of the block it has,
        perhaps none). Only those examples are read, and they are augmented exactly as in the whole batch,
        so the blocks of ``P`` processes put together are the batch one process reads.

        The iterator is Grain's (``epoch_dataset`` through this source's ``loader`` settings): its
        ``get_state()`` is ``{'next_index': k}`` after the ``k``-th batch yielded with no workers (counted
        from ``start_batch``), and ``set_state`` of a saved state continues from there.
        """
        _check_nonneg("start_batch", start_batch)
        ds = self.epoch_dataset(epoch, batch_size, seed=seed, shuffle=shuffle, augment=augment,
                                drop_remainder=drop_remainder, part=part)
        return iter(self._pipeline(ds[start_batch:]))

    def stacked_epoch(self, epoch: int, batch_size: int, seeds: Sequence[int], *, start_batch: int = 0,
                      **kw: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Same, for several seeds at once: yields (images [S,B,H,W,C], labels [S,B]) where row s is
        exactly what ``epoch(..., seed=seeds[s])`` would yield. Used for seed-vmapped training."""
        if "seed" in kw:
            raise ValueError("seed: give the seeds as `seeds` to stacked_epoch")
        _check_nonneg("start_batch", start_batch)
        ds = self.epoch_dataset(epoch, batch_size, seeds=list(seeds), **kw)
        return iter(self._pipeline(ds[start_batch:]))

    def _pipeline(self, ds: grain.MapDataset) -> grain.IterDataset:
        """``ds`` (a ``grain.MapDataset``) as a ``grain.IterDataset`` made by this source's threads and workers."""
        grain = quiet_import("grain")

        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.buffer))
        if self.workers:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain 0.2.18's workers read an absl flag (google/grain#1355)
                flags.FLAGS.mark_as_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                             per_worker_buffer_size=self.buffer))
        return it


class _MakeBatch:
    """Element ``u`` of an epoch's Grain dataset: block ``u % count`` of batch ``u // count`` (one ``read``,
    augmented with the draws of the whole batch), or those of several seeds stacked. A class, not a closure,
    so Grain's worker processes can be sent it."""

    def __init__(self, source: BatchSource, orders: list, seeds: list, epoch: int, batch_size: int, count: int,
                 augment: bool, stacked: bool) -> None:
        self.source, self.orders, self.seeds, self.epoch = source, orders, seeds, epoch
        self.batch_size, self.count, self.augment, self.stacked = batch_size, count, augment, stacked

    def __call__(self, unit: int) -> tuple[np.ndarray, np.ndarray]:
        b, index = divmod(int(unit), self.count)
        size = self.batch_size // self.count
        rows = [self._block(order, seed, b, slice(index * size, (index + 1) * size))
                for order, seed in zip(self.orders, self.seeds)]
        if not self.stacked:
            return rows[0]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def _block(self, order: np.ndarray, seed: int, b: int, block: slice) -> tuple[np.ndarray, np.ndarray]:
        source, batch_size = self.source, self.batch_size
        whole = order[b * batch_size:(b + 1) * batch_size]
        rows = slice(*block.indices(len(whole)))
        indices = whole[rows]
        if not len(indices):  # this process's block lies past the end of a short final batch
            return np.zeros((0, *source.image_shape), np.float32), np.zeros(0, np.int32)
        images, labels = source.read(indices)
        rng = np.random.default_rng([seed, self.epoch, 1, b]) if self.augment else None
        batch = source.preprocess(images, rng, self.augment, rows=rows, batch_length=len(whole))
        source.check_finite(batch, indices, self.epoch, b)
        return batch, labels


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size: want a positive integer, got {batch_size!r}")


def _check_nonneg(setting: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{setting}: want a non-negative integer, got {value!r}")
