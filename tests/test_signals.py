"""Stop and watch from the first second (issue #32 item 3): a SIGINT or SIGTERM at any moment of ``fit`` ends
with exit status 130/143 and one line saying what was kept, never a segmentation fault and never swallowed;
the on-device feeder reports (progress, ``metrics.jsonl``) every few seconds by default, a run not depending on
its chunking; a convolutional model on the on-device feeder on the CPU is named slow, once, with the fix."""

import json
import os
import signal
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest

from resjax.data import from_arrays
from resjax.train import make_image_train, make_train, run_config, train_config
from resjax.train import ondevice
from resjax.train.ondevice import SlowFeederWarning, _Chunks
from resjax.train.preemption import Preempted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTHING = "before training started: nothing was trained yet, so nothing was saved."


def _data(n=48, shape=(4,), classes=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n + 16, *shape)).astype(np.float32)
    y = (x.reshape(len(x), -1)[:, 0] > 0).astype(np.int32) % classes
    return from_arrays(x[:n], y[:n], x[n:], y[n:], num_classes=classes)


def _config(epochs=3, **model):
    return run_config(model or dict(kind="plain_mlp", width=8, depth=2),
                      train_config(batch_size=16, epochs=epochs, learning_rate=0.05))


def _children(phase: str, trials: int, signals: str) -> list[dict]:
    """Run ``tests/signal_child.py`` (see there): one JSON result per forked child. Every child compiles its own
    programs: no persistent compilation cache (the run's would hand the second child its programs from disk)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "RESJAX_COMPILATION_CACHE")}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "signal_child.py"), phase, str(trials), signals],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _stopped_cleanly(result: dict) -> None:
    name = signal.Signals(result["signum"]).name
    out = result["out"]
    assert result["rc"] == 128 + result["signum"], (result["rc"], out[-2000:])  # -11 would be a segfault
    assert out.splitlines()[-1] == f"resjax: stopped by {name} {NOTHING}", out[-2000:]
    assert "Traceback" not in out and "Exception ignored" not in out and "fit returned" not in out, out[-2000:]


# Broken on purpose: StopSignals.__enter__ installing nothing (the signal is Python's KeyboardInterrupt again):
# children crash (exit -11) or print a traceback; this test fails.
def test_sigint_during_the_first_compilation_stops_cleanly_10_times_in_a_row():
    """10 children, each sent SIGINT within 0.8 s of its model's first trace (make_train's shape
    inference, then fit's tracing, lowering and XLA compilation of its first program)."""
    results = _children("compile", 10, "SIGINT")
    assert len(results) == 10
    for result in results:
        _stopped_cleanly(result)


# Broken on purpose: experiments.checkpoints._Stop.ends_process = False (the trainer keeps a signal that finds nothing
# trained until the compilation ends, as before #53): each child exits SLOW = 30 s after the signal; this test fails.
# (StopSignals.ends_at_once ignoring ``trained``, the other way round, fails test_resume_experiments' stop after
# epoch 1, which then saves nothing.)
def test_sigint_during_a_long_first_compilation_of_an_entry_point_exits_at_once():
    """An entry point's run (the experiments' handlers, whose first signal ends the process) signalled while its
    first training program compiles, a compilation that lasts 30 s more (``tests/signal_child.py``, ``slow-*``):
    nothing was trained, so it exits at once, 130 and the entry point's one line, long before the compilation
    would have ended; on both feeders. (Measured on a real compilation, a 200-layer MLP on the 2-core CPU: 31 s
    from the signal to the exit before, 0.14 s after.)"""
    from tests.signal_child import SLOW

    results = _children("slow-host,slow-on-device", 2, "SIGINT")
    assert [r["phase"] for r in results] == ["slow-host", "slow-on-device"]
    for result in results:
        out = result["out"]
        assert result["rc"] == 130 and "compiling" in out and "compiled" not in out, (result["rc"], out[-2000:])
        assert out.splitlines()[-1] == f"child: stopped by SIGINT {NOTHING}", out[-2000:]
        assert "Traceback" not in out and "fit returned" not in out, out[-2000:]
        assert result["exit_s"] < SLOW / 3, result  # at once: well before the compilation ends


