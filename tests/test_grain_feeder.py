"""The host feeder on Grain (issue #21 item 2): ``BatchSource`` epochs are Grain pipelines that yield exactly the
batches of the hand-written loader they replaced -- order ``default_rng([seed, epoch, 0]).permutation``, batch
``b``'s augmentation from ``default_rng([seed, epoch, 1, b])`` -- each process reading only its block, and a run
stopped inside an epoch resumes bit-identically (from the position, or from Grain's iterator state)."""

import itertools
import os
import signal

import grain
import numpy as np
import pytest

from resjax.data import ArraySource, ImageSource, from_arrays
from resjax.data import tfds as T
from resjax.train import checkpoint as ckpt_lib
from resjax.train.preemption import Preempted
from tests.test_image_train import TinyCNN, leaves_equal, tiny_config, trainer_for


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


def cifar(n=70, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(1, 256, (n, 32, 32, 3), dtype=np.uint8)
    return images, rng.integers(0, 10, n).astype(np.int32)


class Recording(ImageSource):
    """An in-memory CIFAR-10 source that records the indices of every ``read``."""

    def __init__(self, images, labels):
        super().__init__("cifar10", "train", len(images), lambda idx: (images[idx], labels[idx]))
        self.reads = []

    def read(self, indices):
        self.reads.append(np.asarray(indices).copy())
        return super().read(indices)


def expected_epoch(images, labels, epoch, batch_size, seed, augment, drop_remainder=True):
    """The batches written out from the documented rule, without ``BatchSource``."""
    spec = T.IMAGE_DATASETS["cifar10"]
    order = np.random.default_rng([seed, epoch, 0]).permutation(len(images))
    n = len(images) // batch_size if drop_remainder else -(-len(images) // batch_size)
    for b in range(n):
        idx = order[b * batch_size:(b + 1) * batch_size]
        x = images[idx]
        if augment:
            x = T.random_crop_flip(x, np.random.default_rng([seed, epoch, 1, b]))
        yield T.normalise(x, spec.mean, spec.std), labels[idx]


def assert_same(batches, expected):
    batches, expected = list(batches), list(expected)
    assert len(batches) == len(expected)
    for (x, y), (xe, ye) in zip(batches, expected):
        assert x.dtype == xe.dtype and y.dtype == ye.dtype
        np.testing.assert_array_equal(x, xe)
        np.testing.assert_array_equal(y, ye)


def test_a_grain_fed_epoch_is_the_expected_order_and_augmentation():
    images, labels = cifar()
    src = Recording(images, labels)
    for epoch, seed, augment, dr in itertools.product((0, 2), (0, 5), (False, True), (True, False)):
        it = src.epoch(epoch, 16, seed=seed, augment=augment, drop_remainder=dr)
        assert isinstance(it, grain.DatasetIterator)
        assert_same(it, expected_epoch(images, labels, epoch, 16, seed, augment, dr))
    # random access: the epoch's Grain MapDataset; ds[b] is batch b, made when read
    ds = src.epoch_dataset(3, 16, seed=1, augment=True)
    assert isinstance(ds, grain.MapDataset) and len(ds) == 4
    src.reads.clear()
    x2, y2 = ds[2]
    assert len(src.reads) == 1  # one read of batch 2's examples only
    (xe, ye), = itertools.islice(expected_epoch(images, labels, 3, 16, 1, True), 2, 3)
    np.testing.assert_array_equal(x2, xe)
    np.testing.assert_array_equal(y2, ye)
    # stacked seeds: one element per batch, row s = seed s's batch
    stacked = list(src.stacked_epoch(1, 16, [0, 4], augment=True))
    for s, seed in enumerate([0, 4]):
        assert_same([(x[s], y[s]) for x, y in stacked], expected_epoch(images, labels, 1, 16, seed, True))


def test_array_sources_keep_their_augmentation_draws():
    images, labels = cifar(40)
    for augment in ("crop_flip", "flip"):
        src = from_arrays(images, labels, augment=augment).source("train")
        assert isinstance(src, ArraySource)
        x = src.data.x_train
        for b, (xb, yb) in enumerate(src.epoch(2, 8, seed=3, augment=True)):
            idx = np.random.default_rng([3, 2, 0]).permutation(40)[b * 8:(b + 1) * 8]
            rng = np.random.default_rng([3, 2, 1, b])
            if augment == "crop_flip":
                want = T.random_crop_flip(x[idx], rng, 4)
            else:
                want = np.where((rng.random(8) < 0.5)[:, None, None, None], x[idx][:, :, ::-1], x[idx])
            np.testing.assert_array_equal(xb, want)
            np.testing.assert_array_equal(yb, labels[idx])


@pytest.mark.parametrize("count", [2, 4])
def test_each_process_part_reads_only_its_block(count):
    """Process i of P reads rows [i*B/P, (i+1)*B/P) of every batch of the epoch's order and nothing else; the
    blocks, augmented as inside the whole batch, put together are the whole batch (a short final batch too:
    a process whose block lies past its end yields an empty block, so every process yields as many)."""
    images, labels = cifar(70)
    whole = list(Recording(images, labels).epoch(1, 16, seed=2, augment=True, drop_remainder=False))
    order = np.random.default_rng([2, 1, 0]).permutation(70)
    size = 16 // count
    parts = []
    for i in range(count):
        src = Recording(images, labels)
        ds = src.epoch_dataset(1, 16, seed=2, augment=True, drop_remainder=False, part=(i, count))
        assert len(ds) == 5
        parts.append(list(src.epoch(1, 16, seed=2, augment=True, drop_remainder=False, part=(i, count))))
        want = [order[b * 16:(b + 1) * 16][i * size:(i + 1) * size] for b in range(5)]
        want = [w for w in want if len(w)]
        assert [len(r) for r in src.reads] == [len(w) for w in want]  # one read per block it has
        np.testing.assert_array_equal(np.concatenate(src.reads), np.concatenate(want))
    assert all(len(p) == 5 for p in parts)
    for b, (x, y) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[b][0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[b][1] for p in parts]), y)
    assert parts[-1][-1][0].shape == (0, 32, 32, 3) and parts[-1][-1][1].dtype == np.int32  # 70 = 4*16 + 6
    with pytest.raises(ValueError, match="part"):
        Recording(images, labels).epoch(0, 16, part=(0, 3))


