"""``--fresh`` (and anything else that deletes) takes the folder's lock first (issue #32 item 4): while another run
holds the output folder, the checkpoint root or a cell's folder, a ``--fresh`` run into it is refused with a
message naming that run's process (id, host, command), exits 1, and nothing of the running run is removed.

The running run is a stand-in (``_HOLDER``, a real process): ``run_experiment`` of a module whose ``run`` makes a
cell with a checkpoint step through the session (as a training cell does), holds the cell's lock as a trainer
does, and also holds the lock of a second root's cell (a library run training there alone), until told to end.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
import types

import pytest

from experiments import checkpoints, common, files
from resjax.train.lock import LOCK_FILE

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

_HOLDER = '''
import pathlib, sys, time, types
from experiments import checkpoints, common
from resjax.train.lock import DirectoryLock

out, root, other_cell, ready, stop = map(pathlib.Path, sys.argv[1:6])

def run(config, out_dir):
    cell = checkpoints.named_dir("cell")
    (cell / "7").mkdir(parents=True)
    (cell / "7" / "state").write_text("step 7")
    with DirectoryLock(cell), DirectoryLock(other_cell):  # as a trainer holds its cell's folder
        (other_cell / "3").mkdir()
        ready.write_text("ready")
        while not stop.exists():
            time.sleep(0.05)
    return {}

common.run_experiment(types.SimpleNamespace(NAME="holder", run=run), {}, out, checkpoint_dir=root)
'''


@pytest.fixture(scope="module")
def holder(tmp_path_factory):
    """The running run: ``(process, paths)``; the folders it holds are locked while the module's tests run."""
    tmp = tmp_path_factory.mktemp("locks")
    paths = types.SimpleNamespace(out=tmp / "out", root=tmp / "shared_checkpoints", other_root=tmp / "library_run",
                                  ready=tmp / "ready", stop=tmp / "stop", script=tmp / "holder_run.py")
    paths.script.write_text(_HOLDER)
    process = subprocess.Popen([sys.executable, str(paths.script), str(paths.out), str(paths.root),
                                str(paths.other_root / "cell"), str(paths.ready), str(paths.stop)], cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not paths.ready.exists():
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail(f"the holder did not start: {process.communicate()[0][-3000:]}")
        time.sleep(0.1)
    try:
        yield process, paths
    finally:
        paths.stop.write_text("")
        try:
            process.wait(timeout=60)
        finally:
            process.kill()


def _holders_files(paths) -> list[str]:
    """Every file of the running run's checkpoint folders (what a --fresh run must leave alone)."""
    return sorted(str(p.relative_to(paths.root.parent)) for r in (paths.root, paths.other_root) for p in r.rglob("*"))


def _fresh_module(ran: list):
    def run(config, out_dir):  # what a --fresh run does with its cell: empties it (the session's named_dir)
        ran.append(checkpoints.named_dir("cell"))
        return {}

    return types.SimpleNamespace(NAME="fresh", run=run)


def _expect_refusal(err, setting: str, directory: pathlib.Path, process) -> None:
    text = str(err)
    assert text.startswith(f"{setting}: {directory} is in use by process {process.pid} on host "
                           f"{socket.gethostname()} (since "), text
    assert "holder_run.py" in text and "nothing in it was changed" in text, text  # the command that holds it
    assert err.holder["pid"] == process.pid and "holder_run.py" in err.holder["command"]


# Mutation caught: experiments/runner.py `run_experiment` without the output folder's lock: the run is refused
# only later, by the checkpoint root's lock, and names checkpoint_dir, not the output folder (this test and the
# command-line test fail on the message).
def test_fresh_into_the_output_folder_of_a_running_run_is_refused(holder, tmp_path):
    process, paths = holder
    before, ran = _holders_files(paths), []
    assert "shared_checkpoints/cell/7/state" in before
    with pytest.raises(files.FolderInUseError) as err:
        common.run_experiment(_fresh_module(ran), {}, paths.out, checkpoint_dir=paths.root, fresh=True)
    _expect_refusal(err.value, "out", paths.out, process)
    assert not ran and _holders_files(paths) == before


# Mutations caught: experiments/checkpoints.py, delete then lock: `session` does not lock the root at its start and
# `named_dir` locks it only after emptying the cell: refused by the cell's lock instead (fails on the message);
# with `_empty` also removing without the cell's lock, the running run's cell is emptied (fails: nothing raised).
def test_fresh_into_the_checkpoint_folder_of_a_running_run_is_refused(holder, tmp_path):
    process, paths = holder
    before, ran = _holders_files(paths), []
    with pytest.raises(files.FolderInUseError) as err:  # another output folder, the same checkpoint folder
        common.run_experiment(_fresh_module(ran), {}, tmp_path / "out", checkpoint_dir=paths.root, fresh=True)
    _expect_refusal(err.value, "checkpoint_dir", paths.root, process)
    assert not ran and _holders_files(paths) == before
    assert not (tmp_path / "out" / "results.json").exists()


# Mutation caught: experiments/checkpoints.py `_empty` removing the cell's contents without taking its lock first
# (as `shutil.rmtree(directory)` did before #32): the library run's checkpoint step is deleted (nothing raised).
def test_fresh_does_not_empty_a_cell_folder_another_process_trains_in(holder, tmp_path):
    process, paths = holder
    before, ran = _holders_files(paths), []
    with pytest.raises(files.FolderInUseError) as err:  # the root is free; its cell folder is not
        common.run_experiment(_fresh_module(ran), {}, tmp_path / "out", checkpoint_dir=paths.other_root, fresh=True)
    _expect_refusal(err.value, "checkpoint_dir", paths.other_root / "cell", process)
    assert _holders_files(paths) == before and (paths.other_root / "cell" / "3").is_dir()
    assert not (paths.other_root / LOCK_FILE).exists()  # the refused run gave its root's lock up


def test_the_command_line_refuses_with_one_line_and_status_75(holder):
    """``python -m experiments.<name> --fresh --out <a running run's folder>``: exit 75 (``EX_TEMPFAIL``: a restart
    loop tries again later), one line naming the running
    process and its command, no traceback; the running run's files all there (#32: both exited 0 and the
    running run's checkpoints were gone)."""
    process, paths = holder
    before = _holders_files(paths)
    done = subprocess.run([sys.executable, "-m", "experiments.batchnorm_example", "--quick", "--fresh", "--out",
                           str(paths.out), "--checkpoint_dir", str(paths.root)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 75, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"batchnorm_example: out: {paths.out} is in use by process {process.pid} on host" in done.stderr
    assert "holder_run.py" in done.stderr and _holders_files(paths) == before
    assert process.poll() is None  # the running run goes on


# Mutation caught: experiments/checkpoints.py `_lock_root` without `_ROOT_LOCK` (cells of a sweep beginning in
# several threads): a thread finds the root locked by its own process and "takes over the stale lock".
def test_cells_beginning_in_several_threads_lock_the_root_once(tmp_path, capfd):
    import threading

    gate, dirs = threading.Barrier(8), []

    def begin(k):
        gate.wait()
        dirs.append(checkpoints.named_dir(f"cell{k}"))

    with checkpoints.session(tmp_path / "root", "threads", {}) as s:
        assert not (tmp_path / "root").exists()  # no folder before the first cell: a run that never trains makes none
        threads = [threading.Thread(target=begin, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(dirs) == 8 and s.lock is not None and (tmp_path / "root" / LOCK_FILE).is_file()
    assert not (tmp_path / "root" / LOCK_FILE).exists()  # given up when the session ends
    assert "stale" not in capfd.readouterr().err