def test_fit_runs_no_program_before_its_stop_signals_are_open(monkeypatch):
    """The window the test above samples: between ``make_train`` returning (its own handlers closed) and the sweep's
    ``StopSignals`` opening, ``fit`` ran ``seed_handles`` (PRNG keys made on the device: small programs compiled
    on first use), and a SIGINT there was Python's KeyboardInterrupt from inside XLA's compilation (seen once on a
    slow 2-core CPU, exit -2). Every seed handling now happens with the handlers open."""
    from resjax.train.core import asks_for_seed_axis
    from resjax.train.preemption import StopSignals

    handlers = []
    real = ondevice.seed_handles

    def watched(*args, **kwargs):
        handlers.append(getattr(signal.getsignal(signal.SIGINT), "__self__", None))
        return real(*args, **kwargs)

    monkeypatch.setattr(ondevice, "seed_handles", watched)
    trainer = make_train(_config(epochs=1), _data())
    for keys in (3, [3, 4]):
        handlers.clear()
        trainer.fit(keys)
        assert handlers and all(isinstance(h, StopSignals) for h in handlers), handlers
    assert [asks_for_seed_axis(k) for k in (3, np.int64(3), [3], (3, 4), np.array([3, 4]))] == [False] * 2 + [True] * 3
    assert asks_for_seed_axis(jax.random.key(0)) is False and asks_for_seed_axis(jax.random.split(jax.random.key(0)))


def test_sigint_or_sigterm_during_the_data_checks_stops_cleanly():
    """The host feeder's fit, signalled while its training source checks the first batch."""
    results = _children("checks", 2, "SIGINT,SIGTERM")
    assert [r["signum"] for r in results] == [signal.SIGINT, signal.SIGTERM]
    for result in results:
        _stopped_cleanly(result)


class KillOnTrace(nn.Module):
    """A small MLP that, while ``ARMED`` (``[signum, traces to let pass]``), sends this process ``signum`` when
    it is traced (inside ``fit``: the signal arrives while the run's programs are being built, before any
    step): at its first trace there (the initialisation's) or, letting one pass, in the first training
    program's."""

    ARMED = []

    @nn.compact
    def __call__(self, x, train: bool = False):
        if self.ARMED:
            signum, skip = self.ARMED[0]
            self.ARMED[0][1] -= 1
            if not skip:
                self.ARMED.clear()
                os.kill(os.getpid(), signum)
        return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))


