"""Experiments checkpoint their training and resume it: the same command, run again, goes on (#22).

Every training cell of an experiment (one ``Trainer.sweep`` or ``ImageTrainer.fit`` call: one model, every seed
and per-run setting of it) checkpoints into its own folder ``<root>/<cell>-<hash>``. ``<root>`` is the entry
point's ``--checkpoint_dir`` (default ``<out>/checkpoints``; ``none`` turns checkpoints off) and the hash covers
everything that decides the cell: its run config (model, training settings but ``checkpoint_every`` and
``checkpoint_keep``, data set name), the model's description, the data's bytes, the seeds' keys, the per-run
``hparams`` and the epochs. Run again with the same settings, a finished cell comes back from its final
checkpoint without training, and the interrupted one resumes from its newest checkpoint (bit-identical to an
unbroken run: the library's resume); a changed setting gives another folder and trains afresh, never meeting
an old checkpoint. ``--fresh`` trains every cell from the start (its folder is emptied first).

One run per folder (#22, #32): the run holds the checkpoint root's lock (``experiments.files``) for as long as its
:func:`session` lasts (from its start where the root exists, else from its first cell), and ``--fresh`` empties a
cell's folder only while holding that folder's lock. A root or cell folder another running process holds is
refused with ``files.FolderInUseError`` naming that process, before anything in it is read or deleted: a
``--fresh`` run never removes the checkpoints of a run in progress.

``run_experiment`` opens a :func:`session` for the run; cells go through :func:`sweep` (on-device) or
:func:`cell_dir` (the image cells' ``ImageTrainer.fit``). A cell whose trainer has step or epoch hooks
(measurements taken inside the compiled run, which a checkpoint does not hold) is not checkpointed: it
trains again from its start, in seconds for the experiments that have one.

``metrics.jsonl`` is resumed with the run: a run that goes on from this experiment's checkpoints (the same
config as the one that made them, recorded in ``<root>/.run-<experiment>.json``) keeps the file; each cell
drops its lines past its checkpoint's epoch and writes those its checkpoint has and the file lacks
(``resjax.train.monitor.RunLog.start``), so every epoch is in it once. Otherwise the file starts afresh.

``results.json``'s ``seconds`` is resumed too: the wall time of every session of the run, the stopped ones
included (182 s stopped, then 8 s resumed: 190 s), not the last session's alone. The marker file keeps the
seconds spent so far (``Session.seconds``), written as each cell begins and ends, as the session ends (a
``Preempted`` or an error included) and when a stop signal ends the process; a session resuming the run (the
same config) starts from them. A process killed without a signal (SIGKILL) loses the time since its last cell
began or ended. ``--fresh``, another config or ``--checkpoint_dir none`` count this session alone.

Stop signals (:func:`stop_signals`, installed by the entry points ``python -m experiments.<name>`` and
``python -m experiments.reproduce``): a SIGTERM or SIGINT while a cell trains with checkpoints is the
library's (the chunk or minibatch finishes, is saved, and the process exits 143 or 130 printing the command
that resumes). At any other moment the process exits at once with the same status and one message: before
any training, that nothing was trained yet; after, where the finished cells are saved and the command that
resumes. No traceback, and no interpreter teardown in the middle of a JAX computation (``os._exit``, after
the directory locks are given up); results being written are finished first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from experiments import files
from resjax.paths import as_path, check_url, is_url, remove_tree
from resjax.train.preemption import SignalHandlers

#: ``--checkpoint_dir none``: no checkpoints.
NONE = "none"
#: The checkpoint folder inside ``--out`` when ``--checkpoint_dir`` is not given.
DEFAULT_FOLDER = "checkpoints"


def resolve(value: str | os.PathLike | None, out_dir) -> pathlib.Path | None:
    """The checkpoint root of ``--checkpoint_dir value``: ``<out_dir>/checkpoints`` when not given, None for
    ``none``; ``ValueError`` naming ``checkpoint_dir`` for an empty path."""
    if value is None:
        return as_path(out_dir, "out") / DEFAULT_FOLDER
    if str(value).strip() == "":
        raise ValueError("checkpoint_dir: an empty path (it would mean the current folder); give a folder, or "
                         f"'{NONE}' for no checkpoints")
    if str(value).strip().lower() == NONE:
        return None
    return as_path(value, "checkpoint_dir")


def check_root(root: pathlib.Path | None) -> None:
    """Preflight of a checkpoint root: an existing one must be a folder this process can write into; one that
    does not exist yet, creatable (its nearest existing parent a writable folder). ``ValueError`` naming
    ``checkpoint_dir`` else. Nothing is created here (an experiment that never trains leaves no folder)."""
    if root is None:
        return
    if is_url(root):  # a bucket: reachable, there and writable (resjax.paths)
        check_url(root, "checkpoint_dir")
        return
    path = pathlib.Path(root).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir: {root} is a file, not a folder")
    parent = path
    while not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"checkpoint_dir: cannot create {root}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint_dir: cannot write into {parent} (permission denied)"
                         + ("" if parent == path else f", so {root} cannot be created"))


@dataclasses.dataclass
class Session:
    """One experiment run's checkpoints: ``root`` (None: off), ``fresh`` (train every cell from its start), the
    experiment's ``name`` and ``config`` (JSON), and what happened so far (cells finished, the cell training)."""

    root: pathlib.Path | None
    name: str = "experiment"
    config: Any = None
    fresh: bool = False
    resuming: bool = False  # this run goes on from checkpoints of the same config (metrics.jsonl kept)
    marked: bool = False  # the marker names this run's config
    finished: int = 0
    current: str | None = None
    current_saved: bool = True  # whether the cell training now checkpoints
    current_dir: pathlib.Path | None = None  # its folder
    emptied: set = dataclasses.field(default_factory=set)
    locked: pathlib.Path | None = None  # a folder the caller holds the lock of (the output folder)
    lock: Any = None  # the root's lock (resjax.train.lock.DirectoryLock) while this session holds it
    earlier: float = 0.0  # the seconds of the earlier sessions of this run (resumed: the marker's)
    started: float = dataclasses.field(default_factory=lambda: time.time())

    def seconds(self) -> float:
        """The wall seconds of this run so far: the earlier sessions' and this one's."""
        return self.earlier + time.time() - self.started

    @property
    def marker(self) -> pathlib.Path | None:
        return None if self.root is None else self.root / f".run-{self.name}.json"


