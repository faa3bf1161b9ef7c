"""One run per directory (``resjax.train.lock``, issue #22 item 4): a checkpoint directory or output folder in
use by a running process is refused at the start, naming the directory and the process; a stale lock (its
process gone) is taken over; a directory that cannot be written is named before any training."""

import json
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