@pytest.fixture
def handlers():
    """The SIGINT/SIGTERM handlers before the test; checked to be back after it (a library leaves none behind)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    assert {s: signal.getsignal(s) for s in before} == before
    KillOnTrace.ARMED.clear()


# Broken on purpose: the check after setting up removed from Trainer._sweep (the signal is noted and the run goes
# on to the check after compiling its first program, which compiled for nothing): [on-device-init] fails;
# the check after compiling a program removed: [on-device-first program] fails (likewise ImageTrainer._fit's).
@pytest.mark.parametrize("feeder", ["on-device", "host"])
@pytest.mark.parametrize("skip", [0, 1], ids=["init", "first program"])
# Broken on purpose: the feeders' stopping() not passing their progress label to StopSignals.untrained: the line of
# a labelled call names no call (issue #53: it read as if about the next line's cell, saved); [.. first program] fails.
def test_a_signal_while_fit_builds_its_programs_stops_before_any_step(feeder, skip, handlers, capsys):
    make = make_train if feeder == "on-device" else make_image_train
    trainer = make(_config(), _data(), model=KillOnTrace())
    KillOnTrace.ARMED.append([signal.SIGTERM, skip])
    label = f"{feeder} cell" if skip else None  # a call with a progress label (an experiment's cell) is named
    with pytest.raises(Preempted) as stopped:
        trainer.fit(0, progress=label)
    assert stopped.value.code == 143 and stopped.value.checkpoint_dir is None
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"resjax: stopped by SIGTERM {NOTHING}" if label is None else
        f"resjax: stopped by SIGTERM before [{label}] started training: nothing of it was trained yet, so nothing of "
        "it was saved.")
    if feeder == "on-device" and skip == 0:  # stopped before building (and compiling) its first training program
        assert [kind for kind, *_ in trainer._programs] == ["init"]  # the initialiser's alone


# Broken on purpose: StopSignals.hand_on calling nothing: the caller's handler is never called; this test fails.
def test_a_callers_own_handler_gets_a_signal_that_finds_nothing_to_save(handlers):
    """The experiments' entry points install handlers of their own (they print their message and exit): a
    signal before the first step (nothing of this call to save) is handed on to them."""
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        trainer = make_train(_config(), _data(), model=KillOnTrace())
        KillOnTrace.ARMED.append([signal.SIGINT, 0])
        with pytest.raises(Preempted) as stopped:
            trainer.fit(0)
        assert calls == [signal.SIGINT] and stopped.value.code == 130
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_resumed_run_signalled_before_its_first_step_stays_saved(tmp_path, handlers, capsys):
    config = _config(epochs=4)
    make_train(config, _data(), model=KillOnTrace()).fit(0, epochs=2, checkpoint_dir=tmp_path)
    trainer = make_train(config, _data(), model=KillOnTrace())  # a new trainer traces its programs again
    KillOnTrace.ARMED.append([signal.SIGINT, 0])
    with pytest.raises(Preempted) as stopped:
        trainer.fit(0, checkpoint_dir=tmp_path)
    err = capsys.readouterr().err
    steps = 2 * trainer.steps_per_epoch
    assert stopped.value.code == 130 and stopped.value.step == steps
    assert (f"resjax: stopped by SIGINT before training resumed: nothing was trained in this call; the run stays "
            f"saved in {tmp_path} (epoch 2, step {steps})") in err, err
    from resjax.train import checkpoint as ckpt_lib
    assert ckpt_lib.latest(tmp_path) == steps


# Broken on purpose: Trainer._sweep raising stop.untrained() for a run without checkpoints after its first chunk:
# the message says nothing was trained; this test fails (and the host case likewise in ImageTrainer._fit).
@pytest.fixture(scope="module")
def mlps():
    """The plain MLP's trainer (3 epochs) of each feeder, shared by the tests below that train it: a trainer keeps
    its compiled programs, nothing of a call (each ``fit`` is a run of its own)."""
    return {"on-device": make_train(_config(), _data()), "host": make_image_train(_config(), _data())}


@pytest.mark.parametrize("feeder", ["on-device", "host"])
def test_a_signal_after_training_without_a_checkpoint_dir_says_the_training_is_lost(feeder, handlers, capsys, mlps):
    trainer = mlps[feeder]
    kwargs = {"chunk_epochs": 1} if feeder == "on-device" else {}
    label = "host cell" if feeder == "host" else None  # a labelled call is named (sweeps side by side each say theirs)
    with pytest.raises(Preempted) as stopped:
        trainer.fit(0, callback=lambda done, summary: os.kill(os.getpid(), signal.SIGINT), progress=label, **kwargs)
    assert stopped.value.code == 130 and stopped.value.checkpoint_dir is None
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"resjax: stopped by SIGINT after epoch 1 of 3{'' if label is None else f' of [{label}]'}; nothing was saved "
        "(no checkpoint_dir), so the training of this call is lost (pass checkpoint_dir= to keep it).")


# ---- the on-device feeder's default chunks ----------------------------------------------------------------


# Broken on purpose: _Chunks.next returning `limit` when the cut is nearer than k + 2 (a one-epoch tail chunk): the
# tail expected fails.
def test_default_chunks_are_chosen_from_the_measured_epoch_time():
    fixed = _Chunks(10, 4)
    assert [fixed.next(d, 0) for d in (0, 4, 8)] == [4, 4, 2] and fixed.next(0, 3) == 3
    auto = _Chunks(1000, None)
    assert auto.next(0, 0) == 2  # the first chunk: two epochs, timed
    auto.compiled(0.5)
    auto.ran(2, 0.02, 998)  # 10 ms an epoch: chunks of CHUNK_SECONDS of training
    k = int(ondevice.CHUNK_SECONDS / 0.01)
    assert auto.size == k and auto.next(2, 0) == k
    assert auto.next(1000 - k - 1, 0) == 2 and auto.next(1000 - 3, 0) == 3  # the tail: never a one-epoch chunk
    assert auto.next(0, 150) == 2  # a checkpoint nearer than one chunk: chunks of two up to it
    assert auto.next(149, 150) == 1  # only a stretch of one epoch before a cut is a one-epoch chunk
    cheap = _Chunks(1000, None)
    cheap.compiled(20.0)
    cheap.ran(2, 0.02, 998)  # the whole rest (10 s) costs less than compiling another program (20 s)
    assert cheap.size == 2
    slow = _Chunks(50, None)
    slow.ran(2, 14.0, 48)  # an epoch longer than CHUNK_SECONDS: chunks of two
    assert slow.size == 2
    assert _Chunks(1, None).next(0, 0) == 1 and _Chunks(3, None).next(0, 0) == 3


def _leaves_equal(a, b) -> bool:
    def host(t):
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                for x in jax.tree_util.tree_leaves(t)]
    return all(np.array_equal(x, y, equal_nan=True) for x, y in zip(host(a), host(b), strict=True))


# ---- the slow feeder's notice -------------------------------------------------------------------------------


class TinyConv(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(2, (3, 3))(x))
        return nn.Dense(2)(x.reshape(len(x), -1))


# Broken on purpose: _convolutions_on_cpu returning False: no warning; this test fails.
def test_a_convolutional_model_on_the_cpu_is_named_slow_once_with_the_fix(mlps):
    assert jax.devices()[0].platform == "cpu"
    conv = make_train(_config(epochs=4), _data(shape=(4, 4, 1)), model=TinyConv())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        conv.fit(0)
    slow = [w for w in caught if issubclass(w.category, SlowFeederWarning)]
    assert len(slow) == 1, [str(w.message) for w in caught]  # once in the run (chunks of 2 epochs: two or more)
    text = str(slow[0].message)
    assert "make_image_train" in text and "scan" in text and "s an epoch here" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mlps["on-device"].fit(0, epochs=2)
    assert not [w for w in caught if issubclass(w.category, SlowFeederWarning)]


class SignalOnClose:
    """A ``metrics.jsonl`` log (``RunLog``) that sends this process SIGTERM when the call closes it: after the
    trainer's last look at the stop flag, as the call ends."""

    def __new__(cls, directory):
        from resjax.train.monitor import RunLog

        class Log(RunLog):
            def close(self):
                super().close()
                os.kill(os.getpid(), signal.SIGTERM)

        return Log(directory)


