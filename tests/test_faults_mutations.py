"""Tests that catch three faults no other test sees (issue 12): a diverged seed that trains again, a data
order that is the same every epoch, and an augmentation that is the same for every batch. Each test names
the mutation of the library that it catches ("Mutation caught: ...")."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resjax.data import Dataset, ImageSource
from resjax.data.tfds import IMAGE_DATASETS, CIFAR_PADDING
from resjax.train import make_train, run_config, train_config


def _tiny_data(n=64, d=10, seed=0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n + 32, d)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)) % 3
    return Dataset(x[:n], y[:n], x[n:], y[n:])


def _seed(tree, s):
    return jax.tree_util.tree_map(lambda a: np.asarray(a[s]), jax.device_get(tree))


def _assert_tree_equal(a, b, what):
    jax.tree_util.tree_map_with_path(
        lambda path, x, y: np.testing.assert_array_equal(x, y, err_msg=f"{what}{jax.tree_util.keystr(path)}"), a, b)


# ---- (a) divergence freezes a seed for good ---------------------------------------------------------------


# Mutation caught: resjax/train/state.py: `frozen = was_diverged | bad` -> `frozen = bad` (a diverged seed
# whose later steps are finite would train again).
def test_a_diverged_seed_stays_frozen_when_later_steps_are_finite_and_its_seed_mate_trains_on():
    data = _tiny_data()
    config = run_config(dict(kind="residual_mlp", width=8, num_blocks=2, norm="batch"),
                        train_config(batch_size=16, epochs=1, learning_rate=0.05, momentum=0.9))
    trainer = make_train(config, data)
    hp = trainer.check_hparams(None, 2)
    run = jax.jit(jax.vmap(trainer.init))(jax.random.split(jax.random.key(0), 2), hp)
    step = jax.jit(jax.vmap(trainer.train_step))
    batches = [(data.x_train[i:i + 16], data.y_train[i:i + 16]) for i in range(0, 64, 16)]
    both = lambda xa, xb, y: (jnp.stack([xa, xb]), jnp.stack([y, y]))  # noqa: E731  (seed 0's x, seed 1's x)

    run, _ = step(run, both(batches[0][0], batches[0][0], batches[0][1]), hp)  # a good step: momentum is non-zero
    assert np.all(np.asarray(run.diverged_epoch) == -1)
    frozen = _seed(run.state, 0)
    assert any(np.any(leaf != 0) for leaf in jax.tree_util.tree_leaves(frozen.opt_state))

    x, y = batches[1]
    run, (loss, _) = step(run, both(jnp.full_like(x, 1e30), x, y), hp)  # seed 0 alone sees inputs of 1e30
    loss = np.asarray(loss)
    assert not np.isfinite(loss[0]) and np.isfinite(loss[1]), loss
    np.testing.assert_array_equal(run.diverged_epoch, [1, -1])
    _assert_tree_equal(_seed(run.state, 0), frozen, "seed 0 moved on its non-finite step: state")

    mate = _seed(run.state, 1)
    for x, y in batches[2:] + batches[:2]:  # ordinary batches: seed 0's loss is finite again
        run, (loss, _) = step(run, both(x, x, y), hp)
        assert np.all(np.isfinite(np.asarray(loss))), "the later steps must be finite for this test to mean anything"
        _assert_tree_equal(_seed(run.state, 0), frozen, "a diverged seed trained again: state")
        new_mate = _seed(run.state, 1)
        assert all(np.any(a != b) for a, b in zip(jax.tree_util.tree_leaves(new_mate.params),
                                                  jax.tree_util.tree_leaves(mate.params))), \
            "the healthy seed-mate stopped training"
        mate = new_mate
    np.testing.assert_array_equal(run.diverged_epoch, [1, -1])
    np.testing.assert_array_equal(run.state.step, [1, 6])


# ---- (b) a fresh permutation every epoch -------------------------------------------------------------------


class _Recorder(nn.Module):
    """A linear classifier that keeps the example ids (column 0 of its input) of its last training batch as a
    'batch_stats' variable, so a step hook can read the order in which the on-device feeder served them."""

    batch_size: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        seen = self.variable("batch_stats", "seen", lambda: jnp.full((self.batch_size,), -1.0, jnp.float32))
        if train:
            seen.value = x[:, 0]
        return nn.Dense(3)(x)


def _id_data(n: int) -> Dataset:
    ids = np.arange(n, dtype=np.float32)
    x = np.stack([ids, np.ones_like(ids)], axis=1)
    return Dataset(x, (np.arange(n) % 3).astype(np.int32), x[:6], (np.arange(6) % 3).astype(np.int32))


def _on_device_orders(keys, chunked=False, n=24, batch=8, epochs=3) -> np.ndarray:
    """The ids served to each seed: ``(seeds, epochs, n)``. The whole run as one program, or (``chunked``)
    one epoch per call."""
    config = run_config(None, train_config(batch_size=batch, epochs=epochs, learning_rate=0.01))
    trainer = make_train(config, _id_data(n), model=_Recorder(batch),
                         step_hook=lambda before, after, hp: after.state.batch_stats["seen"])
    if chunked:
        hp = trainer.default_hparams()
        run = jax.vmap(trainer.init)(keys)
        records = []
        for _ in range(epochs):
            run, rec = jax.vmap(lambda r: trainer.run_epochs(r, hp, 1))(run)
            records.append(rec["step_records"])
        seen = np.concatenate(records, axis=1)
    else:
        _, m = jax.jit(jax.vmap(trainer))(keys)
        seen = np.asarray(m["step_records"])  # (seeds, epochs, steps, batch)
    return seen.reshape(seen.shape[0], epochs, -1).astype(int)


# Mutation caught: resjax/train/ondevice.py (Trainer.train_epoch):
# `jax.random.permutation(jax.random.fold_in(run.key, run.epoch), n)` -> `jax.random.permutation(run.key, n)`
# (the same order every epoch).
def test_the_on_device_feeder_draws_a_new_permutation_every_epoch_and_seed():
    keys = jax.random.split(jax.random.key(0), 2)
    orders = _on_device_orders(keys)
    for s in range(2):
        for e in range(3):
            np.testing.assert_array_equal(np.sort(orders[s, e]), np.arange(24),
                                          err_msg=f"seed {s} epoch {e}: not every example exactly once")
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert not np.array_equal(orders[s, a], orders[s, b]), f"seed {s}: epochs {a} and {b} in the same order"
    for e in range(3):
        assert not np.array_equal(orders[0, e], orders[1, e]), f"epoch {e}: both seeds in the same order"
    # the same (key, epoch) gives the same order: the first seed alone, run one epoch per chunk
    np.testing.assert_array_equal(_on_device_orders(keys[:1], chunked=True)[0], orders[0])


def _id_source(n=40, name="mnist") -> ImageSource:
    """Blank images whose labels are their indices (``n`` classes, so that labels are checked as in range)."""
    import dataclasses

    spec = dataclasses.replace(IMAGE_DATASETS[name], num_classes=n)
    images = np.zeros((n, *spec.image_shape), np.uint8)
    return ImageSource(name, "train", n, lambda idx: (images[idx], idx), spec=spec)


def _host_order(source, epoch, seed, batch=8, **kw) -> np.ndarray:
    return np.concatenate([labels for _, labels in source.epoch(epoch, batch, seed=seed, **kw)])


# Mutation caught: resjax/data/tfds.py (ImageSource.order): `np.random.default_rng([seed, epoch, 0])` ->
# `np.random.default_rng([seed, 0])` (the same order every epoch).
def test_the_host_feeder_draws_a_new_permutation_every_epoch_and_seed():
    source = _id_source()
    orders = {(s, e): _host_order(source, e, s) for s in (0, 1) for e in (0, 1, 2)}
    for (s, e), order in orders.items():
        np.testing.assert_array_equal(np.sort(order), np.arange(40), err_msg=f"seed {s} epoch {e}")
        np.testing.assert_array_equal(order, source.order(e, seed=s), err_msg=f"seed {s} epoch {e}")
    for s in (0, 1):
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert not np.array_equal(orders[s, a], orders[s, b]), f"seed {s}: epochs {a} and {b} in the same order"
    for e in (0, 1, 2):
        assert not np.array_equal(orders[0, e], orders[1, e]), f"epoch {e}: both seeds in the same order"
    np.testing.assert_array_equal(_host_order(source, 1, 0), orders[0, 1])  # the same (seed, epoch) again
    np.testing.assert_array_equal(_host_order(source, 1, 0, start_batch=2), orders[0, 1][16:])
    np.testing.assert_array_equal(_host_order(source, 1, 0, shuffle=False), np.arange(40))


# ---- (c) a fresh augmentation every batch --------------------------------------------------------------------


def _ramp_source(n=32) -> ImageSource:
    """CIFAR-shaped images whose pixels say where they are: channel 0 is 100 + row, channel 1 is 100 + column,
    channel 2 the example's index (the zero padding of a crop is 0 everywhere)."""
    rows, cols = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    images = np.empty((n, 32, 32, 3), np.uint8)
    images[..., 0], images[..., 1] = 100 + rows, 100 + cols
    images[..., 2] = np.arange(n)[:, None, None]
    return ImageSource.from_arrays("cifar10", images, np.arange(n) % 10)


