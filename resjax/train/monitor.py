"""Watching a run: a metrics file written as training goes, TensorBoard event files, and progress that
shows in a log file.

``RunLog(directory)`` (or ``fit(..., log=directory)`` / ``sweep(..., log=directory)``) appends one JSON line
per run and epoch to ``directory/metrics.jsonl`` as each epoch (on-device: each chunk of epochs) ends::

    {"cell": "B=16 plain_d32", "run": 0, "epoch": 3, "train_loss": 0.71, "test_error": 0.31, ...,
     "elapsed_s": 12.4, "time": 1764619200.1}

``epoch`` counts completed epochs (1-based), ``run`` indexes the runs of one call (seeds, grid points), and
metrics are the history's (``resjax.train.core.METRICS``; errors as fractions; ``null`` where NaN). The file
is flushed after every write, so ``tail -f`` and ``pandas.read_json(path, lines=True)`` read it while the run
goes on. A run resumed from a checkpoint first drops the lines of its cell past the checkpoint's epoch, so
after a preemption every epoch is in the file once. With ``tensorboard=True`` the same numbers go to
TensorBoard event files in ``directory`` through tensorboardX (``pip install resjax[tensorboard]``; no
TensorFlow needed): ``tensorboard --logdir directory``, tags ``<cell>/<metric>/run<i>``. Only process 0 of
a multi-process run writes.

``log_to(directory)`` makes a ``RunLog`` the default of every ``fit`` and ``sweep`` inside the ``with``
block (the experiments wrap each run in it, so ``--out DIR`` gets ``DIR/metrics.jsonl``); each call is a
cell, named by its ``progress`` label (made unique by a ``#2``, ``#3``, ... suffix in call order).

Progress (``progress=True`` or a label): a tqdm bar on a terminal; when stderr is not a terminal (a log
file, a cluster job), one plain line per epoch or chunk on stdout instead, with elapsed and estimated time and
the metrics the run has, errors in percent as results give them (``Progress``)::

    [B=16 plain_d32] epoch 30/300 (10%) 0:00:12 elapsed, ~0:01:48 left; train_loss 0.7100 test_error 31.0%
    [B=16 plain_d56] diverged in epoch 31 (runs 0, 2; 2 of 4 runs train on)
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from resjax.paths import as_path, is_url, write_atomically

__all__ = ["METRICS_FILE", "Progress", "RunLog", "current_log", "format_metric", "format_seconds", "log_to",
           "progress_bar", "resolve_log", "seed_names"]

#: The metrics file's name inside a log directory.
METRICS_FILE = "metrics.jsonl"
_CURRENT: list[RunLog] = []  # the RunLog of the innermost log_to block
_FILE_LOCK = threading.Lock()  # metrics.jsonl's reads and writes (cells side by side write from threads)


def format_seconds(seconds: float) -> str:
    """``h:mm:ss`` (``'?'`` when not finite)."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _is_main() -> bool:
    from resjax.train.distributed import is_main_process

    return is_main_process()


def _number(v: Any) -> float | None:
    """A JSON number (a float32 value written as its shortest decimal, 0.005 not 0.004999999888), or None for
    NaN and infinities."""
    if not math.isfinite(float(v)):
        return None
    return float(str(v)) if isinstance(v, np.float32) else float(v)


