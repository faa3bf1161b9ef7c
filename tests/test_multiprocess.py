"""Several JAX processes on this machine (gloo collectives), started by ``resjax.launch``.

Two processes against one (``tests/multiprocess_worker.py`` does the training; see its stages): a seed
sweep sharded across processes, data-parallel image training with BatchNorm's global-batch statistics,
a checkpoint written by two processes resumed in two and in one, each process reading only its own block
of every batch, a process that dies, and an experiment whose files process 0 alone writes.

A JAX process costs seconds to start and to build its programs: the module starts few, each running several of
the worker's stages in turn (see the fixtures), and the tests check their parts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from resjax import launch
from tests.conftest import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
TOL = 1e-5  # the bound; on this CPU two processes have given bit-identical numbers


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env["XLA_FLAGS"] = subprocess_xla_flags()  # each process sets its own device count
    env.update(PYTHONPATH=ROOT, **extra)
    return env


def _run(args, env, timeout=600):
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def _launch(stages, out, processes=2, **env):
    """The worker's ``stages`` (comma-separated, see ``tests/multiprocess_worker.py``) in 2 (or ``processes``)
    processes (1 CPU device each) through the launcher; the launcher's grace period far longer (300 s) than
    the heartbeat timeout (10 s), so that a dying process's peers are stopped by the heartbeat, not by it.
    ``(returncode, output, seconds)``."""
    start = time.monotonic()
    rc, log = _run([sys.executable, "-m", "resjax.launch", "--processes", str(processes), "--heartbeat", "10",
                    "--grace", "300", "--", sys.executable, WORKER, stages, out], _env(RESJAX_CPU_DEVICES="1", **env))
    return rc, log, time.monotonic() - start


def _one(stages, out, **env):
    """``stages`` in 1 process with 2 CPU devices: the same mesh size as the two processes."""
    return _run([sys.executable, WORKER, stages, out], _env(RESJAX_CPU_DEVICES="2", **env))


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _loaded(path, log):
    assert os.path.exists(path), log[-4000:]
    return _load(path)


# Every JAX process costs seconds to start and to build its programs, so the module runs four launches and one
# single process, each running several of the worker's stages in turn, and the tests check their parts:
#   two processes:  first, then preempt (process 1 alone sent SIGTERM; exit 143)
#   two processes:  resume the first stage's checkpoint, resume the preempted one, then process 1 dies (exit 3)
#   four processes: first (no checkpoint), then process 0 (which runs the coordination service) dies (exit 3)
#   one process:    first (no checkpoint), whole, and the resume of the two processes' first checkpoint
# (and the launched experiment, beside them).
@pytest.fixture(scope="module")
def two_first(tmp_path_factory):
    """Two processes: the first stage, then the preempted run (SIGTERM reaches process 1 alone at its 6th of 8
    training reads, in epoch 2; 4 batches an epoch). ``(directory, returncode, output)``."""
    two = str(tmp_path_factory.mktemp("two"))
    rc, log, _ = _launch("first,preempt", two, SIGTERM_AT_READ="6")
    for ckpt, copies in (("ckpt", ("ckpt_for_two", "ckpt_for_one")), ("preempted", ("preempted_for_two",))):
        for copy in copies:  # the resumed runs save into their copy; the original stays as it was left
            if os.path.isdir(os.path.join(two, ckpt)):
                shutil.copytree(os.path.join(two, ckpt), os.path.join(two, copy))
    return two, rc, log


@pytest.fixture(scope="module")
def two_resumed(two_first):
    """Two processes: the first stage's checkpoint (2 of 3 epochs) resumed to the end, the preempted run's
    resumed to the end, then process 1 dies in the middle of training. ``(returncode, output, seconds)``."""
    return _launch("resume:ckpt_for_two,resume:preempted_for_two,die", two_first[0], DIE="1")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Four processes (4 devices in all): the first stage (without its checkpoint, which nothing here reads: the
    checkpoints of several processes are the two processes' test), then process 0 dies in the middle of
    training. ``(directory, returncode, output, seconds)``."""
    out = str(tmp_path_factory.mktemp("four"))
    return (out, *_launch("first:none,die", out, processes=4, DIE="0"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_first, two_resumed):
    two, _, log = two_first
    one = str(tmp_path_factory.mktemp("one"))
    rc, one_log = _one(f"first:none,whole,resume:{os.path.join(two, 'ckpt_for_one')}", one)
    assert rc == 0, one_log[-4000:]
    resumed_log = two_resumed[1]
    return {"two": [_loaded(os.path.join(two, f"first-{i}.npz"), log) for i in (0, 1)],
            "one": _load(os.path.join(one, "first-0.npz")), "whole": _load(os.path.join(one, "whole-0.npz")),
            "resumed_two": [_loaded(os.path.join(two, f"resume-ckpt_for_two-{i}.npz"), resumed_log) for i in (0, 1)],
            "resumed_one": _load(os.path.join(one, "resume-ckpt_for_one-0.npz"))}


def _assert_close(got, want, prefix):
    names = [k for k in want if k.startswith(prefix) and not k.endswith("train_error")]  # host feeder: NaN
    assert names
    for k in names:
        np.testing.assert_allclose(got[k], want[k], rtol=TOL, atol=TOL, err_msg=k)


def test_two_processes_really_ran(runs):
    for r in runs["two"]:
        assert int(r["process_count"]) == 2 and int(r["device_count"]) == 2
    assert int(runs["one"]["process_count"]) == 1 and int(runs["one"]["device_count"]) == 2


def test_seed_sweep_across_processes_equals_one_process(runs):
    p0, p1 = runs["two"]
    assert p0["sweep_test_error"].shape == (4, 2)  # 4 seeds x 2 epochs: every seed's curve on every process
    _assert_close(p0, runs["one"], "sweep_")
    _assert_close(p1, runs["one"], "sweep_")


def test_data_parallel_image_training_equals_one_process(runs):
    """Params, BatchNorm running statistics (made from global-batch statistics) and every curve."""
    p0, p1 = runs["two"]
    assert any("BatchNorm_0']['mean" in k for k in p0)
    _assert_close(p0, runs["one"], "image_")
    _assert_close(p1, runs["one"], "image_")


def test_checkpoint_of_two_processes_resumes_in_two_and_in_one(runs):
    """Stopped after 2 of 3 epochs by two processes, resumed to the end: equal to the unbroken run."""
    whole = runs["whole"]
    assert whole["image_test_error"].shape == (3,)
    for resumed in (*runs["resumed_two"], runs["resumed_one"]):
        _assert_close(resumed, whole, "image_")


def _assert_reads_own_blocks(results):
    """The training source's reads: process i of P read rows [i*16/P, (i+1)*16/P) of every batch of 16 of
    the epoch's order, nothing else; the test source's (12 per batch, 16 examples): rows [i*12/P,
    (i+1)*12/P) of each batch that has them."""
    from tests.multiprocess_worker import BATCH, sources

    train, _ = sources()
    count = len(results)
    order = np.concatenate([train.order(e, seed=0) for e in range(2)])  # fit(0): data seed 0
    size, test_size = BATCH // count, 12 // count
    for i, r in enumerate(results):
        want = [order[b * BATCH:(b + 1) * BATCH][size * i:size * (i + 1)] for b in range(2 * (64 // BATCH))]
        assert list(r["train_reads_sizes"]) == [size] * len(want)
        np.testing.assert_array_equal(r["train_reads"], np.concatenate(want))
        test_want = [np.arange(16)[0:12][test_size * i:test_size * (i + 1)],
                     np.arange(16)[12:16][test_size * i:test_size * (i + 1)]] * 2
        np.testing.assert_array_equal(r["test_reads"], np.concatenate([w for w in test_want if len(w)]))
    first_batch = [set(r["train_reads"][:size]) for r in results]
    assert len(set().union(*first_batch)) == BATCH  # the blocks are disjoint and make up the batch


def test_each_process_reads_only_its_block(runs):
    _assert_reads_own_blocks(runs["two"])


def test_four_processes_equal_one(runs, four):
    """The first stage in 4 processes (4 devices in all): sweep and data-parallel training as one process,
    each process reading its quarter of every batch."""
    out, _, log, _ = four
    results = [_loaded(os.path.join(out, f"first-{i}.npz"), log) for i in range(4)]
    assert [int(r["process_count"]) for r in results] == [4] * 4
    for r in results:
        _assert_close(r, runs["one"], "sweep_")
        _assert_close(r, runs["one"], "image_")
    _assert_reads_own_blocks(results)


def test_a_stop_request_in_one_process_stops_all_at_the_epoch_end(runs, two_first, two_resumed):
    """SIGTERM reaches process 1 alone, in epoch 2 (its 6th of 8 training reads; 4 batches an epoch):
    both processes finish the epoch, save it and exit 143; resumed in two processes, the run ends equal
    to the unbroken one."""
    two, rc, log = two_first
    assert "process 1 sends itself SIGTERM" in log, log[-3000:]
    assert rc == 143, log[-3000:]
    assert re.search(r"\[launch\] process 0 exited with status 143", log), log[-3000:]
    from resjax.train.checkpoint import Checkpoints

    with Checkpoints(os.path.join(two, "preempted")) as ckpt:
        meta = ckpt.meta()
    assert (meta["epoch"], meta["batch"]) == (2, 0)  # saved at the end of epoch 2, not inside it
    for i in (0, 1):
        _assert_close(_loaded(os.path.join(two, f"resume-preempted_for_two-{i}.npz"), two_resumed[1]),
                      runs["whole"], "image_")


@pytest.mark.parametrize("victim", [0, 1])
def test_a_dying_process_stops_the_others(request, victim):
    """Process ``victim`` exits in the middle of training (process 0 runs the coordination service; it dies
    among 4 processes, process 1 among 2); every other must stop with an error by itself within the heartbeat
    timeout (10 s) plus slack, not hang. The launcher's own grace period is set far longer (300 s) so that it
    does not do the stopping."""
    if victim == 0:
        _, rc, log, seconds = request.getfixturevalue("four")
        others = (1, 2, 3)
    else:
        rc, log, seconds = request.getfixturevalue("two_resumed")
        others = (0,)
    assert f"worker: process {victim} dies now" in log, log[-3000:]
    assert rc == 3, log[-3000:]  # the first failure's status is passed through
    for other in others:
        stopped = re.search(rf"\[launch\] process {other} exited with status (-?\d+), ([\d.]+) s after", log)
        assert stopped, log[-3000:]
        assert int(stopped.group(1)) != 0
        assert float(stopped.group(2)) < 60, log[-3000:]
    assert "stopping" not in log  # the launcher did not have to terminate it
    assert seconds < 300


def test_experiment_files_are_written_by_process_zero_only(tmp_path, monkeypatch):
    """Run as process 1 of 2, an experiment writes nothing: no folder, no results, no figure."""
    from experiments import batchnorm_example, common

    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    out = tmp_path / "out"
    common.check_out_dir(out)
    results = common.run_experiment(batchnorm_example, batchnorm_example.get_config("quick"), out)
    assert results["metrics"] and not out.exists()


def test_launched_experiment_writes_what_one_process_writes(tmp_path):
    """``experiments.launch`` of 2 processes against the experiment's command line run in this (one) process,
    with as many devices as a process of its own would have (one per core)."""
    from experiments import batchnorm_example, common

    one, two = tmp_path / "one", tmp_path / "two"
    common.main(batchnorm_example, ["--quick", "--out", str(one)])
    rc, log = _run([sys.executable, "-m", "experiments.launch", "--processes", "2", "--", "batchnorm_example",
                    "--quick", "--out", str(two)], _env())
    assert rc == 0, log[-3000:]
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert json.loads((two / "results.json").read_text())["metrics"] == \
        json.loads((one / "results.json").read_text())["metrics"]
    assert re.findall(r"^\[(\d)\] batchnorm_example: wrote", log, re.M) == ["0"]


def test_launcher_refuses_bad_settings(capsys):
    with pytest.raises(SystemExit):
        launch.parse(["--processes", "0", "--", "python", "x.py"])
    assert "--processes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.parse(["--processes", "2"])
    assert "nothing to run" in capsys.readouterr().err
    from experiments import launch as experiments_launch

    with pytest.raises(SystemExit, match="unknown experiment 'nosuch'"):
        experiments_launch.command_for(["nosuch", "--quick"])


def test_launcher_passes_the_exit_status_through():
    code = "import os, sys; sys.exit(4 if os.environ['JAX_PROCESS_ID'] == '1' else 0)"
    assert launch.launch([sys.executable, "-c", code], 2, grace=5) == 4
    ok = "import os; assert os.environ['JAX_NUM_PROCESSES'] == '3' and os.environ['JAX_COORDINATOR_ADDRESS']"
    assert launch.launch([sys.executable, "-c", ok], 3) == 0
