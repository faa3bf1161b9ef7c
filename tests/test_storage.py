"""Storage that refuses a write (issue #54 items 3-5): a full disk, a read-only file system, an unreadable
``metrics.jsonl``, and results and reports written whole or not at all.

The full and read-only disks are real: small ``tmpfs`` file systems mounted by the tests (root on the project's
machines and CI); where mounting is not allowed the tests that need one are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import common
from resjax.data import from_arrays
from resjax.train import make_train, run_config, train_config
from resjax.train.storage import StorageError
from tests.small_data import separable_arrays

pytestmark = pytest.mark.usefixtures("fast_compiles")
ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size_kb, read_only=False) -> folder``: a tmpfs of that size at a new folder; unmounted at the end."""
    mounted = []

    def mount(size_kb: int, read_only: bool = False, at: pathlib.Path | None = None) -> pathlib.Path:
        folder = at or tmp_path / f"disk{len(mounted)}"
        folder.mkdir(exist_ok=True)
        options = f"size={size_kb}k" + (",ro" if read_only else "")
        if folder in mounted:
            done = subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], capture_output=True, text=True)
        else:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                                  text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small file system here ({done.stderr.strip()})")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _fill(disk: pathlib.Path) -> None:
    """Write into ``disk`` until it is full."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 1024)
        except OSError:
            pass


def _trainer(epochs=6):
    data = from_arrays(*separable_arrays(64, (6,)))
    config = run_config(dict(kind="plain_mlp", depth=2, width=64),
                        train_config(batch_size=16, epochs=epochs, checkpoint_every=1))
    return make_train(config, data)


def test_a_disk_full_from_the_start_is_named_before_training(small_disk, capfd):
    """A full disk is seen by the lock's write probe (it writes bytes, not an empty file): one StorageError naming
    the setting and the folder, before anything compiles."""
    disk = small_disk(16)
    _fill(disk)
    with pytest.raises(StorageError, match=rf"^checkpoint_dir: could not write into {disk / 'ck'} while checking that "
                                           r"it can be written: no space is left on its disk \(\d+ kB free\); free "
                                           r"some space there or choose another folder\.$") as err:
        _trainer().fit(0, checkpoint_dir=disk / "ck")
    assert err.value.errno == 28


# Broken on purpose: Checkpoints.save without its StorageError (the except clause re-raising) -> Orbax's ValueError
# RESOURCE_EXHAUSTED and the writer threads' tracebacks on stderr.
def test_a_disk_that_fills_up_stops_the_run_with_one_error_and_it_resumes_bit_identically(tmp_path, small_disk,
                                                                                            capfd):
    """The first checkpoint fits, the second does not: one StorageError naming the folder, the step and the intact
    previous checkpoint, none of Orbax's thread tracebacks, and Orbax's partial step removed. Once there is room,
    the same call resumes from that checkpoint and ends bit-identical to a run that was never stopped."""
    trainer = _trainer()
    _, reference = trainer.fit(0, checkpoint_dir=tmp_path / "reference")
    # a step's blocks (a tmpfs takes a whole page for each small file); keep=2: two steps fit, the third does not
    step_kb = sum(f.stat().st_blocks * 512 for f in (tmp_path / "reference" / "24").rglob("*") if f.is_file()) // 1024
    disk = small_disk(int(step_kb * 2.5))
    capfd.readouterr()
    with pytest.raises(StorageError, match=r"^checkpoint_dir: could not write into .* while saving step \d+: no "
                                           r"space is left on its disk .*; the previous checkpoint \(step \d+\) is "
                                           r"intact, and the same command resumes from it once there is room\.$"):
        trainer.fit(0, checkpoint_dir=disk / "ck")
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-2000:]
    assert all(p.name.isdigit() for p in (disk / "ck").iterdir())  # the intact steps, and nothing partial
    small_disk(4 * step_kb + 64, at=disk)  # room made
    _, resumed = trainer.fit(0, checkpoint_dir=disk / "ck")
    for name, values in reference.items():
        np.testing.assert_array_equal(np.asarray(resumed[name]), np.asarray(values), err_msg=name)


def test_a_read_only_disk_is_named_with_what_to_change(small_disk):
    disk = small_disk(64, read_only=True)
    with pytest.raises(StorageError, match=r"^out: could not write into .* it is on a read-only file system; "
                                           r"choose a folder on a writable disk\.$"):
        common.lock_folder(disk / "out", "out").__enter__()


def test_the_command_line_says_one_line_on_a_full_disk(small_disk):
    """``python -m experiments.<name> --out <full disk>``: exit 1, one line naming the folder and what to do, no
    traceback."""
    disk = small_disk(16)
    _fill(disk)
    done = subprocess.run([sys.executable, "-m", "experiments.batchnorm_example", "--quick", "--out",
                           str(disk / "out")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"batchnorm_example: out: could not write into {disk / 'out'} while checking that it "
                                "can be written: no space is left on its disk"), done.stderr[-3000:]


# Broken on purpose: _lines without its check of each line -> the text that is not JSON is dropped without a word
# (the 'text' case: no "cannot be read" line, nothing set aside).
@pytest.mark.parametrize("damage", ["bytes", "folder", "text"])
def test_an_unreadable_metrics_file_is_set_aside_and_the_run_resumes(tmp_path, capfd, damage):
    """A metrics.jsonl with bytes that are not UTF-8, a line of text that is not a JSON record (not a last line
    cut short by a kill), or a folder in its place is set aside, named, and the resumed run writes its epochs
    again from its checkpoint: the new file holds every epoch, as the first run wrote them."""
    trainer = _trainer(epochs=2)
    trainer.fit(0, checkpoint_dir=tmp_path / "ck", log=tmp_path, progress=False)
    path = tmp_path / "metrics.jsonl"
    first = [{k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "time")}
             for line in path.read_text().splitlines()]
    if damage == "bytes":
        path.write_bytes(b'{"cell": "run", "epoch": 1}\n\xff\xfe\x00 not text\n')
    elif damage == "text":
        path.write_text('{"cell": "run", "epoch": 1}\nsomething else written here\n')
    else:
        path.unlink()
        path.mkdir()
    capfd.readouterr()
    trainer.fit(0, checkpoint_dir=tmp_path / "ck", log=tmp_path, progress=False)
    err = capfd.readouterr().err
    aside = tmp_path / "metrics.jsonl.unreadable"
    assert f"log: {path} cannot be read" in err and f"set aside as {aside}" in err, err
    assert aside.is_dir() if damage == "folder" else aside.read_bytes().startswith(b'{"cell"')
    again = [{k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "time")}
             for line in path.read_text().splitlines()]
    assert again == first and len(first) == 2


# ---- results written whole or not at all ------------------------------------------------------------------------


class _Interrupted(BaseException):
    pass


def _half_then_stop(text: str):
    def write(tmp: pathlib.Path) -> None:
        with open(tmp, "w") as f:
            f.write(text[: len(text) // 2])
            f.flush()
            raise _Interrupted  # a stop in the middle of the write

    return write


# Broken on purpose: write_atomically writing into the path itself -> the half-written file is left.
def test_an_interrupted_results_write_leaves_the_old_file_or_none(tmp_path):
    from experiments import files

    path = tmp_path / "results.json"
    with pytest.raises(_Interrupted):
        files.write_atomically(path, _half_then_stop(json.dumps({"new": list(range(100))})))
    assert not path.exists() and not list(tmp_path.iterdir())
    path.write_text('{"old": 1}')
    with pytest.raises(_Interrupted):
        files.write_atomically(path, _half_then_stop(json.dumps({"new": list(range(100))})))
    assert path.read_text() == '{"old": 1}' and list(tmp_path.iterdir()) == [path]


def test_results_and_report_go_through_the_atomic_write(tmp_path, monkeypatch):
    """``results.json`` (runner) and ``REPORT.md`` (reproduce, under its signal guard) are written by
    ``write_atomically``: an interrupted write of either leaves the old file."""
    from experiments import files, reproduce, runner

    calls = []
    real = files.write_atomically

    def stopped(path, write, *a, **k):
        calls.append(pathlib.Path(path).name)
        return real(path, lambda tmp: (write(tmp), _half_then_stop("x" * 100)(tmp)), *a, **k)

    monkeypatch.setattr(files, "write_atomically", stopped)
    monkeypatch.setattr(common, "write_atomically", stopped)
    (tmp_path / "results.json").write_text("old results")
    module = type("M", (), {"NAME": "fake"})
    with pytest.raises(_Interrupted):
        runner._write_results(module, {}, tmp_path, {"m": 1.0}, 0.0, [])
    assert (tmp_path / "results.json").read_text() == "old results"
    (tmp_path / "REPORT.md").write_text("old report")
    for name in reproduce.REGISTRY[:1]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"experiment": name, "config": {}, "metrics": {}, "seconds": 1.0}))
    with pytest.raises(_Interrupted):
        reproduce.rebuild_report(tmp_path, names=reproduce.REGISTRY[:1])
    assert (tmp_path / "REPORT.md").read_text() == "old report"
    assert calls == ["results.json", "REPORT.md"]


# Broken on purpose: the refusal of non-finite floats (preflight.check_finite) removed -> the command trains and
# exits 0 with NaN results.
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_the_preflight_refuses_a_non_finite_setting_before_anything_runs(tmp_path, bad):
    done = subprocess.run([sys.executable, "-m", "experiments.batchnorm_example", "--quick", "--delta", bad, "--out",
                           str(tmp_path / "out")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"delta: must be a finite number, got {float(bad)!r}" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out" / "results.json").exists()
