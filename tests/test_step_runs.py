"""Runs counted in steps (``train.steps``, ``train.eval_every_steps``; issue #52) on the on-device feeder: a step
run of whole epochs is the epoch run bit for bit; its minibatches are the epochs' (shuffled) or the stored order
(``shuffle=False``); a SIGTERM mid-run saves, and the resumed run equals the unbroken one bit for bit, its
``metrics.jsonl`` keyed by step; settings that count epochs are refused by name. The host feeder refuses step
runs (not built there yet)."""

import json
import os
import signal

import jax
import numpy as np
import pytest

from resjax.data import from_arrays
from resjax.train import make_image_train, make_train, run_config, train_config
from resjax.train.preemption import Preempted

MODEL = dict(kind="residual_mlp", width=8, num_blocks=2, norm="batch")


def _data(n=48, classes=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n + 16, 6)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)) % classes
    return from_arrays(x[:n], y[:n], x[n:], y[n:], num_classes=classes)


def _config(**train):
    return run_config(MODEL, train_config(**{"batch_size": 16, "optimizer": "adam", "learning_rate": 1e-2,
                                             "checkpoint_every": 1, **train}))


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


@pytest.fixture(scope="module")
def keys():
    return jax.random.split(jax.random.key(0), 2)


# Broken on purpose: _period_batches drawing data epoch e's permutation from fold_in(key, e + 1): this test fails.
@pytest.mark.usefixtures("optimized_compiles")  # the promise is about the programs users compile
def test_a_step_run_of_whole_epochs_is_the_epoch_run_bit_for_bit(keys):
    data = _data()  # 48 examples, batches of 16: 3 steps an epoch
    epochs, _ = make_train(_config(epochs=4), data).sweep(keys)
    steps_run = make_train(_config(steps=12, eval_every_steps=3), data)
    steps, history = steps_run.sweep(keys, chunk_epochs=2)
    assert _same(epochs.state, steps.state)
    assert _same(epochs.history, steps.history)
    assert history["steps"] == 12 and history["test_error"].shape == (2, 4)
    assert np.asarray(steps.state.step).tolist() == [12, 12]


def test_minibatches_of_a_step_run_fixed_order_and_shuffled():
    """shuffle=False: step s is examples [(s mod 3) * 16, ...) (the reference recipe's order); shuffled, a period
    that crosses epochs takes each epoch's permutation in turn: every data epoch's 3 batches are 48 distinct
    examples, and consecutive epochs are ordered differently."""
    data = _data()
    fixed = make_train(_config(steps=10, eval_every_steps=5, shuffle=False), data)
    run = fixed.init(jax.random.key(1))
    for period in range(2):
        batches = np.asarray(fixed._period_batches(run._replace(epoch=np.int32(period))))
        want = [np.arange(16) + ((5 * period + i) % 3) * 16 for i in range(5)]
        np.testing.assert_array_equal(batches, want)
    shuffled = make_train(_config(steps=10, eval_every_steps=5), data)
    run = shuffled.init(jax.random.key(1))
    both = np.concatenate([np.asarray(shuffled._period_batches(run._replace(epoch=np.int32(p)))) for p in range(2)])
    assert both.shape == (10, 16)
    epoch_batches = [both[3 * e:3 * e + 3].ravel() for e in range(3)]
    for b in epoch_batches:
        assert sorted(b.tolist()) == list(range(48))
    assert not np.array_equal(epoch_batches[0], epoch_batches[1])
    epoch_run = make_train(_config(epochs=3), data)  # the epoch run's permutation of epoch 1, by its own rule
    perm = jax.random.permutation(jax.random.fold_in(run.key, 1), 48)
    np.testing.assert_array_equal(epoch_batches[1], np.asarray(perm))
    assert epoch_run.steps_per_epoch == 3 and shuffled.steps_per_epoch == 5