class RunLog:
    """A metrics file (``metrics.jsonl``) and, optionally, TensorBoard event files in ``directory``; see
    the module docstring. ``cell``: the name written on every line (``cell()`` gives a copy for another).
    ``step_period``: set by a step run (``train.steps``), whose "epochs" are periods of that many steps: every line
    also carries ``step``, the steps done at the end of its period."""

    step_period: int | None = None

    def __init__(self, directory: str | os.PathLike, cell: str | None = None, tensorboard: bool = False,
                 progress: bool = False) -> None:
        if directory is None or str(directory) == "":
            raise ValueError("log: needs a directory, got an empty path")
        self.directory = as_path(directory, "log")  # a local folder or a bucket URL (resjax.paths)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"log: {self.directory} is a file, not a directory")
        self.path = self.directory / METRICS_FILE
        self.name = cell
        self.progress = bool(progress)  # calls given no progress= show progress, labelled by their cell
        self.tensorboard = bool(tensorboard)
        if self.tensorboard:
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                raise ValueError("log: tensorboard=True needs tensorboardX "
                                 "(pip install 'resjax[tensorboard]')") from None
        self._writer = None
        self._staging: pathlib.Path | None = None  # a bucket log's local folder of event files (_tensorboard)
        self._names: dict[str, int] = {}
        self._start = time.time()

    def cell(self, name: str | None) -> RunLog:
        """This log for the cell ``name`` (a repeated name gets ``#2``, ``#3``, ...: cells are told apart in
        call order, the same in a resumed process)."""
        name = name or self.name or "run"
        with _FILE_LOCK:
            count = self._names[name] = self._names.get(name, 0) + 1
        other = copy.copy(self)  # shares the count of names (self._names) with this log
        other.name = name if count == 1 else f"{name}#{count}"
        other._writer, other._staging, other._start = None, None, time.time()
        return other

    def start(self, done: int, history: dict | None = None) -> None:
        """Begin (or resume) this cell ``done`` epochs in: lines of this cell past epoch ``done`` (written
        by a run that was stopped after its last checkpoint) are dropped, so every epoch is logged once. With
        ``history`` (the resumed run's: name -> ``(runs, epochs)``, or ``(epochs,)`` for one run), epochs
        ``1 .. done`` the file lacks (a new file, or one started afresh since) are written from it, so every
        epoch is logged, once."""
        self._start = time.time()
        if not _is_main():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with _FILE_LOCK:  # cells side by side (resjax.train.side_by_side) share the file
            lines = self._lines()
            keep = [line for line in lines if not self._later(line, done)]
            if len(keep) != len(lines):
                with self._storage_refusal("rewriting"):
                    write_atomically(self.path, lambda tmp: tmp.write_text("".join(keep)),
                                     f".{METRICS_FILE}.{os.getpid()}.tmp")
        if history and done:
            logged = {self._epoch(line) for line in keep} - {None}
            history = {k: np.asarray(v) if np.ndim(v) > 1 else np.asarray(v)[None] for k, v in history.items()}
            missing = [e for e in range(1, done + 1) if e not in logged]  # usually none, or all (a new file)
            if len(missing) == done:
                self.write(0, {k: v[:, :done] for k, v in history.items()})
            for epoch in missing if len(missing) < done else ():
                self.write(epoch - 1, {k: v[:, epoch - 1:epoch] for k, v in history.items()})

    def _lines(self) -> list[str]:
        """The lines of the metrics file (none when there is none). A file that cannot be read (bytes that are
        not UTF-8, a folder in its place) is set aside as ``metrics.jsonl.unreadable`` (numbered if that exists)
        with a message naming both, and the run goes on with a new file: a resumed cell writes its epochs again
        from its checkpoint's history (``start``), so nothing the checkpoint holds is lost (#54)."""
        if not self.path.exists() and not (isinstance(self.path, pathlib.Path) and self.path.is_symlink()):
            return []
        try:
            lines = self.path.read_text().splitlines(keepends=True)
        except (UnicodeDecodeError, OSError) as err:
            reason = err.reason if isinstance(err, UnicodeDecodeError) else (err.strerror or str(err))
            return self._set_aside(reason)
        # a line that is not JSON: the last one, cut short by a kill (no newline), is dropped by the rewrite; any
        # other is not this log's (a file of something else, damaged), so the file is kept aside, not overwritten
        bad = [i for i, line in enumerate(lines) if not _is_json(line)]
        if bad and (bad != [len(lines) - 1] or lines[-1].endswith("\n")):
            return self._set_aside(f"line {bad[0] + 1} of {len(lines)} is not a JSON record")
        return lines

    def _set_aside(self, reason: str) -> list[str]:
        aside, n = self.path.with_name(f"{METRICS_FILE}.unreadable"), 1
        while aside.exists():
            aside, n = self.path.with_name(f"{METRICS_FILE}.unreadable-{n}"), n + 1
        self.path.rename(aside)
        print(f"resjax: log: {self.path} cannot be read ({reason}); set aside as {aside}, and a new file is "
              "started (a resumed run writes its epochs again from its checkpoint)", file=sys.stderr, flush=True)
        return []

    @contextlib.contextmanager
    def _storage_refusal(self, doing: str) -> Iterator[None]:
        """A write of the metrics file refused by the storage (full, read-only, no permission) as
        ``resjax.train.storage.StorageError`` naming the folder."""
        from resjax.train.storage import raise_storage_error

        try:
            yield
        except OSError as err:
            raise_storage_error(err, self.directory, "log", f"{doing} {METRICS_FILE}",
                                "the run's checkpoints are kept: the same command resumes from the newest once "
                                "there is room")
            raise

    def _epoch(self, line: str) -> int | None:
        """The epoch of a line of this cell (None for another cell's, or a line cut short)."""
        try:
            row = json.loads(line)
        except ValueError:
            return None
        return int(row.get("epoch", 0)) if row.get("cell") == self.name else None

    def _later(self, line: str, done: int) -> bool:
        try:
            row = json.loads(line)
        except ValueError:
            return True  # a line cut short by a kill: dropped
        return row.get("cell") == self.name and int(row.get("epoch", 0)) > done

    def write(self, first: int, metrics: dict) -> None:
        """Log epochs ``first + 1 ...`` from ``metrics``: name -> array ``(runs, epochs)``, or for one epoch
        ``(runs,)`` or a scalar (one run)."""
        if not _is_main():
            return
        shaped = {}
        for k, v in metrics.items():
            v = np.asarray(v)
            v = v if v.dtype == np.float32 else v.astype(np.float64)
            shaped[k] = v.reshape(-1, 1) if v.ndim <= 1 else v
        runs, epochs = next(iter(shaped.values())).shape if shaped else (0, 0)
        now, elapsed = time.time(), time.time() - self._start
        rows = []
        for e in range(epochs):
            for r in range(runs):
                row = {"cell": self.name, "run": r, "epoch": first + e + 1}
                if self.step_period:
                    row["step"] = (first + e + 1) * self.step_period
                row.update({k: _number(v[r, e]) for k, v in shaped.items()})
                row.update(elapsed_s=round(elapsed, 3), time=round(now, 3))
                rows.append(row)
        self.directory.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(row) + "\n" for row in rows)
        with _FILE_LOCK, self._storage_refusal("appending to"):
            if is_url(self.path):  # an object cannot be appended to: written again whole (one request: whole or old)
                self.path.write_text((self.path.read_text() if self.path.exists() else "") + text)
            else:
                with open(self.path, "a") as f:
                    f.write(text)
                    f.flush()
        if self.tensorboard:
            writer = self._tensorboard()
            for row in rows:
                for k, v in row.items():
                    if k not in ("cell", "run", "epoch", "time") and v is not None:
                        writer.add_scalar(f"{self.name}/{k}/run{row['run']}", v, row["epoch"])
            writer.flush()
            self._upload_events()

    def _tensorboard(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            if is_url(self.directory):  # tensorboardX's own bucket writers need other clients: staged here
                import tempfile

                self._staging = pathlib.Path(tempfile.mkdtemp(prefix="resjax-tensorboard-"))
            self._writer = SummaryWriter(str(self._staging or self.directory))
        return self._writer

    def _upload_events(self) -> None:
        """A bucket log's event files, written by tensorboardX into a local folder, copied whole into the bucket
        after each flush (an object cannot be appended to), through the path layer: the run's own credentials
        and endpoint, as its checkpoints and metrics. A resumed process writes an event file of its own beside
        the earlier ones (tensorboardX names each by time, host and process), which TensorBoard reads together."""
        if self._staging is None:
            return
        with self._storage_refusal("writing the TensorBoard events beside"):
            for event in sorted(self._staging.rglob("*")):
                if event.is_file():
                    (self.directory / event.relative_to(self._staging).as_posix()).write_bytes(event.read_bytes())

    def close(self) -> None:
        """Close the TensorBoard writer (the metrics file is closed after every write); a bucket log's event files
        are copied there a last time."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._upload_events()
            if self._staging is not None:
                import shutil

                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None


@contextlib.contextmanager
def log_to(directory: str | os.PathLike, name: str | None = None, tensorboard: bool = False, progress: bool = False,
           fresh: bool = False) -> Iterator[RunLog]:
    """Inside the block, every ``fit``/``sweep`` given no ``log`` logs to ``directory`` (a cell per call, named
    by its progress label or else ``name``; see the module docstring). ``progress``: calls given no
    ``progress`` show it (labelled by their cell). ``fresh``: start a new ``metrics.jsonl`` (the old one is
    removed)."""
    log = RunLog(directory, cell=name, tensorboard=tensorboard, progress=progress)
    if fresh and _is_main() and log.path.exists():
        log.path.unlink()
    _CURRENT.append(log)
    try:
        yield log
    finally:
        _CURRENT.remove(log)
        log.close()


def current_log() -> RunLog | None:
    """The ``RunLog`` of the innermost ``log_to`` block, or None."""
    return _CURRENT[-1] if _CURRENT else None


def resolve_log(log: RunLog | str | os.PathLike | None, progress: Any) -> tuple[RunLog | None, Any]:
    """``(cell log, progress)`` of one ``fit``/``sweep`` call: ``log`` (a ``RunLog`` or a directory) or the
    ``log_to`` default, named by the call's progress label; ``progress`` None becomes the cell's name when
    the log asks for progress."""
    if log is None:
        log = current_log()
        if log is None:
            return None, progress
    elif not isinstance(log, RunLog):
        log = RunLog(log)
    cell = log.cell(progress if isinstance(progress, str) else None)
    return cell, (cell.name if progress is None and log.progress else progress)


def seed_names(keys: Any) -> list[str] | None:
    """The names of a call's runs for its progress lines: the seeds of a seed integer or a list of distinct ones
    (``[3, 4]``: ``['3', '4']``); None for PRNG keys, a run state or repeated seeds (a grid), whose runs are named
    by their index."""
    if isinstance(keys, (int, np.integer)) and not isinstance(keys, bool):
        return [str(int(keys))]
    if isinstance(keys, (list, tuple)) or (isinstance(keys, np.ndarray) and keys.dtype.kind in "iu"):
        flat = np.asarray(keys).reshape(-1)
        if flat.dtype.kind in "iu" and len(flat) and len(set(flat.tolist())) == len(flat):
            return [str(int(k)) for k in flat]
    return None


def format_metric(name: str, value: float) -> str:
    """A metric as the progress lines show it: an error (a name ending in ``error``: a fraction in the history)
    in percent, ``57.6%``, as results and figures give it; anything else with 4 decimals, or 4 significant
    digits when very large or small."""
    if name.endswith("error"):
        return f"{100 * value:.1f}%"
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e4 else f"{value:.3e}"


class Progress:
    """One progress display for both feeders: a tqdm bar (``progress`` True or a label) on a terminal, plain
    lines when stderr is not one (see the module docstring), or ``progress(epochs_done, summary)`` called with
    the last epoch's metrics (numpy, per seed). ``step_period`` (a step run's, set by its feeder): the lines count
    steps, ``step 500/6000``, where an epoch run's count epochs (the callback still gets the periods done).

    What a line shows: the mean over the runs that have not diverged of ``train_loss`` and of the test metrics
    the run has (``test_error`` and the other metrics of its objective; ``test_loss`` for an objective without
    metrics, such as ``'mse'``), each only where it has a value: an epoch that was not evaluated
    (``train.eval_every``) shows no test metric. Errors are in percent. A run that diverges is said once,
    ``[cell] diverged in epoch 3 (seed 0; 1 of 2 runs train on)``, and left out of the means; once every run
    has diverged, no more lines (the bar still counts)."""

    step_period: int | None = None
    #: The runs' names (``seed_names``: their seeds), set by the feeder; None names them by their index.
    run_names: list[str] | None = None

    def __init__(self, total: int, done: int, progress: bool | str | Callable[[int, dict], None],
                 stream: Any = None) -> None:
        self.callback = progress if callable(progress) else None
        self.bar = None
        self.label = progress if isinstance(progress, str) else "epochs"
        self.total, self.first, self.start = total, done, time.time()
        self.reported: set[int] = set()  # the runs whose divergence has been said
        if self.callback is None:
            err = sys.stderr if stream is None else stream
            if hasattr(err, "isatty") and err.isatty():  # a terminal: a bar; otherwise update prints lines
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=done, desc=self.label, unit="epoch", leave=False, file=err)

    def shown(self, summary: dict, alive: np.ndarray | None = None) -> dict[str, str]:
        """``{name: text}`` of what a line shows of ``summary`` (see the class docstring); ``alive``: a mask of
        the runs that have not diverged (None: all)."""
        tests = [k for k in summary if k.startswith("test_") and k != "test_loss"]
        shown = {}
        for name in ("train_loss", *(tests or ["test_loss"])):
            if name not in summary:
                continue
            v = np.asarray(summary[name], np.float64).reshape(-1)
            if alive is not None and alive.shape == v.shape:
                v = v[alive]
            v = v[np.isfinite(v)]
            if v.size:
                shown[name] = format_metric(name, float(v.mean()))
        return shown

    def divergences(self, diverged: dict | None) -> list[str]:
        """The lines saying which runs diverged since the last update (each run once), from ``diverged``
        (``resjax.train.core.divergence``'s ``diverged_epoch`` and ``diverged_step``, per run; 1-based, -1
        for none)."""
        if diverged is None:
            return []
        epoch = np.atleast_1d(np.asarray(diverged["diverged_epoch"])).reshape(-1)
        step = np.atleast_1d(np.asarray(diverged.get("diverged_step", epoch))).reshape(-1)
        new = [i for i in np.flatnonzero(epoch >= 0).tolist() if i not in self.reported]
        names = self.run_names if self.run_names is not None and len(self.run_names) == len(epoch) else None
        lines, n = [], len(epoch)
        when = {i: (f"at step {int(step[i])}" if self.step_period else f"in epoch {int(epoch[i])}") for i in new}
        for moment in dict.fromkeys(when[i] for i in new):
            runs = [i for i in new if when[i] == moment]
            what = ("seed" if names else "run") + ("s" if len(runs) > 1 else "")
            which = ", ".join(names[i] if names else str(i) for i in runs)
            self.reported.update(runs)
            left = n - len(self.reported)
            going = "" if n == 1 else "; every run has diverged" if not left else f"; {left} of {n} runs train on"
            lines.append(f"[{self.label}] diverged {moment} ({what} {which}{going})")
        return lines

    def update(self, done: int, last: int, summary: dict, diverged: dict | None = None) -> None:
        """Report ``done`` epochs complete (``last`` at the previous report): the callback gets ``(done,
        summary)``; the bar advances by ``done - last`` (or a line is printed) and shows ``summary`` as the class
        docstring says, after a line for each run that ``diverged`` (see ``divergences``) since the last
        report."""
        if self.callback is not None:
            self.callback(done, summary)
            return
        said = self.divergences(diverged)
        alive = None
        if diverged is not None:
            alive = np.atleast_1d(np.asarray(diverged["diverged_epoch"])).reshape(-1) < 0
        post = self.shown(summary, alive)
        if self.bar is not None:
            for line in said:
                self.bar.write(line, file=self.bar.fp)
            self.bar.update(done - last)
            self.bar.set_postfix(post)
            return
        if not _is_main():
            return
        for line in said:
            print(line, flush=True)
        if alive is not None and not alive.any():  # every run has diverged: said once, nothing more to show
            return
        elapsed = time.time() - self.start
        rate = elapsed / (done - self.first) if done > self.first else math.nan
        left = rate * (self.total - done)
        k, unit = (self.step_period, "step") if self.step_period else (1, "epoch")
        metrics = " ".join(f"{name} {text}" for name, text in post.items())
        print(f"[{self.label}] {unit} {k * done}/{k * self.total} ({100 * done / self.total:.0f}%) "
              f"{format_seconds(elapsed)} elapsed, ~{format_seconds(left)} left" + (f"; {metrics}" if metrics else ""),
              flush=True)

    def close(self) -> None:
        """Close the bar (nothing to do for a callback or lines)."""
        if self.bar is not None:
            self.bar.close()


def progress_bar(total: int, done: int, progress: bool | str | Callable[[int, dict], None] | None) -> Progress | None:
    """A ``Progress`` for ``progress`` (True, a label or a callback) over ``total`` epochs, ``done`` already
    done; None when ``progress`` is false or None (no display)."""
    return Progress(total, done, progress) if progress else None
