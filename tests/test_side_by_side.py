"""``resjax.train.side_by_side``: independent sweeps, one per device, each equal to itself alone."""

import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import subprocess_xla_flags

# Two CPU devices need XLA_FLAGS before JAX starts: the checks run in a subprocess.
SCRIPT = textwrap.dedent("""
    import functools, os, signal, threading, time
    import jax, numpy as np
    from resjax.train import make_train, side_by_side
    from tests.test_training import DATA, tiny_config
    assert jax.device_count() == 2

    def leaves(tree):
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                for x in jax.tree_util.tree_leaves(tree)]

    # Three jobs, each its own trainer of one BatchNorm MLP at its own learning rate (a job mixed up with another
    # would give another job's numbers): one model, so each device compiles its programs once, not once a job.
    trainers = [make_train(tiny_config(), DATA) for _ in range(3)]
    rates = [{"learning_rate": lr} for lr in (0.05, 0.02, 0.1)]
    keys = jax.random.split(jax.random.key(5), 3)
    jobs = [functools.partial(t.sweep, keys, hp, chunk_epochs=2) for t, hp in zip(trainers, rates)]
    together = side_by_side(jobs)
    used = set()
    for t, hp, (run, metrics) in zip(trainers, rates, together):
        on = {d.id for d in jax.tree_util.tree_leaves(run)[0].devices()}
        assert len(on) == 1, on  # the job ran whole on one device
        used |= on
        for device in jax.devices():  # each job alone, whole on one device: bit for bit
            alone_run, alone = t.sweep(keys, hp, chunk_epochs=2, devices=[device])
            for a, b in zip(leaves(run), leaves(alone_run), strict=True):
                np.testing.assert_array_equal(a, b)
            for name in ("train_loss", "train_error", "test_error", "diverged_epoch"):
                np.testing.assert_array_equal(metrics[name], alone[name])
    finals = [np.asarray(metrics["train_loss"])[:, -1].tolist() for _, metrics in together]
    assert len({tuple(f) for f in finals}) == 3, finals  # the jobs' numbers differ: a mix-up would show
    assert used == {0, 1}, used  # the jobs ran on both devices

    # A job that fails: no job starts after it, and its error is raised.
    started = []
    def bad(devices, stop):
        raise RuntimeError("boom")
    def recorded(devices, stop):
        started.append(devices)
        time.sleep(0.5)
        return 1
    try:
        side_by_side([bad, recorded, recorded, recorded])
    except RuntimeError as err:
        assert "boom" in str(err)
    else:
        raise AssertionError("the failure was not raised")
    assert len(started) <= 1, started  # at most the job already started beside the failing one

    # SIGTERM: the running jobs save and stop (Preempted), the others never start; resuming finishes them all.
    import tempfile
    root = tempfile.mkdtemp()
    config = tiny_config(kind="plain_mlp", width=8, depth=2)
    config.train.epochs, config.train.checkpoint_every = 200, 100  # long enough to be running when the signal comes
    long = [make_train(config, DATA) for _ in range(3)]
    jobs = [functools.partial(t.sweep, keys, chunk_epochs=1, checkpoint_dir=os.path.join(root, str(i)),
                              progress=f"cell {i}") for i, t in enumerate(long)]
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    from resjax.train import Preempted
    try:
        side_by_side(jobs)
    except Preempted as p:
        assert p.code == 143
    else:
        raise AssertionError("not preempted")
    saved = [os.path.isdir(os.path.join(root, str(i))) for i in range(3)]
    assert saved[:2] == [True, True] and saved[2] is False, saved
    resumed = side_by_side(jobs)
    _, alone = long[0].sweep(keys, chunk_epochs=1, devices=[jax.devices()[0]])  # the three jobs are the same cell
    for _, metrics in resumed:
        np.testing.assert_array_equal(metrics["train_loss"], alone["train_loss"])
    print("OK")
""")


def test_side_by_side_jobs_equal_each_alone_and_stop_cleanly():
    env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags(2), "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    # each running job's stop is a line of its own naming its cell (#53: none to be taken for another's), whether the
    # signal came before its training started (a loaded machine: still compiling) or after a chunk
    for i in (0, 1):
        before = rf"before \[cell {i}\] started training: nothing of it was trained yet, so nothing of it was saved\."
        after = (rf"after epoch \d+ of 200 of \[cell {i}\]; the run is saved in \S+{os.sep}{i} \(step \d+\)\. Run the "
                 "same command again to resume from it:")
        assert re.search(rf"^resjax: stopped by SIGTERM ({before}|{after})$", proc.stderr, re.M), proc.stderr[-3000:]
