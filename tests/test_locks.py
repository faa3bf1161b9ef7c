"""One run per directory (``resjax.train.lock``, issue #22 item 4): a checkpoint directory or output folder in
use by a running process is refused at the start, naming the directory and the process; a stale lock (its
process gone) is taken over; a directory that cannot be written is named before any training."""

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from experiments import common
from resjax.data import from_arrays
from resjax.train import make_train, run_config, train_config
from resjax.train.lock import LOCK_FILE, DirectoryLock
from tests.small_data import separable_arrays

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _trainer():
    data = from_arrays(*separable_arrays(32, (6,)))
    return make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config(batch_size=16, epochs=1)),
                      data)


def _lock_as(directory, pid):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then"}))


def test_a_directory_a_running_process_trains_into_is_refused(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_as(tmp_path / "ckpt", other.pid)
        with pytest.raises(ValueError, match=rf"checkpoint_dir: .*ckpt is in use by process {other.pid}"):
            _trainer().fit(0, checkpoint_dir=tmp_path / "ckpt")  # mutation: no lock in open_checkpoints -> trains
        assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name != LOCK_FILE]  # nothing written
        _lock_as(tmp_path / "out", other.pid)
        module = type("M", (), {"NAME": "fake", "run": staticmethod(lambda config, out: {})})
        with pytest.raises(ValueError, match=rf"out: .*out is in use by process {other.pid}"):
            common.run_experiment(module, {}, tmp_path / "out")
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_and_a_finished_run_leaves_none(tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lock_as(tmp_path, int(gone.stdout))
    _, history = _trainer().fit(0, checkpoint_dir=tmp_path)
    assert history["epochs"] == 1 and "taking over the stale lock" in capsys.readouterr().err
    assert not (tmp_path / LOCK_FILE).exists()
    with DirectoryLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["host"] == socket.gethostname()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_checkpoint_dir_that_is_a_file_is_named_before_training(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="checkpoint_dir: cannot write into"):
        _trainer().fit(0, checkpoint_dir=tmp_path / "f")
    np.testing.assert_equal((tmp_path / "f").read_text(), "")


def test_a_refused_resume_gives_the_lock_up(tmp_path):
    """A run refused after locking (resume=False on a directory that holds checkpoints) leaves no lock behind:
    found by CI, when a refused damaged-checkpoint resume left ``.resjax.lock`` in the directory."""
    trainer = _trainer()
    trainer.fit(0, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        trainer.fit(0, checkpoint_dir=tmp_path, resume=False)
    assert not (tmp_path / LOCK_FILE).exists()


# ---- issue #54: a lock two runs can never share ---------------------------------------------------------------


def _dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


# Broken on purpose (see the closing note of #54): the lock file created with O_EXCL and then written (the old
# acquisition) -> rounds with two holders; the takeover of a stale lock outside the directory's flock -> rounds
# with two holders among those that begin with a stale lock.
def test_racing_processes_never_share_a_lock(tmp_path):
    """4 processes lock one folder at the same instant, 120 rounds (half of them begin with a stale lock, of a
    process that has ended, that all of them find and try to take over): every round exactly one holds it."""
    from tests import lock_racer

    rounds, racers = 120, 4
    stale = _dead_pid()
    for r in range(0, rounds, 2):
        _lock_as(tmp_path / f"round{r}", stale)
    holders = lock_racer.holders_per_round(str(tmp_path), rounds, racers)
    assert all(n == 1 for n in holders.values()), {r: n for r, n in holders.items() if n != 1}
    assert not list(tmp_path.glob(f"round*/{LOCK_FILE}"))  # every winner gave it up
    assert not list(tmp_path.glob("round*/.resjax.lock.*.tmp"))  # no holder's record left behind


def test_a_lock_file_is_never_seen_before_it_is_whole(tmp_path, monkeypatch):
    """The lock file appears only with its whole record in it: a reader at the instant of creation (here: right
    after the name appears, before anything else runs) finds the holder's JSON, never an empty file."""
    import os as _os

    seen = []
    link = _os.link

    def watched_link(src, dst, *a, **k):
        link(src, dst, *a, **k)
        seen.append(pathlib.Path(dst).read_text())

    monkeypatch.setattr(_os, "link", watched_link)
    with DirectoryLock(tmp_path):
        pass
    assert len(seen) == 1 and json.loads(seen[0])["pid"] == _os.getpid()


def test_another_hosts_lock_is_refused_naming_the_file_to_remove(tmp_path):
    """A lock from another host cannot be checked: refused, naming the lock file to remove if that run is gone,
    by the library and by the experiments' lock (which keeps that advice), with nothing taken over."""
    from resjax.train.lock import LockHeldError

    record = {"pid": 4242, "host": "another-host.example", "started": "then", "token": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(LockHeldError, match=rf"in use by process 4242 on host another-host.example .*if that run "
                                            rf"is gone, remove {tmp_path / LOCK_FILE}$"):
        DirectoryLock(tmp_path).acquire()
    with pytest.raises(common.FolderInUseError, match=rf"remove {tmp_path / LOCK_FILE}$"):
        common.lock_folder(tmp_path, "out").__enter__()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == record  # untouched


def test_an_unreadable_lock_is_refused_unless_its_age_proves_it_stale(tmp_path, capsys):
    """An empty or damaged lock file (an older resjax's, cut short) is refused naming the file while it is young;
    older than UNREADABLE_STALE_S it is reported and taken over."""
    import os as _os
    import time

    from resjax.train.lock import UNREADABLE_STALE_S, LockHeldError

    path = tmp_path / LOCK_FILE
    path.write_text("")
    with pytest.raises(LockHeldError, match=rf"lock file that cannot be read \({path}, 0 bytes"):
        DirectoryLock(tmp_path).acquire()
    assert path.read_text() == ""
    old = time.time() - UNREADABLE_STALE_S - 5
    _os.utime(path, (old, old))
    with DirectoryLock(tmp_path) as lock:
        assert json.loads(path.read_text())["token"] == lock.token
    assert "taking over the unreadable lock" in capsys.readouterr().err


def test_release_leaves_another_runs_lock_alone(tmp_path):
    """A lock given up removes the lock file only while it is its own (its token): a lock that was taken over
    meanwhile stays."""
    lock = DirectoryLock(tmp_path).acquire()
    theirs = {"pid": 1, "host": socket.gethostname(), "started": "now", "token": "theirs"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(theirs))
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == theirs
