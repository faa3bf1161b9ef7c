"""Experiments checkpoint their training and resume it (issue #22 item 1, ``experiments.checkpoints``): a real
process stopped by SIGTERM saves and exits 143 printing the command that resumes; the same command again resumes
(finished cells load, the interrupted one goes on) and ends with the results and ``metrics.jsonl`` of an
unbroken run; a stop before training says nothing was trained; ``reproduce`` skips finished experiments.

Each test names the mutation it catches ("Mutation caught: ...")."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from experiments import checkpoints, common, files, reproduce
from resjax.train.lock import LOCK_FILE

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
sys.path.insert(0, str(ROOT / "tools"))
from compare_results import compare_values  # noqa: E402

# Two small cells, 12 epochs in chunks of one (a chunk ends, and can be saved, after every epoch; the signal sent
# after the first lands well inside the cell), one seed.
DEGRADATION = ["-m", "experiments.degradation", "--quick", "--cells", "plain:2,plain:8", "--train.epochs", "12",
               "--chunk_epochs", "1", "--num_seeds", "1", "--pack_cells", "false"]


def _in_process(capsys, args, out, *extra) -> str:
    """``python args --out out`` run in this process (the entry point's own ``main``, as ``-m`` runs it): its
    stdout. A JAX process costs seconds to start and to build its programs again; the runs whose promise is about
    a process of their own (signalled, or their exit status and stderr) stay real processes (``_run``,
    ``_signal_at``)."""
    import importlib

    module = importlib.import_module(args[1])
    argv = [*args[2:], "--out", str(out), *extra]
    capsys.readouterr()
    if module is reproduce:
        reproduce.main(argv)
    else:
        common.main(module, argv)
    return capsys.readouterr().out


def _run(args, out, *extra):
    return subprocess.run([sys.executable, *args, "--out", str(out), *extra], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


def _default_signals() -> None:
    """In the child, before it runs: SIGINT and SIGTERM at their defaults. A suite started in the background by a
    shell (``cmd &``) inherits SIGINT ignored, and a process that starts with a signal ignored rightly keeps ignoring
    it (Python installs no KeyboardInterrupt, the experiments no handler): as a user's terminal would, the child
    starts with both signals live."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def _signal_at(args, out, marker: str, signum=signal.SIGTERM, *extra):
    """Start ``python args --out out``, send ``signum`` when a line of its output (stdout or stderr) contains
    ``marker``; ``(returncode, output)``. Both streams are read through the same file objects, in threads, so no
    line is lost (#22 item 8)."""
    child = subprocess.Popen([sys.executable, *args, "--out", str(out), *extra], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    lines, lock, sent = [], threading.Lock(), threading.Event()

    def read(stream):
        for line in stream:
            with lock:
                lines.append(line)
            if marker in line and not sent.is_set():
                sent.set()
                child.send_signal(signum)

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in (child.stdout, child.stderr)]
    for r in readers:
        r.start()
    try:
        child.wait(timeout=600)
        for r in readers:
            r.join(timeout=30)
    finally:
        child.kill()
    assert sent.is_set(), "".join(lines)[-3000:]
    return child.returncode, "".join(lines)


def _resume_command(args, out):
    """The line that says how to resume (the library's, in a cell: '... from it:'; between cells: '...:')."""
    command = f"{sys.executable} {' '.join(args)} --out {out}"
    return re.compile(r"Run the same command again to resume( from it)?:\n  " + re.escape(command) + "\n")


def _log(path):
    """``{(cell, run, epoch): metrics}`` of a metrics.jsonl (timings left out), and how many lines it has."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    table = {(r["cell"], r["run"], r["epoch"]): {k: v for k, v in r.items() if k not in ("elapsed_s", "time")}
             for r in rows}
    return table, len(rows)


# Mutations caught: experiments/checkpoints.py `sweeps`: `sweep(**job(), ...)` -> `job()["trainer"].sweep(...)`
# (no checkpoint: the SIGTERM kills the run with no save and no message); experiments/runner.py
# `_run_experiment`: `log_to(..., fresh=not resuming)` -> `fresh=True` (the resumed run's metrics.jsonl loses the
# lines of the epochs trained before the stop); resjax/train/ondevice.py `sweep`: `log.start(done, history)` ->
# `log.start(done)` (a cell loaded from its final checkpoint into a new metrics.jsonl leaves its epochs out).
def test_a_stopped_experiment_resumes_from_its_checkpoints_and_ends_as_an_unbroken_run(tmp_path, capsys):
    """The stopped run is a real process; the unbroken reference and the runs of the same command again run in
    this process."""
    _in_process(capsys, DEGRADATION, tmp_path / "unbroken", "--checkpoint_dir", "none")
    assert not (tmp_path / "unbroken" / "checkpoints").exists()  # --checkpoint_dir none: nothing saved

    out = tmp_path / "run"
    rc, output = _signal_at(DEGRADATION, out, "[B=64 plain_d2] epoch 1/12")
    assert rc == 128 + signal.SIGTERM, output[-3000:]
    assert "resjax: stopped by SIGTERM after epoch" in output and "Traceback" not in output, output[-3000:]
    assert _resume_command(DEGRADATION, out).search(output), output[-3000:]
    assert not (out / "results.json").exists() and not (out / LOCK_FILE).exists()
    stopped_seconds = json.loads((out / "checkpoints" / ".run-degradation.json").read_text())["seconds"]
    assert stopped_seconds > 0  # the stopped session's time, kept for the session that resumes it (#53)
    cells = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    # with two devices (one per core) the two cells train side by side: both were in progress, both saved
    side_by_side = (os.cpu_count() or 1) > 1
    assert [c.split("-")[0] for c in cells] == ["B=64_plain_d2", "B=64_plain_d8"][1 - side_by_side:], cells
    before = {(r["cell"], r["run"], r["epoch"]): r["time"] for r in map(json.loads, open(out / "metrics.jsonl"))}
    assert before and {cell for cell, _, _ in before} <= {"B=64 plain_d2", "B=64 plain_d8"}

    said = _in_process(capsys, DEGRADATION, out)
    assert re.search(r"^\[B=64 plain_d8\] epoch 12/12 ", said, re.M), said  # its progress lines are in `said`
    assert f"degradation: resuming the run of this config from its checkpoints in {out / 'checkpoints'}" in said, said
    assert ("degradation: [B=64 plain_d2] resuming from its checkpoint at epoch" in said
            or "degradation: [B=64 plain_d2] finished in an earlier run" in said), said
    assert json.loads((out / "results.json").read_text())["seconds"] > stopped_seconds  # every session's time
    resumed = json.loads((out / "results.json").read_text())["metrics"]
    unbroken = json.loads((tmp_path / "unbroken" / "results.json").read_text())["metrics"]
    assert resumed.keys() == unbroken.keys()
    for name in unbroken:
        if "seconds" not in name:
            assert compare_values(resumed[name], unbroken[name])[0], (name, resumed[name], unbroken[name])
    table, count = _log(out / "metrics.jsonl")
    ref_table, ref_count = _log(tmp_path / "unbroken" / "metrics.jsonl")
    assert count == len(table) == ref_count == 2 * 12  # 2 cells x 1 seed x 12 epochs, each once
    assert table == ref_table
    kept = {(r["cell"], r["run"], r["epoch"]): r["time"] for r in map(json.loads, open(out / "metrics.jsonl"))}
    assert {k: kept[k] for k in before} == before  # the lines of the epochs saved at the stop: kept, not rewritten

    # a finished run, again: every cell comes from its final checkpoint; a new metrics.jsonl gets every epoch back
    (out / "metrics.jsonl").unlink()
    (out / "checkpoints" / ".run-degradation.json").unlink()  # as if made by another config: metrics.jsonl anew
    third = _in_process(capsys, DEGRADATION, out)
    assert third.count("finished in an earlier run: its results come from its final checkpoint") == 2
    assert "epoch 1/12" not in third  # nothing trained
    assert _log(out / "metrics.jsonl") == (ref_table, ref_count)


# Mutation caught: experiments/runner.py `main`: `with checkpoints.stop_signals(module.NAME):` removed (a SIGINT
# before the first cell finished gave a KeyboardInterrupt traceback, or a bare exit by the signal).
def test_a_stop_before_training_says_nothing_was_trained(tmp_path, capsys):
    out = tmp_path / "run"
    _in_process(capsys, DEGRADATION, out, "--cells", "plain:2", "--train.epochs", "1")  # results to replace
    # run again with --fresh: it announces the results it will replace, then sets up its first cell
    rc, output = _signal_at(DEGRADATION, out, "exists and will be replaced", signal.SIGINT, "--cells", "plain:2",
                            "--train.epochs", "1", "--fresh")
    assert rc == 128 + signal.SIGINT, output[-3000:]
    assert "degradation: stopped by SIGINT before training started: nothing was trained yet, so nothing was saved." \
        in output, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert not (out / LOCK_FILE).exists()  # the output folder's lock was given up


# Broken on purpose: experiments/__init__.py installing no handler while an entry point starts: the SIGINT inside
# JAX's import is a KeyboardInterrupt traceback (status -2); this test fails.
def test_a_stop_while_an_entry_point_imports_is_one_line_and_130(tmp_path):
    """Ctrl-C while ``python -m experiments.<name>`` is still importing (the signal sent as the first module of
    JAX's finishes importing, ``-X importtime`` lines being the marker): status 130 and the entry point's one line,
    no ``KeyboardInterrupt`` traceback. (A library imported into someone's own program leaves Ctrl-C to that
    program: ``import resjax`` installs no handler, ``tests/test_import_hygiene.py``.)"""
    rc, output = _signal_at(["-X", "importtime", *DEGRADATION], tmp_path / "run", "jax._src", signal.SIGINT)
    assert rc == 128 + signal.SIGINT, output[-3000:]
    lines = [line for line in output.splitlines() if not line.startswith("import time:")]
    assert lines == ["degradation: stopped by SIGINT while starting: nothing was trained yet, so nothing was "
                     "saved."], output[-3000:]


def test_reproduce_skips_finished_experiments_and_resumes_the_interrupted_one(tmp_path, capsys):
    """The interrupted run is a real process; the same command again, and once more, run in this process. One
    process (``--jobs 1``), so that batch_noise has finished when tau_training trains: with --quick's default of two
    processes side by side, the signal could stop batch_noise too, on a loaded machine (``tests/test_reproduce_jobs.py``
    signals a run of several processes)."""
    args = ["-m", "experiments.reproduce", "--quick", "--jobs", "1", "--only", "batch_noise", "tau_training"]
    rc, output = _signal_at(args, tmp_path, "[tau_training] epoch 1/1")  # the first chunk: the whole tau cell
    assert rc == 128 + signal.SIGTERM, output[-3000:]
    assert _resume_command(args, tmp_path).search(output), output[-3000:]
    assert (tmp_path / "batch_noise" / "results.json").exists() and not (tmp_path / "tau_training" / "results.json").exists()
    said = _in_process(capsys, args, tmp_path)
    assert "reproduce: [1/2] batch_noise finished earlier with this config: reusing" in said, said  # not run again
    assert "reproduce: [2/2] running tau_training" in said and "tau_training: resuming the run of this config" in said
    assert "tau_training: [L=4 tau] finished in an earlier run" in said, said
    assert "[tau_training] epoch 1/1" not in said  # the interrupted cell was not trained again
    assert (tmp_path / "REPORT.md").exists()
    third = _in_process(capsys, args, tmp_path, "--reuse")  # kept for old command lines; finished ones are reused
    assert third.count("finished earlier with this config: reusing") == 2


# ---- in-process: the cell folders and the settings ---------------------------------------------------------


def test_a_cell_folder_is_keyed_by_everything_that_decides_the_cell(tmp_path, capsys):
    """The same cell resumes from its folder; another seed, learning rate or epoch count gets another folder (it
    never meets an old checkpoint); checkpoint_every does not change it (a resumed run may save more often)."""
    from resjax.train import make_train
    from tests.test_training import DATA, tiny_config

    trainer = make_train(tiny_config(), DATA)
    with checkpoints.session(tmp_path, "fake", {"a": 1}):
        def folder(keys, hparams=None, epochs=None, t=trainer):
            return checkpoints.cell_dir("c", *checkpoints.sweep_settings(t, keys, hparams, epochs))

        base = folder([0, 1])
        assert base.parent == tmp_path and base.name.startswith("c-") and folder([0, 1]) == base
        others = {folder([0, 2]), folder([0, 1], {"learning_rate": [0.1, 0.2]}), folder([0, 1], epochs=2)}
        config = tiny_config()
        config.train.momentum = 0.9
        others.add(folder([0, 1], t=make_train(config, DATA)))
        assert base not in others and len(others) == 4
        config = tiny_config()
        config.train.checkpoint_every = 1
        assert folder([0, 1], t=make_train(config, DATA)) == base
        _, m1 = checkpoints.sweep(trainer, [0, 1], cell="c")
        _, m2 = checkpoints.sweep(trainer, [0, 1], cell="c")
        assert "fake: [c] finished in an earlier run" in capsys.readouterr().out
        np.testing.assert_array_equal(m1["test_error"], m2["test_error"])
    assert checkpoints.current() is None


def test_checkpoint_dir_flag_is_checked_by_the_preflight(tmp_path, capsys):
    from experiments import batch_noise

    (tmp_path / "file").write_text("")
    for value, message in ((str(tmp_path / "file"), "is a file, not a folder"),
                           (str(tmp_path / "file" / "sub"), "is a file, not a folder"),
                           ("", "an empty path")):
        with pytest.raises(SystemExit) as exit_:
            common.parse_args(batch_noise, ["--quick", "--out", str(tmp_path / "out"), "--checkpoint_dir", value],
                              check=True)
        assert exit_.value.code == 2
        assert f"argument --checkpoint_dir: " in capsys.readouterr().err
    options = {}
    common.parse_args(batch_noise, ["--quick", "--out", str(tmp_path / "out"), "--checkpoint_dir", "none", "--fresh"],
                      check=True, options=options)
    assert options == {"checkpoint_dir": "none", "fresh": True}
    assert checkpoints.resolve("none", tmp_path) is None and checkpoints.resolve(None, tmp_path) == tmp_path / "checkpoints"


def test_a_stop_outside_a_cell_names_what_is_saved(monkeypatch):
    """The message of a stop the library does not handle (between cells, or in a cell with hooks)."""
    stop = checkpoints._Stop("exp")
    stop.signum = signal.SIGTERM
    monkeypatch.setattr(checkpoints, "_FINISHED", [0])
    assert stop.message() == "exp: stopped by SIGTERM before training started: nothing was trained yet, so nothing " \
                             "was saved."
    with checkpoints.session(None, "exp") as s:  # a cell setting up is named (#53)
        s.current = "B=64 plain_d8"
        assert stop.message() == "exp: stopped by SIGTERM before [B=64 plain_d8] started training: nothing was " \
                                 "trained yet, so nothing was saved."
    monkeypatch.setattr(checkpoints, "_FINISHED", [2])
    with checkpoints.session(pathlib.Path("/x/ckpt"), "exp") as s:
        s.current, s.current_saved = "hooked", False
        text = stop.message()
    assert text.startswith("exp: stopped by SIGTERM; the training cells finished so far are saved in /x/ckpt "
                           "(the cell in progress, hooked, measures inside its run")
    assert "Run the same command again to resume:\n  " in text
    with checkpoints.session(None, "exp"):
        assert "checkpoints are off (--checkpoint_dir none)" in stop.message()


def test_results_being_written_are_finished_before_a_stop(tmp_path, monkeypatch):
    """A stop signal while results.json and the figures are written waits for them, then exits."""
    exits = []
    monkeypatch.setattr(checkpoints._Stop, "exit", lambda self: exits.append(self.signum))

    def run(config, out_dir):
        return {"x": 1}

    module = types.SimpleNamespace(NAME="fake", run=run, get_config=lambda size="default": None)
    with checkpoints.stop_signals("fake"):
        stop = checkpoints._STOPS[-1]
        real = files.write_atomically

        def write(path, fn):
            if path.name == "results.json":
                stop._handle(signal.SIGTERM, None)  # the signal arrives while the results are written
                assert not exits
            real(path, fn)

        monkeypatch.setattr(files, "write_atomically", write)
        common.run_experiment(module, {}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["metrics"] == {"x": 1}
    assert exits == [signal.SIGTERM]


# Mutations caught: experiments/checkpoints.py `session` not reading the marker's seconds back (s.earlier stays 0):
# the resumed run's results.json says 8 s, as in #53, not 195 s; `_Stop.exit` not saving them (a session ended by a
# signal between cells counts for nothing: 190 s); `session` not saving them as it ends (a session ended by a
# Preempted or an error counts for nothing).
def test_a_resumed_runs_seconds_are_those_of_every_session(tmp_path, monkeypatch):
    """Three sessions of one run on a clock of the test's: stopped by an exception (a ``Preempted``) after 182 s,
    by a stop signal between cells after 5 s, then resumed to its end in 8 s: results.json says 195 s. A session
    with ``--fresh`` counts alone. No training: the cells are ``fit_dir``'s bookkeeping alone."""
    from experiments import runner

    clock = types.SimpleNamespace(now=1000.0)
    fake_time = types.SimpleNamespace(time=lambda: clock.now)
    monkeypatch.setattr(checkpoints, "time", fake_time)
    monkeypatch.setattr(runner, "time", fake_time)
    monkeypatch.setattr(checkpoints, "_FINISHED", [0])
    trainer = types.SimpleNamespace(steps_per_epoch=1,
                                    config=types.SimpleNamespace(train=types.SimpleNamespace(epochs=1)))

    class Stopped(Exception):
        pass

    def session(seconds, end):
        def run(config, out_dir):
            checkpoints.fit_dir("c", "c", trainer)  # a checkpointed cell begins (the marker is written)
            clock.now += seconds
            if end == "signal":
                stop = checkpoints._Stop("fake")
                stop.signum = signal.SIGTERM
                stop.exit()  # (os._exit raises Stopped here)
            if end == "error":
                raise Stopped
            checkpoints.cell_done()
            return {"x": 1}

        module = types.SimpleNamespace(NAME="fake", run=run, get_config=lambda size="default": None)
        return common.run_experiment(module, {"a": 1}, tmp_path, fresh=end == "fresh")

    at_exit = []

    def exit_(status):  # os._exit: what the marker holds as the process would end (no finally block runs after it)
        at_exit.append(json.loads((tmp_path / "checkpoints" / ".run-fake.json").read_text())["seconds"])
        raise Stopped

    monkeypatch.setattr(checkpoints.os, "_exit", exit_)
    for end in ("error", "signal"):
        with pytest.raises(Stopped):
            session({"error": 182, "signal": 5}[end], end)
    assert at_exit == [187.0]
    assert session(8, "done")["seconds"] == 195.0
    assert json.loads((tmp_path / "results.json").read_text())["seconds"] == 195.0
    assert session(3, "fresh")["seconds"] == 3.0  # --fresh: a run of its own


# Mutation caught: experiments/checkpoints.py `sweep`: `checkpoint_dir=directory` -> `checkpoint_dir=None` (an
# experiment's cells were not checkpointed, and --train.checkpoint_every did nothing, as before #22).
def test_checkpoint_every_saves_an_experiment_cell_that_often(tmp_path):
    from resjax.train import make_train
    from tests.test_training import DATA, tiny_config

    config = tiny_config()  # 3 epochs
    config.train.checkpoint_every, config.train.checkpoint_keep = 1, 5
    trainer = make_train(config, DATA)
    with checkpoints.session(tmp_path, "fake", {}):
        checkpoints.sweep(trainer, [0, 1], cell="every epoch")
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folder.name.startswith("every_epoch-")
    assert sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) == [
        trainer.checkpoint_step(e) for e in (1, 2, 3)]
    marker = json.loads((tmp_path / ".run-fake.json").read_text())
    assert marker.pop("seconds") > 0 and marker == {"experiment": "fake", "config": {}}


# Mutation caught: experiments/runner.py: `unusable_checkpoints_end_the_run(module.NAME)` dropped from `main` (the
# refusal ends in a Python traceback again, no word on how to go on).
def test_unusable_checkpoints_end_the_run_with_the_message_and_how_to_go_on(tmp_path, capsys):
    """Every step of a finished cell damaged: the same command again exits 1 with resjax's message naming the cell's
    folder and saying how to train it again, and no traceback; with --fresh the run trains and ends. (The run
    that checkpoints and the one with --fresh run in this process; the refused one is a process of its own.)"""
    from tests.test_faults import _flip

    # the cell of the stop-before-training test's first run (its programs are on disk already)
    args = [*DEGRADATION, "--cells", "plain:2", "--train.epochs", "1", "--ablations", "false"]
    out = tmp_path / "out"
    _in_process(capsys, args, out)
    (cell,) = [p for p in (out / "checkpoints").iterdir() if p.is_dir()]
    steps = [p for p in cell.iterdir() if p.name.isdigit()]
    assert steps
    for step in steps:
        _flip(str(step))
    again = _run(args, out)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "no step in this directory is good" in again.stderr and f"remove {cell}" in again.stderr, again.stderr
    assert "--fresh" in again.stderr and "Traceback" not in again.stderr, again.stderr[-3000:]
    _in_process(capsys, args, out, "--fresh")  # returns (no SystemExit): the run trains and ends
