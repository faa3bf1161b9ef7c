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

From the first second. ``fit`` and ``sweep`` open ``StopSignals`` first thing, with or without a
``checkpoint_dir``, so a signal during the data checks, the compilation (XLA checks for signals while it
compiles: a ``KeyboardInterrupt`` raised there crashed the process with a segmentation fault, or was
swallowed by a garbage-collection callback and the run trained on) or the training only sets the flag.
The trainer looks at it where stopping is safe: after setting up, after each compilation (programs are
compiled before they run, so a signal during the first compilation stops before any step) and after each
step (host feeder) or chunk (on-device feeder). Before the first step of the call it raises ``Preempted``
at once with one line, ``resjax: stopped by SIGINT before training started: nothing was trained yet, so
nothing was saved.`` (or, resumed, that the checkpoint stays as it was); after, with a ``checkpoint_dir``,
it saves and says how to resume; without one it says that the epochs trained are lost. A call with a
``progress`` label (an experiment's cell) is named in its line, ``before [B=64 plain_d8] started training``,
``after epoch 3 of 12 of [B=64 plain_d2]``: sweeps side by side each say their own. Either way the
exit status is 130 (SIGINT) or 143 (SIGTERM), never a traceback. A caller that installed handlers of its
own (the experiments' entry points) gets the signal handed on wherever the call has nothing to save.
The previous handlers come back when the call returns.

Stopping inside a long compilation. XLA compiles in C++; Python cannot raise into it (see above), so a signal
that is only noted waits for the compilation to end (measured on the 2-core CPU, from the signal to the exit: 31 s
for a 200-layer MLP on either feeder; 18.6 s for the second cell of ``cifar_tau`` at a 4-seed conv ResNet-14 on
the host feeder, signalled 6 s into its setup). The handler itself does run at once (JAX's garbage-collection
callback runs Python code during the compilation), so where the process may end there, it does: a caller's
handler that ends the process (``SignalHandlers.ends_process``, as the experiments' entry points' does: its line,
the directory locks given up, ``os._exit``) gets a signal that finds nothing trained in the call at once, from
inside the compilation, and the process exits at once (the same runs: 0.14 s and 0.18 s). Nothing is lost: no
step of the call has run, and ``trained`` turns true as a step or chunk is dispatched, so one that has run (or
is running) keeps the save-then-exit above. A compilation in a thread that is abandoned is no way out: Python
then aborts while finalizing (the thread re-enters it; measured: SIGABRT). With several processes the signal
waits as before (the processes agree on the stop; one leaving alone would strand the others in a collective).
A library cannot end a process it does not own (``os._exit`` skips the caller's ``finally`` blocks, and would kill
a Jupyter kernel or a test runner), so a program without such a handler keeps the behaviour above: the line at
once, the stop when the compilation ends, and a second signal stops it at once.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["SIGNALS", "Preempted", "SignalHandlers", "StopSignals", "resume_command", "stops_cleanly"]

#: The signals ``StopSignals`` handles: SIGTERM (preemption) and SIGINT (Ctrl-C).
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Raised after a stop signal once the run is checkpointed (or, before the first step or without a
    ``checkpoint_dir``, with nothing to save: ``checkpoint_dir`` None unless a resumed run stays saved there);
    ``code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str, checkpoint_dir: str | None, step: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.message, self.checkpoint_dir, self.step = signum, message, checkpoint_dir, step

    def __str__(self) -> str:
        return self.message


def _say(text: str) -> None:
    """``text`` as a line on stderr; from a signal handler too (a print interrupted by the handler's own print
    raises a reentrant-call error: then the line goes to the file descriptor directly). One write of the line and
    its newline: sweeps side by side stop in threads at once, and a print (the text, then the newline) let their
    lines run together."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except RuntimeError:
        try:
            os.write(2, (text + "\n").encode())
        except OSError:
            pass


def resume_command() -> str:
    """The command line that started this process (run again, it resumes from the checkpoint)."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


class SignalHandlers:
    """Context manager: while open (and ``enabled``; from the main thread only, as Python allows), the first
    SIGTERM or SIGINT sets ``signum`` and calls ``first(signum)`` instead of stopping the process, and a second
    one stops it at once, the default way; the previous handlers come back on exit. Subclasses say what the
    first signal does (``StopSignals``: the trainers save and stop; the experiments' entry points: exit now)."""

    #: Whether ``first`` ends the process at once (``os._exit``, raising nothing: safe from inside an XLA
    #: compilation), as the experiments' entry points' handler does. A trainer's ``StopSignals`` opened inside hands
    #: such a handler a signal that finds nothing trained at once (see the module docstring).
    ends_process = False

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
    exit. The trainer keeps ``trained`` (whether a step of this call has run) and ``saving`` (whether it has
    a checkpoint directory) up to date, for the message the first signal prints."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(enabled)
        self.trained = False
        self.saving = False
        self.saved_in: str | None = None  # the checkpoint directory the trainer saves into (for ``ended``)
        self.handled = False  # a Preempted for the signal has been made (stop, untrained, lost, ended)
        self.handed_on = False  # the caller's own handler has had the signal (``hand_on``: once)

    def __exit__(self, exc_type, *exc: object) -> None:
        """Restore the previous handlers; a signal that came after the trainer's last look at it (the call
        returning) is not swallowed: the caller's own handler gets it, else ``Preempted`` is raised here."""
        callers = self.callers_handler(self.signum) if self.signum is not None else None
        super().__exit__(exc_type, *exc)
        if exc_type is None and self.enabled and self.signum is not None and not self.handled:
            if callers is not None and not self.handed_on:
                self.handed_on = True
                callers(self.signum, None)
            raise (self.ended() if self.trained else self.untrained())

    @property
    def requested(self) -> bool:
        """Whether a stop signal has arrived (``signum`` is set)."""
        return self.signum is not None

    def first(self, signum: int) -> None:
        """Say what happens next: the run stops before its first step, or once the step in progress is done
        (and saved, with a checkpoint directory). Before the first step, a caller's handler that ends the process
        gets the signal now, perhaps from inside a compilation (``ends_at_once``), and ends it."""
        if self.ends_at_once(signum):
            self.hand_on()
            return  # (reached only when the handler defers the signal: it said what happens)
        name = signal.Signals(signum).name
        if not self.trained:
            text = f"resjax: {name} received; stopping before training starts (send it again to stop at once)"
        elif self.saving:
            text = (f"resjax: {name} received; finishing the current step, then saving a checkpoint (send it again "
                    "to stop at once)")
        else:
            text = f"resjax: {name} received; stopping after the current step (send it again to stop at once)"
        _say(text)

    def callers_handler(self, signum: int) -> Callable | None:
        """The handler that was installed for ``signum`` before this one opened, when it is a function of the
        caller's (not Python's defaults, not another ``StopSignals``); else None."""
        handler = self._previous.get(signum)
        if not callable(handler) or handler is signal.default_int_handler:
            return None
        owner = getattr(handler, "__self__", None)
        return None if isinstance(owner, StopSignals) else handler

    def ends_at_once(self, signum: int) -> bool:
        """Whether a signal now is handed on at once to a caller's handler that ends the process
        (``SignalHandlers.ends_process``): nothing of this call trained yet (so nothing to save) and one process
        (several agree on the stop first). Asks JAX nothing that takes a lock: this runs in a signal handler."""
        if self.trained or self.handed_on:
            return False
        handler = self.callers_handler(signum)
        if not getattr(getattr(handler, "__self__", None), "ends_process", False):
            return False
        jax = sys.modules.get("jax")
        return jax is None or not jax.distributed.is_initialized()

    def hand_on(self) -> None:
        """Call the caller's own handler for the signal received (``callers_handler``), if there is one (the
        experiments' entry points: it prints their message and exits); once per signal."""
        handler = self.callers_handler(self.signum) if self.signum is not None else None
        if handler is not None and not self.handed_on:
            self.handed_on = True
            handler(self.signum, None)

    def untrained(self, checkpoint_dir: str | None = None, step: int = 0, epoch: int = 0,
                  label: str | None = None) -> Preempted:
        """The ``Preempted`` to raise when the signal came before the first step of this call (also printed):
        nothing was trained; a run resumed from ``checkpoint_dir`` (``step``, ``epoch`` > 0) stays saved there.
        ``label``: the call's progress label (an experiment's cell), named in the line, so that it is not taken
        for another call's (sweeps side by side each say their own)."""
        name = signal.Signals(self.signum).name
        if checkpoint_dir is not None and step:
            before = "before training resumed" if label is None else f"before [{label}] resumed training"
            message = (f"resjax: stopped by {name} {before}: nothing was trained in this call; the run stays "
                       f"saved in {checkpoint_dir} (epoch {epoch}, step {step}). Run the same command again to "
                       f"resume from it:\n  {resume_command()}")
        elif label is None:
            message = (f"resjax: stopped by {name} before training started: nothing was trained yet, so nothing was "
                       "saved.")
        else:
            message = (f"resjax: stopped by {name} before [{label}] started training: nothing of it was trained yet, "
                       "so nothing of it was saved.")
        _say(message)
        self.handled = True
        return Preempted(self.signum, message, None if checkpoint_dir is None else str(checkpoint_dir), step)

    def ended(self) -> Preempted:
        """The ``Preempted`` to raise when the signal came as the call ended, its training done (also printed)."""
        name = signal.Signals(self.signum).name
        kept = (f"and saved in {self.saved_in}" if self.saved_in is not None else "and saved" if self.saving
                else "but not saved (no checkpoint_dir): its results are lost")
        message = f"resjax: stopped by {name} as the call ended: its training is complete {kept}."
        _say(message)
        self.handled = True
        return Preempted(self.signum, message, self.saved_in, 0)

    def lost(self, where: str, step: int, label: str | None = None) -> Preempted:
        """The ``Preempted`` to raise when a run without a checkpoint directory stops after ``where`` (also
        printed): what was trained is not kept. ``label``: as ``untrained``'s."""
        name = signal.Signals(self.signum).name
        of = "" if label is None else f" of [{label}]"
        message = (f"resjax: stopped by {name} after {where}{of}; nothing was saved (no checkpoint_dir), so the "
                   "training of this call is lost (pass checkpoint_dir= to keep it).")
        _say(message)
        self.handled = True
        return Preempted(self.signum, message, None, step)

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

    def stop(self, checkpoint_dir: str, step: int, where: str, label: str | None = None) -> Preempted:
        """The ``Preempted`` to raise once the checkpoint ``step`` of ``where`` is written (also printed).
        ``label``: as ``untrained``'s."""
        name = signal.Signals(self.signum).name
        of = "" if label is None else f" of [{label}]"
        message = (f"resjax: stopped by {name} after {where}{of}; the run is saved in {checkpoint_dir} (step {step}). "
                   f"Run the same command again to resume from it:\n  {resume_command()}")
        _say(message)
        self.handled = True
        return Preempted(self.signum, message, checkpoint_dir, step)


def stops_cleanly(build: Callable) -> Callable:
    """``build`` (a trainer's factory: ``make_train``, ``make_image_train``) under ``StopSignals``: a stop
    signal during its data checks and tracing waits for it to return, then stops with nothing trained
    (``StopSignals.untrained``: one line, exit status 130/143; a caller's own handler gets the signal first)."""

    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        with StopSignals() as stop:
            out = build(*args, **kwargs)
            if stop.agree():
                stop.hand_on()
                raise stop.untrained()
        return out

    return wrapper