# Broken on purpose: Trainer._epoch_batches ignoring shuffle=False (the permutation every epoch, as before #53):
# the on-device batches are not the stored order and the trained parameters differ; this test fails.
def test_shuffle_false_gives_both_feeders_the_same_fixed_batches_in_order():
    """An epoch run with ``shuffle=False``: batch b of every epoch is examples [16 b, 16 b + 16) of the stored order
    on both feeders (the host feeder's batches are those examples' arrays, in that order), so two epochs train the
    same parameters on both (to float32 rounding: one is a scan, the other a step at a time; another batch order
    puts them thousands of times further apart)."""
    data = _data()
    config = run_config(dict(kind="plain_mlp", width=8, depth=2),
                        train_config(batch_size=16, epochs=2, learning_rate=0.2, shuffle=False))
    on_device, host = make_train(config, data), make_image_train(config, data)
    run = on_device.init(jax.random.key(0))
    for epoch in range(2):
        indices = np.asarray(on_device._epoch_batches(run._replace(epoch=np.int32(epoch))))
        np.testing.assert_array_equal(indices, np.arange(48).reshape(3, 16))
        batches = list(host._batches(epoch, [0], False))
        assert len(batches) == 3
        for b, (x, y) in enumerate(batches):
            np.testing.assert_array_equal(x, data.x_train[indices[b]])
            np.testing.assert_array_equal(y, data.y_train[indices[b]])
    fixed, hosted = (jax.tree_util.tree_leaves(t.fit(0)[0].state.params) for t in (on_device, host))
    # measured: 1.5e-8 apart; with the on-device feeder's batches shuffled (the break above), 5.5e-2 (and the host
    # feeder's shuffled run against the fixed one, 2.8e-2)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(fixed, hosted)) < 1e-5


# Broken on purpose: check_on_device_settings removed from make_train: the on-device feeder accepts (and ignores)
# these settings again; this test fails.
@pytest.mark.parametrize("setting, value", [("augment", True), ("seed_axis", "loop"), ("seed_axis", "unroll"),
                                            ("eval_batch_size", 250)])
def test_settings_the_on_device_feeder_cannot_honour_are_refused_by_name(setting, value):
    """The three host-feeder settings (``resjax.train.config``, "Which feeder honours what"): the on-device feeder
    refuses them naming the setting, itself and what to use instead; the host feeder takes them."""
    config = _config(epochs=1, **{setting: value})
    with pytest.raises(ValueError, match=rf"train\.{setting}: .*the on-device feeder \(make_train\).*make_image_train"):
        make_train(config, _data())
    make_image_train(config, _data())  # the host feeder honours each
    make_train(_config(epochs=1, seed_axis="vmap", eval_batch_size=1000, augment=False), _data())  # the defaults


@pytest.fixture
def handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    assert {s: signal.getsignal(s) for s in before} == before


# Broken on purpose: RunLog.write without the step key (`if self.step_period:` -> `if False:`): fails on the
# metrics.jsonl lines; the checkpoint's step number (checkpoint_step) as periods instead of steps: fails.
def test_sigterm_mid_step_run_resumes_bit_identically_with_metrics_keyed_by_step(tmp_path, keys, handlers):
    """5 periods of 2 steps (3 steps an epoch: periods cross epochs); SIGTERM after period 2; the same call again
    resumes from the saved period and ends equal to an unbroken run, every period logged once with its step."""
    data = _data()
    config = _config(steps=10, eval_every_steps=2)
    sent = []

    def terminate(done, summary):
        if done == 2 and not sent:
            sent.append(done)
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted) as stopped:
        make_train(config, data).sweep(keys, chunk_epochs=1, callback=terminate, checkpoint_dir=tmp_path / "ckpt",
                                       log=tmp_path / "log")
    assert stopped.value.code == 143 and stopped.value.step == 4  # the checkpoint's number is the steps done
    resumed, history = make_train(config, data).sweep(keys, chunk_epochs=1, checkpoint_dir=tmp_path / "ckpt",
                                                      log=tmp_path / "log")
    unbroken, full_history = make_train(config, data).sweep(keys, chunk_epochs=5)
    assert _same(resumed.state, unbroken.state) and _same(resumed.history, unbroken.history)
    assert np.asarray(resumed.state.step).tolist() == [10, 10]
    for k in ("test_error", "train_loss", "batch_error"):
        np.testing.assert_array_equal(history[k], full_history[k])
    rows = [json.loads(line) for line in open(tmp_path / "log" / "metrics.jsonl")]
    assert sorted((r["run"], r["step"]) for r in rows) == [(r, s) for r in range(2) for s in (2, 4, 6, 8, 10)]
    assert all(r["step"] == 2 * r["epoch"] for r in rows)