def _pixels(batch) -> np.ndarray:
    spec = IMAGE_DATASETS["cifar10"]
    return np.rint((batch * np.asarray(spec.std) + np.asarray(spec.mean)) * 255).astype(int)


def _crops(source, epoch, seed, start_batch=0) -> list[np.ndarray]:
    """Per batch, ``[B, 3]``: each image's (row offset, column offset, flipped) in the padded image, decoded
    from its pixels; checks that the whole image is that window of the zero-padded original."""
    out = []
    for images, _ in source.epoch(epoch, 8, seed=seed, augment=True, start_batch=start_batch):
        px = _pixels(images)
        flip = px[:, 16, 17, 1] < px[:, 16, 16, 1]
        dy = px[:, 16, 16, 0] - 100 - 16 + CIFAR_PADDING
        dx = np.where(flip, px[:, 16, 16, 1] - 100 - 15 + CIFAR_PADDING, px[:, 16, 16, 1] - 100 - 16 + CIFAR_PADDING)
        p = CIFAR_PADDING
        for i in range(len(px)):
            idx = px[i, 16, 16, 2]
            padded = np.pad(_pixels(source.preprocess(source.read([idx])[0], None, False))[0], ((p, p), (p, p), (0, 0)))
            window = padded[dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
            np.testing.assert_array_equal(px[i], window[:, ::-1] if flip[i] else window)
        out.append(np.stack([dy, dx, flip], axis=1))
    return out


# Mutation caught: resjax/data/tfds.py (ImageSource.epoch): `np.random.default_rng([seed, epoch, 1, b])` ->
# `np.random.default_rng([seed, epoch, 1])` (the same crops and flips for every batch of an epoch); also
# `-> np.random.default_rng([seed, 1, b])` (the same for every epoch).
def test_crops_and_flips_differ_between_batches_epochs_and_seeds_and_repeat_for_the_same_batch():
    source = _ramp_source()
    crops = {(s, e): _crops(source, e, s) for s in (0, 1) for e in (0, 1)}
    first = crops[0, 0]
    assert len(first) == 4
    for b, c in enumerate(first):  # within a batch the images get different windows
        assert len({tuple(row) for row in c}) > 1, f"batch {b}: every image got the same crop and flip"
        assert c[:, :2].min() >= 0 and c[:, :2].max() <= 2 * CIFAR_PADDING
    for a in range(4):
        for b in range(a + 1, 4):
            assert not np.array_equal(first[a], first[b]), f"batches {a} and {b} of one epoch got the same crops"
    for b in range(4):
        assert not np.array_equal(crops[0, 0][b], crops[0, 1][b]), f"batch {b}: epochs 0 and 1 got the same crops"
        assert not np.array_equal(crops[0, 0][b], crops[1, 0][b]), f"batch {b}: seeds 0 and 1 got the same crops"
    # the same (seed, epoch, batch) repeats exactly, also when the epoch starts at a later batch
    again = list(source.epoch(1, 8, seed=0, augment=True))
    for (x1, y1), (x2, y2) in zip(again, source.epoch(1, 8, seed=0, augment=True)):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    for (x1, _), (x2, _) in zip(again[2:], source.epoch(1, 8, seed=0, augment=True, start_batch=2)):
        np.testing.assert_array_equal(x1, x2)
    for c1, c2 in zip(crops[0, 1][2:], _crops(source, 1, 0, start_batch=2)):
        np.testing.assert_array_equal(c1, c2)


# ---- (d) mutations that survived the suite (#22 item 8) ---------------------------------------------------
# The MNIST-1D cache's finiteness and shape checks are caught by
# ``test_faults_experiments.py::test_a_readable_mnist1d_cache_with_wrong_content_is_rebuilt`` (its NaN and
# length-20 cases, with their mutations written beside them).


# Mutation caught: resjax/train/core.py `Core.check_hparams`: the `if not np.all(np.isfinite(v))` check removed
# (NaN passes `v < 0` and `v <= 0`, so a NaN learning rate or tau trained a run that was NaN from its first step).
def test_non_finite_hparams_are_refused_by_name():
    import math

    import pytest

    from resjax.train import make_train, run_config, train_config

    trainer = make_train(run_config(dict(kind="residual_mlp", width=4, num_blocks=1, scaling="tau", tau=0.5),
                                    train_config(batch_size=16, epochs=1)), _tiny_data())
    for name, bad in (("learning_rate", math.nan), ("learning_rate", math.inf), ("weight_decay", math.nan),
                      ("tau", math.nan), ("tau", math.inf)):
        with pytest.raises(ValueError, match=rf"^hparams\.{name}: must be finite \(NaN and infinities are refused\)"):
            trainer.check_hparams({name: [0.5, bad]}, 2)
    with pytest.raises(ValueError, match=r"^hparams\.learning_rate: must be finite"):
        trainer.sweep([0, 1], {"learning_rate": np.array([0.1, np.nan], np.float32)})


# Mutation caught: resjax/train/config.py `check_train_config`: the `train.seed` range check
# (`if not is_int(v) or not 0 <= v < 2**31`) removed (the experiments' preflight `check_seeds` still names
# `--train.seed`, so only a library-level test sees the library's own check go).
def test_train_seed_outside_the_key_range_is_refused_by_the_library():
    import pytest

    from resjax.train import make_train, run_config, train_config
    from resjax.train.config import check_train_config

    for bad in (-1, 2**31):
        config = train_config(batch_size=16, epochs=1)
        config.seed = bad
        with pytest.raises(ValueError, match=r"^seed: must be an integer in \[0, 2\*\*31\)"):
            check_train_config(config)
        with pytest.raises(ValueError, match=r"seed: must be an integer in \[0, 2\*\*31\)"):
            make_train(run_config(dict(kind="residual_mlp", width=4, num_blocks=1), config), _tiny_data())
    config = train_config(batch_size=16, epochs=1)
    config.seed = 2**31 - 1
    check_train_config(config)  # the largest seed is fine


# Mutations caught: resjax/train/core.py `seed_handles`: the `num_seeds != len(ints)` check removed (a list of
# 3 seed integers asked to be 2 seeds trained 3), or the `key.shape[0] != num_seeds` check removed (3 keys asked
# to be 2 trained 3); and `Core.check_checkpoint`: the `meta.get("num_seeds") != num_seeds` check removed (a
# checkpoint of 2 runs resumed by a run of 4 was refused only for its other hparams, or as damaged).
def test_a_num_seeds_mismatch_is_refused_naming_both_counts(tmp_path):
    import pytest

    from resjax.train import make_train, run_config, train_config
    from resjax.train.core import seed_handles

    with pytest.raises(ValueError, match=r"^num_seeds: 2 does not match the 3 seeds given"):
        seed_handles([0, 1, 2], 2)
    with pytest.raises(ValueError, match=r"^num_seeds: 2 does not match the 3 keys given"):
        seed_handles(jax.random.split(jax.random.key(0), 3), 2)
    keys, data_seeds, seeded = seed_handles([0, 1, 2], 3)
    assert keys.shape == (3,) and list(data_seeds) == [0, 1, 2] and seeded

    trainer = make_train(run_config(dict(kind="residual_mlp", width=4, num_blocks=1),
                                    train_config(batch_size=16, epochs=1)), _tiny_data())
    trainer.sweep([0, 1], checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match=rf"checkpoint_dir: {tmp_path}, step \d+: has num_seeds=\d+, this run \d+$"):
        trainer.sweep([0, 1, 2, 3], checkpoint_dir=tmp_path)


SECOND_SIGNAL = """
import os, signal, time
from resjax.train.preemption import StopSignals

with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("first signal noted:", stop.requested, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)
    print("still running after the second signal", flush=True)
"""


# Mutation caught: resjax/train/preemption.py `StopSignals._handle`: the second-signal branch (`if self.signum is
# not None: signal.signal(signum, SIG_DFL); os.kill(...)`) removed (a second Ctrl-C or SIGTERM was only noted
# again, and a user or scheduler could not stop a run stuck before its next save).
def test_a_second_stop_signal_stops_the_process_at_once():
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=root, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert "first signal noted: True" in child.stdout, (child.stdout, child.stderr)
    assert "still running" not in child.stdout
    assert child.returncode == -signal.SIGTERM, (child.returncode, child.stderr)