def test_resume_inside_an_epoch_is_bit_identical():
    """From the position (``start_batch``: the first batches are not read) and from Grain's iterator state
    (``get_state`` after k batches, ``set_state`` on a fresh iterator); with reader threads the same batches."""
    images, labels = cifar(100)
    src = Recording(images, labels)
    full = list(src.epoch(1, 16, seed=3, augment=True))
    assert len(full) == 6
    src.reads.clear()
    assert_same(src.epoch(1, 16, seed=3, augment=True, start_batch=4), full[4:])
    assert len(src.reads) == 2  # batches 4 and 5 only
    it = src.epoch(1, 16, seed=3, augment=True)
    head = [next(it) for _ in range(3)]
    state = it.get_state()
    assert state == {"next_index": 3}
    again = src.epoch(1, 16, seed=3, augment=True)
    again.set_state(state)
    assert_same(head + list(again), full)
    stacked = list(src.stacked_epoch(1, 16, [3, 9], augment=True))
    assert_same(src.stacked_epoch(1, 16, [3, 9], augment=True, start_batch=2), stacked[2:])
    threaded = src.loader(threads=2, buffer=3)
    assert (threaded.threads, threaded.buffer, src.threads) == (2, 3, 0)  # a copy; the source keeps its settings
    assert_same(threaded.epoch(1, 16, seed=3, augment=True), full)
    assert_same(threaded.stacked_epoch(1, 16, [3, 9], augment=True), stacked)
    for bad in (dict(workers=-1), dict(threads=1.5), dict(buffer=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            src.loader(**bad)


def test_worker_processes_make_the_same_batches():
    """Grain's worker processes (``loader(workers=1)``): the same batches, and the same from a saved state."""
    images, labels = cifar(96)
    src = ImageSource.from_arrays("cifar10", images, labels)
    full = list(src.epoch(0, 16, seed=1, augment=True))
    it = src.loader(workers=1).epoch(0, 16, seed=1, augment=True)
    try:
        head = [next(it) for _ in range(2)]
        state = it.get_state()
    finally:
        it.close()
    assert_same(head, full[:2])
    again = src.loader(workers=1).epoch(0, 16, seed=1, augment=True)
    try:
        again.set_state(state)
        assert_same(head + list(again), full)
    finally:
        again.close()


class SignallingArrays(ArraySource):
    """A user's arrays that send SIGINT to this process in their ``at``-th read (the stop request arrives while
    the Grain pipeline makes a batch)."""

    def __init__(self, data, at):
        super().__init__(data, "train", data.x_train, data.y_train)
        self.at, self.count = at, 0

    def read(self, indices):
        self.count += 1
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().read(indices)


@pytest.fixture(scope="module")
def unbroken_run():
    """``(data, config, run, history)``: 64 images of 4 classes with crop_flip augmentation and the unbroken run of
    seeds 0 and 1 on them (2 epochs), which both tests of a stopped run resume to."""
    rng = np.random.default_rng(0)
    y = np.arange(64) % 4
    x = (rng.normal(size=(4, 8, 8, 3))[y] * 40 + 128 + rng.normal(0, 20, (64, 8, 8, 3))).clip(0, 255)
    data = from_arrays(x.astype(np.uint8), y, augment="crop_flip", padding=2)
    config = tiny_config(epochs=2, checkpoint_every=1, augment=True)
    return (data, config, *trainer_for(config, TinyCNN(), data.source("train"), data.source("test")).fit([0, 1]))


@pytest.mark.parametrize("threads", [0, 1], ids=["in order", "reader thread"])
def test_a_run_on_a_grain_fed_source_stopped_inside_an_epoch_resumes_bit_identically(tmp_path, threads,
                                                                                      unbroken_run):
    """Two seeds (stacked batches: two reads a batch), crop_flip augmentation, 4 batches an epoch; SIGINT in the
    11th read (the first seed's of epoch 2's second batch): saved after that batch's step (step 6), and resumed
    from there equal to the unbroken run. With a reader thread the batches are read ahead (two), so the stop
    comes at another step of epoch 2; the resumed run is the same."""
    data, config, full, hf = unbroken_run
    source = SignallingArrays(data, at=2 * 4 + 3).loader(threads=threads)
    with pytest.raises(Preempted):
        trainer_for(config, TinyCNN(), source, data.source("test")).fit([0, 1], checkpoint_dir=tmp_path)
    step = ckpt_lib.latest(tmp_path)
    assert step == 6 if threads == 0 else 4 < step < 8, step  # inside epoch 2 (steps 4..8)
    resumed, hr = trainer_for(config, TinyCNN(), data.source("train"), data.source("test")).fit(
        [0, 1], checkpoint_dir=tmp_path)
    assert leaves_equal(full, resumed)
    for name in ("train_loss", "batch_error", "test_error", "lr"):
        np.testing.assert_array_equal(hf[name], hr[name])


def test_the_host_input_benchmark_times_before_and_after(tmp_path):
    """``python -m benchmarks.host_input`` in miniature: the hand-written loader (exported from its commit; skipped,
    and said so, in a clone without that commit) and the Grain feeder make the same batches, and both are timed."""
    import json

    from benchmarks import host_input

    out = tmp_path / "host_input.json"
    res = host_input.main(["--examples", "512", "--repeats", "1", "--variants", "before,grain", "--out", str(out)])
    assert json.loads(out.read_text())["summary"].keys() == res["summary"].keys()
    assert res["same_batches"] and res["summary"]["grain"]["images_per_s"] > 0
    assert "before" in res["summary"] or "not in this clone" in res["before_skipped"]
    if "before" in res["summary"]:
        assert res["summary"]["before"]["ratio_to_before"] == 1.0 and res["summary"]["grain"]["ratio_to_before"] > 0
