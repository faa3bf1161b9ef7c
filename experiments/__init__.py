"""Experiment scripts: ``python -m experiments.<name> [--quick] [--out DIR] [--<setting> VALUE ...]``.

Each module defines ``NAME``, ``get_config(size)`` (size: ``'quick'``, ``'default'`` or ``'full'``),
``run(config, out_dir) -> metrics`` (which also writes ``out_dir/<NAME>.png``) and ``CLAIMS``, the seed
documents' claims that ``experiments.reproduce`` checks against ``results.json``, and ``check(config)``,
the preflight hook: it raises ``ValueError`` naming the first bad setting of any cell the run would train
(``experiments.common.preflight`` calls it before any training; ``run`` calls it too).

Importing this package changes nothing in the process: the entry points (``common.main``,
``reproduce.main``) call ``common.start()``, which makes every CPU core a JAX device and starts
``jax.distributed`` when the environment asks for several processes. Only in a process started as
``python -m experiments.<name>`` does the import also make SIGTERM and SIGINT, until the entry point takes
them over (``experiments.checkpoints.stop_signals``), end the process at once with status 143 or 130 and one
line saying that nothing was trained yet (no ``KeyboardInterrupt`` traceback out of a half-done import).
"""

import sys as _sys


def _started_as_entry_point() -> str | None:
    """The experiment's name when this process is ``python -m experiments.<name>`` (else None)."""
    argv = getattr(_sys, "orig_argv", [])
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1].startswith("experiments."):
            return argv[i + 1].split(".", 1)[1]
    return None


def _stop_while_starting(signum, frame) -> None:
    import os
    import signal

    print(f"{_ENTRY}: stopped by {signal.Signals(signum).name} while starting: nothing was trained yet, so nothing "
          "was saved.", file=_sys.stderr, flush=True)
    os._exit(128 + signum)  # no KeyboardInterrupt traceback out of an import, no teardown inside JAX (#22)


_ENTRY = _started_as_entry_point()
if _ENTRY is not None:  # only an entry point's own process: importing the package elsewhere changes nothing
    import signal as _signal
    import threading as _threading

    if _threading.current_thread() is _threading.main_thread():
        for _s in (_signal.SIGTERM, _signal.SIGINT):
            if _signal.getsignal(_s) in (_signal.SIG_DFL, _signal.default_int_handler):
                _signal.signal(_s, _stop_while_starting)