_SESSIONS: list[Session] = []
_FINISHED = [0]  # training cells finished (or loaded from their final checkpoint) in this process, every session
_CELLS_LOCK = threading.Lock()
_ROOT_LOCK = threading.Lock()


def current() -> Session | None:
    """The innermost open :func:`session`, or None (a module's ``run`` called directly: no checkpoints)."""
    return _SESSIONS[-1] if _SESSIONS else None


@contextlib.contextmanager
def session(root: pathlib.Path | None, name: str = "experiment", config: Any = None,
            fresh: bool = False, locked=None) -> Iterator[Session]:
    """Inside the block, :func:`sweep` and :func:`cell_dir` checkpoint into ``root`` (None: nowhere).
    ``session.resuming`` says whether this run goes on from an earlier run's checkpoints of the same
    ``config`` (then ``metrics.jsonl`` is kept; see the module docstring).

    The session holds ``root``'s lock (``experiments.files``) from its start where the folder exists, else from
    its first cell (an experiment that never trains creates no folder), to its end; ``locked``: a folder the
    caller already holds the lock of (``run_experiment``'s output folder), not locked again when it is ``root``.
    Another running process's root is ``files.FolderInUseError``, before anything in it is read or deleted."""
    s = Session(as_path(root, "checkpoint_dir") if root is not None else None, name, config, fresh,
                locked=as_path(locked, "out") if locked is not None else None)
    try:
        if s.root is not None and s.root.is_dir():
            _lock_root(s)  # another run's root is refused here, before anything of it is read or deleted (#32)
        if s.root is not None and not fresh and s.marker.is_file():
            try:
                marker = json.loads(s.marker.read_text())
                s.resuming = s.marked = marker.get("config") == config
            except (OSError, ValueError, AttributeError):
                s.resuming = False
            else:
                if s.resuming:  # the seconds of the sessions before this one (a marker without them: none)
                    earlier = marker.get("seconds", 0.0)
                    s.earlier = float(earlier) if isinstance(earlier, (int, float)) and earlier >= 0 else 0.0
        _SESSIONS.append(s)
        try:
            yield s
        finally:
            _SESSIONS.remove(s)
            _save_seconds(s)  # however the session ends: the next one resuming adds its own
    finally:
        if s.lock is not None:
            s.lock.release()


