"""Runs that live in a bucket (issue #50), against real local servers started by the tests (``tests/buckets.py``):
a GCS emulator (``gs://``) and an S3 server (``s3://``, where conditional writes are honoured).

- A library ``fit`` (both feeders) checkpointed and logged to ``gs://``, stopped by SIGTERM, resumed by the same
  command in a new process with a new working directory and empty local caches (another VM): bit-identical to a run
  that was never stopped.
- One run per bucket folder: a second run is refused naming the first; a lock whose lease ran out is taken over
  with a message; processes racing for one folder on S3 never share it.
- Errors before training: a scheme with no installed file system, an endpoint that does not answer, a bucket that
  does not exist, each one ValueError naming the setting and the URL.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from resjax.paths import as_path, check_url
from resjax.train.lock import LOCK_FILE, DirectoryLock, LockHeldError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _child(tmp_path, name, *args, stop=None):
    """``tests/bucket_child.py`` in a new process whose working directory, compilation cache and resjax cache are
    new and empty (another machine); returns the finished process."""
    home = tmp_path / name
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESJAX_CACHE": str(home / "cache"),
           "JAX_COMPILATION_CACHE_DIR": str(home / "jax"), "RESJAX_COMPILATION_CACHE": str(home / "jax")}
    cmd = [sys.executable, str(ROOT / "tests" / "bucket_child.py"), *args] + ([str(stop)] if stop else [])
    return subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=300)


def _history(done) -> dict:
    line = next(line for line in done.stdout.splitlines() if line.startswith("history "))
    return json.loads(line[len("history "):])


# Broken on purpose: Checkpoints.steps() with os.listdir (the old local-only listing) -> the resumed process finds
# no checkpoint in the bucket and trains from the start (exit 0, but the stopped run's lines are logged twice).
@pytest.mark.parametrize("feeder", ["ondevice", "host"])
def test_a_run_stopped_on_one_machine_resumes_from_the_bucket_on_another_bit_identically(gcs, tmp_path, feeder):
    url = gcs.url(feeder)
    unbroken = _child(tmp_path, "unbroken", feeder, gcs.url("unbroken"))
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    stopped = _child(tmp_path, "vm1", feeder, url, stop=1)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert not (tmp_path / "vm1" / "gs:").exists()  # nothing written to a local folder named after the URL
    steps = sorted(int(p.name) for p in as_path(url).iterdir() if p.name.isdigit())
    assert steps, list(as_path(url).iterdir())
    resumed = _child(tmp_path, "vm2", feeder, url)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _history(resumed) == _history(unbroken)  # every metric of both seeds, bit for bit (JSON of float32s)
    lines = [json.loads(line) for line in (as_path(url) / "metrics.jsonl").read_text().splitlines()]
    assert sorted((row["run"], row["epoch"]) for row in lines) == [(r, e) for r in (0, 1) for e in (1, 2, 3)]
    assert not (as_path(url) / LOCK_FILE).exists()  # the finished run gave its lock up


def test_a_second_run_into_a_bucket_folder_is_refused_naming_the_first(gcs, tmp_path):
    url = gcs.url("second")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from resjax.train.lock import DirectoryLock; "
                               "lock = DirectoryLock(sys.argv[1]).acquire(); print('held', flush=True); "
                               "time.sleep(120)", url], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from resjax.data import from_arrays
        from resjax.train import make_train, run_config, train_config
        from tests.small_data import separable_arrays

        trainer = make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config(batch_size=16,
                                                                                            epochs=1)),
                             from_arrays(*separable_arrays(32, (6,))))
        with pytest.raises(LockHeldError, match=rf"checkpoint_dir: {url} is in use by process {holder.pid} on host "
                                                rf".*lease was renewed \d+ s ago; if that run is gone, the lock is "
                                                rf"taken over 60 s after its last renewal, or remove {url}/{LOCK_FILE}"):
            trainer.fit(0, checkpoint_dir=url)
        assert [p.name for p in as_path(url).iterdir()] == [LOCK_FILE]  # nothing of the second run written
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("store", ["gcs", "s3"])
def test_a_lock_whose_lease_ran_out_is_taken_over_with_a_message(store, request, capsys):
    server = request.getfixturevalue(store)
    url = server.url("lease")
    lost = {"pid": 4242, "host": "a-lost-vm", "started": "then", "token": "lost", "lease_s": 0.5}
    (as_path(url) / LOCK_FILE).write_text(json.dumps(lost))
    time.sleep(1.5)
    with DirectoryLock(url, "out") as lock:
        held = json.loads((as_path(url) / LOCK_FILE).read_text())
        assert held["token"] == lock.token and held["pid"] == os.getpid()
    assert "taking over the lock of" in capsys.readouterr().err
    assert not (as_path(url) / LOCK_FILE).exists()


def test_a_live_lease_is_renewed_and_the_lock_kept(s3, monkeypatch):
    """With a lease of 1.5 s renewed every 0.5 s, the lock is still refused to a second run 3 s later."""
    monkeypatch.setenv("RESJAX_LOCK_LEASE_S", "1.5")
    url = s3.url("renew")
    with DirectoryLock(url, "out"):
        time.sleep(3)
        with pytest.raises(LockHeldError, match="is in use by process"):
            DirectoryLock(url, "out").acquire()


# Broken on purpose: _put without its precondition (an unconditional write) -> rounds with several holders.
def test_racing_runs_never_share_a_bucket_folder(s3):
    """4 processes lock one S3 folder at the same instant, 12 rounds (half beginning with a lock whose lease ran
    out, which all of them try to take over): every round exactly one holds it."""
    from tests import lock_racer

    rounds, racers, root = 12, 4, s3.url("race")
    for r in range(0, rounds, 2):
        (as_path(root) / f"round{r}" / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "gone", "token": "t",
                                                                          "lease_s": 0.01}))
    holders = lock_racer.holders_per_round(root, rounds, racers)
    assert all(n == 1 for n in holders.values()), holders


# ---- errors before training ---------------------------------------------------------------------------------


def test_a_url_with_no_installed_file_system_names_the_scheme():
    with pytest.raises(ValueError, match=r"^checkpoint_dir: nosuchfs://b/run: no file system for nosuchfs:// URLs"):
        as_path("nosuchfs://b/run", "checkpoint_dir")


def test_a_bucket_that_does_not_exist_is_named(gcs):
    with pytest.raises(ValueError, match=r"^out: gs://no-such-bucket/run: the bucket no-such-bucket does not exist"):
        check_url("gs://no-such-bucket/run", "out")


def test_a_read_only_bucket_and_refused_credentials_are_named(s3_reader, monkeypatch):
    """On a server that checks credentials: a user who may only read passes the check of an input (``write=False``)
    and is refused, naming the URL and the credentials, as an output; unknown keys are named as refused, not as a
    missing bucket."""
    check_url("s3://read-only-bucket/data", "data_dir", write=False)
    with pytest.raises(ValueError, match=r"^out: s3://read-only-bucket/run: cannot write into the bucket "
                                         r"read-only-bucket \(the credentials were refused or are missing"):
        check_url("s3://read-only-bucket/run", "out")
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ValueError, match=r"^out: s3://read-only-bucket/run: the bucket read-only-bucket cannot be "
                                         r"read \(the credentials were refused or are missing"):
        check_url("s3://read-only-bucket/run", "out")


def test_an_endpoint_that_does_not_answer_is_named_before_anything_compiles(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    done = subprocess.run([sys.executable, "-c", "from resjax.paths import check_url; check_url('gs://b/run', 'out')"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"ValueError: out: gs://b/run: the storage endpoint 127.0.0.1:{port} cannot be reached" in done.stderr


# ---- experiments with --out in a bucket ----------------------------------------------------------------------


# Broken on purpose: experiments.flags parsing --out with pathlib.Path -> a local folder named "gs:" is written and
# nothing reaches the bucket.
def test_an_experiment_stopped_and_resumed_in_a_bucket_equals_the_same_run_on_a_local_folder(gcs, tmp_path, capsys,
                                                                                             monkeypatch):
    """``degradation --quick --out gs://...`` stopped by SIGTERM inside a cell, then the same command again in a new
    working directory with empty caches: exit 0, and its results equal those of the same run on a local folder
    (``tools/compare_results.py``, reading both)."""
    from tests import test_resume_experiments
    from tests.test_resume_experiments import DEGRADATION, _in_process, _signal_at

    # its processes reach the GCS server (that module took its environment when it was imported)
    monkeypatch.setattr(test_resume_experiments, "ENV", {**os.environ, "PYTHONPATH": str(ROOT)})

    url = gcs.url("degradation")
    local = tmp_path / "local"
    _in_process(capsys, DEGRADATION, local)
    rc, output = _signal_at(DEGRADATION, url, "[B=64 plain_d2] epoch 1/12")
    assert rc == 143 and "resjax: stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    assert not (ROOT / "gs:").exists()
    assert [p.name for p in (as_path(url) / "checkpoints").iterdir()]  # the cells' checkpoints are in the bucket
    home = tmp_path / "vm2"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESJAX_CACHE": str(home / "cache")}
    again = subprocess.run([sys.executable, *DEGRADATION, "--out", url], cwd=home, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming the run of this config from its checkpoints in {url}/checkpoints" in again.stdout
    assert (as_path(url) / "degradation.png").read_bytes()[:4] == b"\x89PNG"
    same = subprocess.run([sys.executable, str(ROOT / "tools" / "compare_results.py"), str(local), url], cwd=home,
                          env=env, capture_output=True, text=True, timeout=300)
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-2000:]


def test_experiments_compare_reads_runs_in_a_bucket(gcs, tmp_path):
    from experiments import compare

    url = gcs.url("compare")
    for name, error in (("a", 1.5), ("b", 2.5)):
        (as_path(url) / name / "results.json").write_text(json.dumps(
            {"experiment": "x", "config": {"lr": error}, "metrics": {"final_error": [error]}, "seconds": 1.0}))
    assert compare.load_run(f"{url}/a")["metrics"] == {"final_error": [1.5]}
    assert compare.main([f"{url}/a", f"{url}/b", "--out", str(tmp_path / "c.png")]) == 0


# ---- TFDS data in a bucket ------------------------------------------------------------------------------------


# Broken on purpose: load_image_dataset without local_copy -> tfds.data_source is given the URL (ArrayRecord
# cannot open it), and the copy is not there.
def test_a_tfds_data_dir_in_a_bucket_is_copied_once_into_the_local_cache_and_read_there(gcs, tmp_path, monkeypatch,
                                                                                          capsys):
    """A prepared data set in ``gs://`` (here the suite's committed TFDS metadata): found through the path layer,
    copied once into ``$RESJAX_CACHE/tfds`` with every byte equal, read from there; a second load copies nothing."""
    from resjax.data import load_image_dataset
    from resjax.paths import filesystem
    from tests.tfds_mock import META, mocked_tfds

    url = gcs.url("tfds")
    fs, inner = filesystem(url)
    for f in META.rglob("*"):
        if f.is_file() and f.suffix != ".py":
            fs.pipe_file(f"{inner}/{f.relative_to(META).as_posix()}", f.read_bytes())
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path / "cache"))
    with mocked_tfds():
        source = load_image_dataset("cifar10", "test", data_dir=url)
        assert len(source) == 10000
    copied = sorted((tmp_path / "cache" / "tfds").rglob("cifar10/3.0.2/*"))
    assert [p.name for p in copied] == ["dataset_info.json", "features.json"]
    assert all(p.read_bytes() == (META / "cifar10" / "3.0.2" / p.name).read_bytes() for p in copied)
    assert "copying" in capsys.readouterr().err
    with mocked_tfds():
        load_image_dataset("cifar10", "test", data_dir=url)
    assert "copying" not in capsys.readouterr().err  # nothing copied again


def test_a_grid_checkpoints_its_programs_into_a_bucket_and_reads_them_back(gcs):
    """``fit_grid(..., checkpoint_dir=gs://...)``: ``grid.json`` and one folder per program in the bucket; the same
    call again loads every program from there (nothing trained) and returns the same history."""
    import numpy as np

    from resjax.data import from_arrays
    from resjax.train import make_train, run_config, train_config
    from resjax.train.grid import fit_grid, grid
    from tests.small_data import separable_arrays

    url = gcs.url("grid")
    trainer = make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config(batch_size=16, epochs=1)),
                         from_arrays(*separable_arrays(32, (6,))))
    g = grid([0], {"train.batch_size": [8, 16]})
    first = fit_grid(trainer, g, checkpoint_dir=url)
    assert sorted(p.name for p in as_path(url).iterdir()) == ["grid.json", "train.batch_size=16",
                                                               "train.batch_size=8"]
    assert json.loads((as_path(url) / "grid.json").read_text())["axes"]["train.batch_size"] == [8, 16]
    again = fit_grid(trainer, g, checkpoint_dir=url)
    for name in ("train_loss", "test_error"):
        np.testing.assert_array_equal(np.asarray(first.history[name]), np.asarray(again.history[name]))


def test_a_checkpoint_written_by_two_processes_to_a_bucket_resumes_in_two_and_in_one(gcs, tmp_path):
    """Two processes (``resjax.launch``) train data-parallel for 2 of 3 epochs with one checkpoint in ``gs://``;
    the run is resumed to its end by two processes and, from a copy of that checkpoint, by one: both equal the
    unbroken run (``tests/test_multiprocess.py``'s worker and tolerance)."""
    from tests import test_multiprocess as mp

    url, out = gcs.url("two"), str(tmp_path)
    rc, log, _ = mp._launch(f"first:{url},copy:{url}={url}-one,resume:{url}", out)
    assert rc == 0, log[-4000:]
    from resjax.train.checkpoint import Checkpoints

    with Checkpoints(f"{url}-one") as ckpt:  # the copy holds the two processes' checkpoint of epoch 2 of 3
        assert ckpt.meta()["epoch"] == 2
    rc, one_log = mp._one(f"whole,resume:{url}-one", out)
    assert rc == 0, one_log[-4000:]
    name = url.rsplit("/", 1)[1]
    whole = mp._load(os.path.join(out, "whole-0.npz"))
    resumed = [mp._loaded(os.path.join(out, f"resume-{name}-{i}.npz"), log) for i in (0, 1)]
    assert [int(r["process_count"]) for r in resumed] == [2, 2]
    for r in (*resumed, mp._loaded(os.path.join(out, f"resume-{name}-one-0.npz"), one_log)):
        mp._assert_close(r, whole, "image_")


def _scalars(data: bytes) -> dict:
    """``{tag: [(step, value)]}`` of a TensorBoard event file's bytes (TFRecord framing: length, its CRC, the
    Event proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    found, at = {}, 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
        at += 12 + length + 4
        for value in event.summary.value:
            found.setdefault(value.tag, []).append((event.step, round(value.simple_value, 6)))
    return found


# Broken on purpose: RunLog's SummaryWriter given the URL (tensorboardX's own gs:// writer) -> ImportError
# "`google-cloud-storage` must be installed" at the first write.
def test_tensorboard_event_files_of_a_run_reach_the_bucket_with_its_numbers(gcs, monkeypatch):
    """``log=gs://...`` with ``tensorboard=True``: the event files are in the bucket after each epoch's write, through
    the same path layer as the checkpoints, and hold every number of the metrics file; a resumed process's file
    comes beside the first. As a user's ``resjax[cloud,tensorboard]`` install has it: without google-cloud-storage
    (tensorboardX's own gs:// writer needs it; the tests' GCS server brings it into this environment)."""
    import tensorboardX.record_writer

    from resjax.train.monitor import RunLog

    monkeypatch.setattr(tensorboardX.record_writer, "GCS_ENABLED", False)

    url = gcs.url("tensorboard")
    for first, losses in ((0, [[0.5, 0.25]]), (2, [[0.125]])):  # two epochs, then a resumed process's third
        log = RunLog(url, cell="run", tensorboard=True)
        log.write(first, {"loss": losses})
        assert [p.name for p in as_path(url).iterdir() if p.name.startswith("events.out.tfevents")]  # before close
        log.close()
        time.sleep(1.1)  # tensorboardX names an event file by the second it was opened
    files = sorted(p for p in as_path(url).iterdir() if p.name.startswith("events.out.tfevents"))
    assert len(files) == 2
    merged = {}
    for f in files:
        for tag, points in _scalars(f.read_bytes()).items():
            merged.setdefault(tag, []).extend(points)
    assert merged["run/loss/run0"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert set(merged) == {"run/loss/run0", "run/elapsed_s/run0"}