@pytest.mark.parametrize("settings, name", [
    (dict(steps=10, eval_every_steps=3), "train.eval_every_steps"),
    (dict(eval_every_steps=3), "train.eval_every_steps"),
    (dict(steps=-1), "train.steps"),
    (dict(steps=10, schedule="cosine"), "train.schedule"),
    (dict(steps=10, schedule="step", milestones=(1,)), "train.schedule"),
    (dict(steps=10, warmup_epochs=1.0), "train.warmup_epochs"),
    (dict(steps=10, eval_every=2), "train.eval_every"),
])
def test_settings_that_do_not_fit_a_step_run_are_refused_by_name(settings, name):
    with pytest.raises(ValueError, match=name):
        make_train(_config(**settings), _data())
    with pytest.raises(ValueError, match=name):  # the host feeder's checks are the same
        make_image_train(_config(**settings), _data())


# ---- the host feeder --------------------------------------------------------------------------------------


def _host(train, source=None):
    """A host trainer of the tiny CNN on FakeImages (64 examples, batches of 16: 4 steps a data epoch)."""
    from tests.test_image_train import TEST, FakeImages, TinyCNN, tiny_config, trainer_for

    return trainer_for(tiny_config(schedule="constant", milestones=(), checkpoint_every=1, **train), TinyCNN(),
                       source or FakeImages(64, seed=0), TEST)


# Broken on purpose: ImageTrainer._batches reading data epoch `data_epoch + 1` in a step run: this test fails.
def test_host_step_run_of_whole_epochs_is_the_epoch_run_bit_for_bit():
    from tests.test_image_train import leaves_equal

    epochs_run, epochs_history = _host(dict(epochs=3)).fit([0, 1])
    steps_run, steps_history = _host(dict(steps=12, eval_every_steps=4)).fit([0, 1])
    assert leaves_equal(epochs_run, steps_run)
    for k in ("train_loss", "batch_error", "test_error", "lr"):
        np.testing.assert_array_equal(epochs_history[k], steps_history[k])
    assert steps_history["steps"] == 12


class _SignalAt:
    """A FakeImages source that sends SIGTERM to this process while handing out batch ``at = (data epoch, index)``
    (once), and records every batch it hands out."""

    def __new__(cls, at):
        from tests.test_image_train import FakeImages

        class Source(FakeImages):
            def epoch(self, epoch, batch_size, **kw):
                for i, batch in enumerate(super().epoch(epoch, batch_size, **kw)):
                    if (epoch, i) == self.at:
                        self.at = None
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield batch

        source = Source(64, seed=0)
        source.at = at
        return source


# Broken on purpose: ImageTrainer._batches reading one batch past each period's share of a data epoch (islice's stop
# last - start + 1): the resumed run differs from the unbroken one; fails.
def test_host_sigterm_mid_period_resumes_bit_identically(tmp_path, handlers):
    """Periods of 3 steps over data epochs of 4 (periods cross epochs); SIGTERM while batch 2 of data epoch 1 (step
    6, inside period 3) is handed out: saved mid-period at step 7; the same call again ends equal to an unbroken
    run, every period logged once with its step."""
    from tests.test_image_train import leaves_equal

    train = dict(steps=12, eval_every_steps=3)
    with pytest.raises(Preempted) as stopped:
        _host(train, _SignalAt((1, 2))).fit([0, 1], checkpoint_dir=tmp_path / "ckpt", log=tmp_path / "log")
    assert stopped.value.code == 143 and stopped.value.step == 7  # 2 periods of 3, and 1 step of the third
    resumed, history = _host(train).fit([0, 1], checkpoint_dir=tmp_path / "ckpt", log=tmp_path / "log")
    unbroken, full_history = _host(train).fit([0, 1])
    assert leaves_equal(resumed, unbroken)
    for k in ("train_loss", "batch_error", "test_error"):
        np.testing.assert_array_equal(history[k], full_history[k])
    assert np.asarray(resumed.state.step).tolist() == [12, 12]
    rows = [json.loads(line) for line in open(tmp_path / "log" / "metrics.jsonl")]
    assert sorted((r["run"], r["step"]) for r in rows) == [(r, s) for r in range(2) for s in (3, 6, 9, 12)]


#: The last commit before step runs (issue #52): the epoch runs of the code before them.
BEFORE_STEP_RUNS = "738a673"
OLD_RUN = """
import sys, pickle, jax, numpy as np
sys.path.insert(0, sys.argv[1])
from tests.test_step_runs import epoch_runs
pickle.dump(epoch_runs(), open(sys.argv[2], "wb"))
"""