def _write_marker(s: Session) -> None:
    """This run's marker (``<root>/.run-<experiment>.json``): its config, for the next run to recognise, and the
    seconds spent on it so far. Process 0 writes every file of a multi-process run."""
    if files.is_main():
        s.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"experiment": s.name, "config": s.config, "seconds": round(s.seconds(), 2)})
        files.write_atomically(s.marker, lambda tmp: tmp.write_text(text))


def _save_seconds(s: Session | None) -> None:
    """The seconds so far into the marker of ``s``, once it has one (its first checkpointed cell wrote it); a marker
    that cannot be written (a full disk) costs only the record of the time."""
    if s is None or s.root is None or not s.marked:
        return
    with contextlib.suppress(Exception):
        _write_marker(s)


def _lock_root(s: Session | None) -> None:
    """Take the lock of ``s.root`` for the rest of the session (once; creating the folder), unless checkpoints
    are off or the root is the folder the caller already locked. ``files.FolderInUseError`` when another running
    process holds it: one run per checkpoint root, so that ``--fresh`` never deletes a running run's cells."""
    if s is None or s.root is None or s.lock is not None:
        return
    if s.locked is not None and _same_folder(s.root, s.locked):
        return
    with _ROOT_LOCK:  # cells may begin in several threads (sweeps): the root is locked once
        if s.lock is None:
            s.lock = files.acquire(s.root, "checkpoint_dir")


def _begin_cell(s: Session | None, cell: str, directory: pathlib.Path | None) -> None:
    if s is None:
        return
    saved = directory is not None
    with _CELLS_LOCK:  # cells may begin in several threads (sweeps): the marker is written once
        s.current, s.current_saved, s.current_dir = cell, saved, directory
        if saved and s.root is not None and not s.marked:  # this config's run, for the next one to recognise
            _lock_root(s)
            _write_marker(s)
            s.marked = True
        else:
            _save_seconds(s)


def _end_cell(s: Session | None) -> None:
    with _CELLS_LOCK:  # cells may end in several threads (sweeps)
        _FINISHED[0] += 1
        if s is not None:
            s.current, s.finished = None, s.finished + 1
            _save_seconds(s)


def _same_folder(a, b) -> bool:
    return str(a).rstrip("/") == str(b).rstrip("/") if is_url(a) or is_url(b) else a.absolute() == b.absolute()


def _has_steps(directory: pathlib.Path | None) -> bool:
    return directory is not None and directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def _slug(cell: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", cell).strip("_") or "cell"


def cell_dir(cell: str, *settings: Any) -> pathlib.Path | None:
    """``<root>/<cell>-<hash of settings>`` of the current session (None without one or with checkpoints off).
    ``settings``: everything that decides the cell, as values whose ``repr`` is stable across processes. With
    ``--fresh`` the folder is emptied the first time it is asked for."""
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:10]
    return named_dir(f"{_slug(cell)}-{digest}")


def named_dir(name: str) -> pathlib.Path | None:
    """``<root>/<name>`` of the current session (see :func:`cell_dir`; ``name`` already says what decides it)."""
    s = current()
    if s is None or s.root is None:
        return None
    directory = s.root / name
    _lock_root(s)  # before anything in the root is read, created or deleted (#32)
    if s.fresh and directory not in s.emptied:
        from resjax.train.distributed import barrier

        s.emptied.add(directory)
        if files.is_main() and directory.is_dir():
            _empty(directory)
        barrier(f"resjax_fresh_{name}")  # no process opens the folder before it is emptied
    return directory


