"""Stop signals: a run that is preempted (SIGTERM) or interrupted (SIGINT) checkpoints and exits.

TPU VMs, Slurm and most cluster schedulers stop a job with SIGTERM (and SIGKILL a grace period later);
Ctrl-C sends SIGINT. While a trainer with a ``checkpoint_dir`` runs, ``StopSignals`` replaces the
handlers of both: the signal only sets a flag, the trainer finishes the step (the host feeder: the
minibatch; the on-device feeder: the jitted chunk of epochs) it is in, saves the run state, prints the
command that resumes and raises ``Preempted``. ``Preempted`` is a ``SystemExit`` whose code is 128 + the
signal number (143 for SIGTERM, 130 for SIGINT), the status the default handlers give, so a script
that does not catch it exits as before, minus the lost work. A second signal while the first is being
handled stops the process at once with the default action (a checkpoint being written then is left
incomplete; resuming skips it as damaged and takes the newest good one).

Handlers are only installed from the main thread (Python allows no other); elsewhere, and without a
``checkpoint_dir``, signals keep their usual effect. With several processes each one handles its own
signal, and the trainers ``agree`` at the end of every epoch (a sweep: every chunk): if any process has
been signalled, all of them save that step and stop with its signal, so no process is left waiting in a
collective for one that stopped (schedulers signal every process of a job, but not at the same step).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading

__all__ = ["SIGNALS", "Preempted", "SignalHandlers", "StopSignals", "resume_command"]

#: The signals ``StopSignals`` handles: SIGTERM (preemption) and SIGINT (Ctrl-C).
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Raised after a stop signal once the run is checkpointed; ``code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str, checkpoint_dir: str, step: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.message, self.checkpoint_dir, self.step = signum, message, checkpoint_dir, step

    def __str__(self) -> str:
        return self.message


def resume_command() -> str:
    """The command line that started this process (run again, it resumes from the checkpoint)."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


class SignalHandlers:
    """Context manager: while open (and ``enabled``; from the main thread only, as Python allows), the first
    SIGTERM or SIGINT sets ``signum`` and calls ``first(signum)`` instead of stopping the process, and a second
    one stops it at once, the default way; the previous handlers come back on exit. Subclasses say what the
    first signal does (``StopSignals``: the trainers save and stop; the experiments' entry points: exit now)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now, the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self.first(signum)

    def first(self, signum: int) -> None:
        """What the first signal does besides setting ``signum`` (nothing here)."""


class StopSignals(SignalHandlers):
    """Context manager: while open (and ``enabled``), SIGTERM and SIGINT set ``signum`` instead of
    stopping the process (the trainer then saves and raises ``Preempted``); the previous handlers come back on
    exit."""

    @property
    def requested(self) -> bool:
        """Whether a stop signal has arrived (``signum`` is set)."""
        return self.signum is not None

    def first(self, signum: int) -> None:
        """Say that the step in progress is finished and saved before the run stops."""
        print(f"resjax: {signal.Signals(signum).name} received; finishing the current step, then saving a "
              "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    def agree(self) -> bool:
        """``requested`` agreed among all processes (one process: ``requested`` itself). A collective: with
        several processes every one must call it at the same point. A process that was not signalled takes
        the signal of one that was, so that all save the same step and stop together."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        import numpy as np
        from jax.experimental import multihost_utils

        signums = np.asarray(multihost_utils.process_allgather(np.asarray(self.signum or 0, np.int32)))
        if self.signum is None and signums.max() > 0:
            self.signum = int(signums.max())
            print(f"resjax: process {int(np.argmax(signums))} received {signal.Signals(self.signum).name}; "
                  "every process saves this step and stops", file=sys.stderr, flush=True)
        return self.requested

    def stop(self, checkpoint_dir: str, step: int, where: str) -> Preempted:
        """The ``Preempted`` to raise once the checkpoint ``step`` of ``where`` is written (also printed)."""
        name = signal.Signals(self.signum).name
        message = (f"resjax: stopped by {name} after {where}; the run is saved in {checkpoint_dir} (step {step}). "
                   f"Run the same command again to resume from it:\n  {resume_command()}")
        print(message, file=sys.stderr, flush=True)
        return Preempted(self.signum, message, checkpoint_dir, step)
