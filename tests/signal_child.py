"""Stop signals from the first second (issue #32): ``python tests/signal_child.py PHASE TRIALS SIGNALS`` imports
JAX once, then forks TRIALS children; each builds a trainer and calls ``fit``, and the parent sends it a signal
of SIGNALS (names, comma-separated, taken in turn) at a random moment of PHASE:

- ``compile``: the on-device ``fit`` of a deep unscanned MLP, between the model's first trace (its marker,
  ``tracing``, printed from inside ``make_train`` and ``fit``) and 0.8 s later: the tracing, lowering and XLA
  compilation of the run's first programs (nothing can have trained: the signal is always before the first
  step). The children do not share a compilation cache, so every one compiles.
- ``checks``: the host feeder's ``fit``, while the training source checks its first batch (its marker,
  ``checking``; a check that takes 0.5 s).

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


def child(phase: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 2, 2, 1)).astype(np.float32)
    y = (x[:, 0, 0, 0] > 0).astype(np.int32)
    data = from_arrays(x[:32], y[:32], x[32:], y[32:], num_classes=2)
    config = run_config(train=train_config(batch_size=16, epochs=2, learning_rate=0.05))
    if phase == "compile":
        make_train(config, data, model=Deep()).fit(0)
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
    marker = "tracing" if phase == "compile" else "checking"
    sys.stdout.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its output into the pipe; SystemExit (or anything else) ends it the usual way
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        child(phase)
    os.close(write)
    out = b""
    with os.fdopen(read, "rb") as pipe:
        for line in pipe:
            out += line
            if line.strip() == marker.encode():
                time.sleep(delay)
                os.kill(pid, signum)
                break
        out += pipe.read()
    _, status = os.waitpid(pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "delay": round(delay, 3), "out": out.decode(errors="replace")}


def main() -> None:
    phase, trials = sys.argv[1], int(sys.argv[2])
    signums = [getattr(signal, name) for name in sys.argv[3].split(",")]  # taken in turn
    spread = 0.8 if phase == "compile" else 0.3
    rng = random.Random(0)
    for i in range(trials):
        signum = signums[i % len(signums)]
        print(json.dumps({"signum": int(signum), **trial(phase, signum, rng.uniform(0, spread))}), flush=True)


if __name__ == "__main__":
    main()