def _empty(directory: pathlib.Path) -> None:
    """Remove the cell folder ``directory`` (``--fresh``), holding its lock while its contents go: a run training
    in it now is refused (``files.FolderInUseError`` naming it) and keeps every file (#32)."""
    from resjax.train.lock import LOCK_FILE

    with files.lock_folder(directory, "checkpoint_dir"):
        for entry in directory.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not (isinstance(entry, pathlib.Path) and entry.is_symlink()):
                remove_tree(entry)
            else:
                entry.unlink()
    if not is_url(directory):  # a bucket has no empty folders to remove
        with contextlib.suppress(OSError):  # something new in it meanwhile: left for its trainer
            directory.rmdir()


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def sweep_settings(trainer, keys, hparams, epochs) -> tuple:
    """What decides an on-device cell (``Trainer.sweep(keys, hparams, epochs=...)``), for :func:`cell_dir`."""
    import jax

    from resjax.train.checkpoint import describe_model
    from resjax.train.core import _host_hparams, config_dict, resume_config, seed_handles

    handles, _, seeded = seed_handles(keys, None)
    key_data = np.asarray(jax.random.key_data(handles if seeded else handles[None]))
    num = key_data.shape[0]
    data = trainer.data
    return (sorted(resume_config(config_dict(trainer.config)).items()), describe_model(trainer.model),
            _digest(data.x_train, data.y_train, data.x_test, data.y_test), _digest(key_data),
            sorted((_host_hparams(trainer.check_hparams(hparams, num)) or {}).items()), epochs)


def _announce(s: Session, cell: str, directory: pathlib.Path, steps_per_epoch: int, total: int) -> None:
    """Say that ``cell`` goes on from its checkpoint (when its folder holds one)."""
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    if not steps or not files.is_main():
        return
    epoch = max(steps) // max(steps_per_epoch, 1)
    if epoch >= total:
        print(f"{s.name}: [{cell}] finished in an earlier run: its results come from its final checkpoint "
              f"({directory}), nothing to train", flush=True)
    else:
        print(f"{s.name}: [{cell}] resuming from its checkpoint at epoch {epoch} of {total} ({directory})", flush=True)


def sweep(trainer, keys, hparams: dict | None = None, *, cell: str, epochs: int | None = None, **kwargs):
    """``trainer.sweep(keys, hparams, epochs=epochs, **kwargs)`` checkpointed into this cell's folder
    (:func:`cell_dir`) of the current session: a finished cell is read back, an interrupted one resumes (and
    says so). ``cell``: the cell's name (its folder's, and its messages'). Without a session, with
    checkpoints off, or for a trainer with hooks, the plain sweep."""
    s = current()
    hooks = trainer.step_hook is not None or trainer.epoch_hook is not None
    directory = None
    if s is not None and s.root is not None and not hooks:
        directory = cell_dir(cell, *sweep_settings(trainer, keys, hparams, epochs))
        # a step run's "epochs" are its evaluation periods (resjax.train.config)
        _announce(s, cell, directory, trainer.steps_per_epoch, epochs or trainer.num_epochs)
    _begin_cell(s, cell, directory)
    result = trainer.sweep(keys, hparams, epochs=epochs, checkpoint_dir=directory, **kwargs)
    _end_cell(s)
    return result


def sweeps(jobs: Sequence[Callable[[], dict]]) -> list:
    """Several cells' :func:`sweep` side by side, each whole on one device (``resjax.train.side_by_side``; give
    the longest first): their results in the order of ``jobs``, each the one it gives alone on its device.
    A job is a function giving :func:`sweep`'s arguments (``dict(trainer=, keys=, cell=, ...)``), called when the
    job starts, so that a cell's trainer, and its compiled programs, live only while it trains. Checkpointed
    cell by cell as :func:`sweep`."""
    from resjax.train import side_by_side

    def start(job: Callable[[], dict], **placement: Any) -> Any:
        return sweep(**job(), **placement)

    return side_by_side([functools.partial(start, job) for job in jobs])


