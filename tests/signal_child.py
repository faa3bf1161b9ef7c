"""Stop signals from the first second (issue #32): ``python tests/signal_child.py PHASES TRIALS SIGNALS`` imports
JAX once, then forks TRIALS children; each builds a trainer and calls ``fit``, and the parent sends it a signal
of SIGNALS (names, comma-separated, taken in turn) at a random moment of its phase (PHASES likewise):

- ``compile``: the on-device ``fit`` of a deep unscanned MLP, between the model's first trace (its marker,
  ``tracing``, printed from inside ``make_train`` and ``fit``) and 0.8 s later: the tracing, lowering and XLA
  compilation of the run's first programs (nothing can have trained: the signal is always before the first
  step). The children do not share a compilation cache, so every one compiles.
- ``checks``: the host feeder's ``fit``, while the training source checks its first batch (its marker,
  ``checking``; a check that takes 0.5 s).
- ``slow-host``, ``slow-on-device``: that feeder's ``fit`` inside the experiments' entry-point handlers
  (``experiments.checkpoints.stop_signals``, whose first signal ends the process), signalled while the first
  training program compiles (its marker, ``compiling``), a compilation made ``SLOW`` seconds long: after XLA's
  compile, ``jax.stages.Lowered.compile`` sleeps. The signal's handler runs then as it runs inside XLA's own
  compilation (JAX runs Python there, its garbage-collection callback); what it does decides whether the process
  ends at once or when the compilation is done, ``SLOW`` seconds later. The result has ``exit_s``, the seconds from
  the signal to the child's exit.

Each child exits the ordinary way (an uncaught exception ends the interpreter), and the parent prints one JSON
line per trial: its exit status (``os.waitstatus_to_exitcode``: -11 is a segmentation fault) and its output.
"""

import json
import os
import random
import signal
import sys
import time

import flax.linen as nn
import jax
import numpy as np

from resjax.data import from_arrays
from resjax.train import make_image_train, make_train, run_config, train_config


class Deep(nn.Module):
    """Many unscanned layers: a compilation long enough to send a signal into."""

    depth: int = 3
    num_classes: int = 2

    @nn.compact
    def __call__(self, x, train: bool = False):
        print("tracing", flush=True)
        x = x.reshape(len(x), -1)
        for _ in range(self.depth):
            x = nn.tanh(nn.Dense(8)(x))
        return nn.Dense(self.num_classes)(x)


#: How long the ``slow-*`` phases' compilation of the first training program lasts, in seconds.
SLOW = 30.0


def slow_compiles() -> None:
    """Make every explicit compilation (``Lowered.compile``: the feeders' first training programs) last ``SLOW``
    seconds longer, printing ``compiling`` as it starts and ``compiled`` as it ends."""
    real = jax.stages.Lowered.compile

    def slow(self, *args, **kwargs):
        print("compiling", flush=True)
        out = real(self, *args, **kwargs)
        end = time.monotonic() + SLOW
        while time.monotonic() < end:  # a compilation that goes on (a signal's handler runs meanwhile)
            time.sleep(end - time.monotonic())
        print("compiled", flush=True)
        return out

    jax.stages.Lowered.compile = slow


def child(phase: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 2, 2, 1)).astype(np.float32)
    y = (x[:, 0, 0, 0] > 0).astype(np.int32)
    data = from_arrays(x[:32], y[:32], x[32:], y[32:], num_classes=2)
    config = run_config(train=train_config(batch_size=16, epochs=2, learning_rate=0.05))
    if phase == "compile":
        make_train(config, data, model=Deep()).fit(0)
    elif phase.startswith("slow-"):
        from experiments.checkpoints import stop_signals

        slow_compiles()
        make = make_image_train if phase == "slow-host" else make_train
        with stop_signals("child"):
            make(config, data, model=Deep()).fit(0)
    else:
        source = data.source("train")

        def slow_check(batch, indices, epoch, b):  # a data check that takes its time
            print("checking", flush=True)
            time.sleep(0.5)

        source.check_finite = slow_check
        make_image_train(config, source, data.source("test"), model=Deep(depth=1)).fit(0)
    print("fit returned", flush=True)
    sys.exit(0)


def trial(phase: str, signum: int, delay: float) -> dict:
    marker = {"compile": "tracing", "checks": "checking"}.get(phase, "compiling")
    sys.stdout.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its output into the pipe; SystemExit (or anything else) ends it the usual way
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        child(phase)
    os.close(write)
    out, sent = b"", None
    with os.fdopen(read, "rb") as pipe:
        for line in pipe:
            out += line
            if line.strip() == marker.encode():
                time.sleep(delay)
                os.kill(pid, signum)
                sent = time.monotonic()
                break
        out += pipe.read()
    _, status = os.waitpid(pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "delay": round(delay, 3), "out": out.decode(errors="replace"),
            "exit_s": None if sent is None else round(time.monotonic() - sent, 3)}


def main() -> None:
    phases, trials = sys.argv[1].split(","), int(sys.argv[2])  # taken in turn
    signums = [getattr(signal, name) for name in sys.argv[3].split(",")]  # taken in turn
    rng = random.Random(0)
    for i in range(trials):
        phase, signum = phases[i % len(phases)], signums[i % len(signums)]
        spread = 0.8 if phase == "compile" else 0.3
        print(json.dumps({"phase": phase, "signum": int(signum), **trial(phase, signum, rng.uniform(0, spread))}),
              flush=True)


if __name__ == "__main__":
    main()