# Broken on purpose: StopSignals.__exit__ only restoring the handlers (the signal, noted after the last check, was
# dropped and the call returned as if none had come: the experiments' reproduce test caught it first); fails.
@pytest.mark.parametrize("feeder", ["on-device", "host"])
def test_a_signal_as_the_call_ends_is_not_swallowed(feeder, handlers, tmp_path, capsys, mlps):
    with pytest.raises(Preempted) as stopped:  # a call of one epoch (of the trainer's 3)
        mlps[feeder].fit(0, epochs=1, log=SignalOnClose(tmp_path / "log"), checkpoint_dir=tmp_path / "ckpt")
    assert stopped.value.code == 143
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"resjax: stopped by SIGTERM as the call ended: its training is complete and saved in {tmp_path / 'ckpt'}.")


# ---- the default chunks' programs, as users compile them (last: optimized_compiles, module-scoped, turns XLA's
# optimisation passes on for every test after it, and the tests above compile faster without them) ---------


@pytest.fixture(scope="module")
def one_chunk(optimized_compiles):
    """The BatchNorm MLP's trainer, its 3 keys, and its 8-epoch run as one chunk: the reference of both chunkings
    below (one trainer, so the programs they share are built once)."""
    rng = np.random.default_rng(0)  # data and seeds on which a one-epoch first chunk differs in the last bit
    x = rng.normal(size=(96, 10)).astype(np.float32)
    y = ((x[:, 0] > 0) + (x[:, 1] > 1)).astype(np.int32)
    data = from_arrays(x[:64], y[:64], x[64:], y[64:], num_classes=3)
    trainer = make_train(_config(epochs=8, kind="residual_mlp", width=8, num_blocks=3, norm="batch"), data)
    keys = jax.random.split(jax.random.key(0), 3)
    return trainer, keys, trainer.sweep(keys, chunk_epochs=8)


# Broken on purpose: the default chunk the whole run again (`_Chunks.next` returning epochs - done): the first
# report comes at the end (epoch 8), and the log holds nothing at epoch 2; fails. The first chunk one epoch
# (`k = self.size or 1`): the BatchNorm MLP's run differs from one chunk's in the last bit; fails.
@pytest.mark.usefixtures("optimized_compiles")  # the promise is about the programs users compile
@pytest.mark.parametrize("size", [None, 3], ids=["measured", "three"])
def test_the_default_chunks_report_after_the_second_epoch_and_train_as_one_chunk(size, tmp_path, monkeypatch,
                                                                                  one_chunk):
    """By default the first report (callback, progress, metrics.jsonl) comes after two epochs; the run equals
    one chunk bit for bit, whatever the chunks (``three``: chunks of 3 forced, as if measured: 2, 3, 3)."""
    if size is not None:
        def ran(self, epochs, seconds, left):
            self.size = self.size or size
        monkeypatch.setattr(_Chunks, "ran", ran)
    trainer, keys, (one, one_metrics) = one_chunk
    reports, logged = [], []

    def callback(done, summary):
        reports.append(done)
        logged.append(len((tmp_path / "metrics.jsonl").read_text().splitlines()))

    run, metrics = trainer.sweep(keys, callback=callback, log=tmp_path)
    assert _leaves_equal(run, one)
    for k in one_metrics:
        np.testing.assert_array_equal(metrics[k], one_metrics[k])
    assert reports[0] == 2 and logged[0] == 6  # epochs 1 and 2 of the three runs in the file at the first report
    if size == 3:
        assert reports == [2, 5, 8]