def fit_dir(cell: str, name: str, trainer, epochs: int | None = None) -> pathlib.Path | None:
    """The checkpoint folder ``<root>/<name>`` (:func:`named_dir`) of a host-fed cell (``ImageTrainer.fit``)
    ``cell``, announced (resumed, or finished earlier) and marked as training; pair with :func:`cell_done`."""
    s = current()
    directory = named_dir(name)
    if directory is not None:
        _announce(s, cell, directory, trainer.steps_per_epoch, epochs or trainer.config.train.epochs)
    _begin_cell(s, cell, directory)
    return directory


def cell_done() -> None:
    """A host-fed cell (:func:`fit_dir`) has finished."""
    _end_cell(current())


# ---- stop signals ------------------------------------------------------------------------------------------


class _Stop(SignalHandlers):
    """The entry points' SIGTERM/SIGINT handling outside the library's (see the module docstring). Its first signal
    ends the process (``exit``: ``os._exit``), so a trainer that has trained nothing yet hands it a signal at once,
    even from inside a long XLA compilation (``resjax.train.preemption``): the run stops within a second."""

    ends_process = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.deferred = 0

    def first(self, signum: int) -> None:
        if self.deferred:
            print(f"{self.name}: {signal.Signals(signum).name} received while writing the results; stopping once "
                  "they are written (send it again to stop at once)", file=sys.stderr, flush=True)
            return
        self.exit()

    def message(self) -> str:
        from resjax.train.preemption import resume_command

        what = signal.Signals(self.signum).name
        s = current()
        in_cell = s is not None and s.current is not None
        unsaved = in_cell and not s.current_saved  # a cell training without checkpoints (hooks)
        saved = in_cell and s.current_saved and _has_steps(s.current_dir)  # the cell's checkpoint (its loop ended)
        if not _FINISHED[0] and not unsaved and not saved:  # nothing trained in this process (a cell setting up)
            before = "before training started" if not in_cell else f"before [{s.current}] started training"
            return f"{self.name}: stopped by {what} {before}: nothing was trained yet, so nothing was saved."
        if s is not None and s.root is None:
            return (f"{self.name}: stopped by {what}; checkpoints are off (--checkpoint_dir {NONE}), so the training "
                    "of this run is lost")
        text = f"{self.name}: stopped by {what}; the training cells finished so far are saved" + (
            f" in {s.root}" if s is not None else " (in each experiment's checkpoints)")
        if unsaved:
            text += (f" (the cell in progress, {s.current}, measures inside its run, which a checkpoint does not "
                     "hold: it trains again from its start)")
        return text + f". Run the same command again to resume:\n  {resume_command()}"

    def exit(self) -> None:
        """Print the message, give up the directory locks and leave with status 128 + the signal number."""
        from resjax.train.lock import release_all

        try:
            print(self.message(), file=sys.stderr, flush=True)
            sys.stdout.flush()
            _save_seconds(current())  # the run's seconds so far, for the session that resumes it
        finally:
            release_all()
            os._exit(128 + self.signum)


_STOPS: list[_Stop] = []


@contextlib.contextmanager
def stop_signals(name: str) -> Iterator[None]:
    """SIGTERM and SIGINT, inside the block, stop the process cleanly with status 143 or 130 (see the module
    docstring); ``name`` starts the message (the experiment's name, or ``reproduce``)."""
    stop = _Stop(name)
    _STOPS.append(stop)
    try:
        with stop:
            yield
    finally:
        _STOPS.remove(stop)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Inside the block (the results and figures being written), a stop signal waits for its end."""
    stop = _STOPS[-1] if _STOPS else None
    if stop is None:
        yield
        return
    stop.deferred += 1
    try:
        yield
    finally:
        stop.deferred -= 1
        if not stop.deferred and stop.signum is not None:
            stop.exit()