def epoch_runs() -> dict:
    """Two on-device epoch runs (BatchNorm MLP evaluated every epoch; plain MLP under Adam evaluated every 2nd),
    chunked, and a host-fed one (a BatchNorm CNN): their parameters, history and metrics as numpy."""
    import resjax
    out = {"resjax": resjax.__file__}
    for name, model, t in (("bn", MODEL, dict(epochs=4)),
                           ("plain", dict(kind="plain_mlp", width=8, depth=2), dict(epochs=5, eval_every=2))):
        run, metrics = make_train(_config(**t) if name == "plain" else run_config(model, train_config(
            batch_size=16, epochs=4)), _data()).sweep(jax.random.split(jax.random.key(3), 2), chunk_epochs=2)
        out[name] = (jax.tree_util.tree_map(np.asarray, (run.state.params, run.history)),
                     {k: np.asarray(v) for k, v in metrics.items()})
    # the host feeder: the tiny CNN on FakeImages, two seeds, 3 epochs (a step schedule: milestone 2)
    from tests.test_image_train import TEST, FakeImages, TinyCNN, tiny_config, trainer_for

    run, metrics = trainer_for(tiny_config(), TinyCNN(), FakeImages(64, seed=0), TEST).fit([0, 1])
    out["host"] = (jax.tree_util.tree_map(np.asarray, (run.state.params, run.state.batch_stats, run.history)),
                   {k: np.asarray(v) for k, v in metrics.items()})
    return out


# Broken on purpose: an epoch run's permutation from fold_in(run.key, run.epoch + 1) (Trainer.train_epoch): fails.
# (Taking the step-run branch for every run would not break it: a period of one epoch is the epoch, bit for bit.)
def test_an_epoch_run_equals_the_code_before_step_runs_bit_for_bit(tmp_path):
    """The code of the commit before step runs (``git archive``) and this code run the same epoch runs in two
    processes (the same XLA settings): parameters, history and metrics equal bit for bit."""
    import pickle
    import shutil
    import subprocess
    import sys
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if shutil.which("git") is None or not os.path.exists(os.path.join(root, ".git")):
        pytest.skip("needs the git history (git archive of the commit before step runs)")
    archive = tmp_path / "old.tar"
    with open(archive, "wb") as f:
        done = subprocess.run(["git", "-C", root, "archive", BEFORE_STEP_RUNS, "resjax"], stdout=f)
    if done.returncode:
        pytest.skip(f"commit {BEFORE_STEP_RUNS} not in this clone's history")
    old = tmp_path / "old"
    with tarfile.open(archive) as tar:
        tar.extractall(old, filter="data")
    shutil.copytree(os.path.join(root, "tests"), old / "tests")  # this file's epoch_runs, run by the old library
    env = {**os.environ, "PYTHONPATH": str(old)}
    results = {}
    for label, path in (("old", str(old)), ("new", root)):
        env["PYTHONPATH"] = path
        subprocess.run([sys.executable, "-c", OLD_RUN, path, str(tmp_path / f"{label}.pkl")], cwd=path, env=env,
                       check=True, timeout=600)
        results[label] = pickle.load(open(tmp_path / f"{label}.pkl", "rb"))
    assert results["old"]["resjax"].startswith(str(old)) and results["new"]["resjax"].startswith(root)
    for name in ("bn", "plain", "host"):
        (old_state, old_metrics), (new_state, new_metrics) = results["old"][name], results["new"][name]
        assert _same(old_state, new_state)
        assert sorted(old_metrics) == sorted(new_metrics)
        assert all(np.array_equal(old_metrics[k], new_metrics[k], equal_nan=True) for k in old_metrics)


# Broken on purpose: Progress.update printing epochs for a step run (`if self.step_period` -> `if False`): fails.
def test_progress_lines_of_a_step_run_count_steps(capsys):
    make_train(_config(steps=6, eval_every_steps=3), _data()).sweep(jax.random.split(jax.random.key(0), 1),
                                                                    chunk_epochs=1, progress="cell")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[cell]")]
    assert [line.split(" (")[0] for line in lines] == ["[cell] step 3/6", "[cell] step 6/6"]
