"""The files an experiment writes: which process writes them, written whole or not at all, and folder locks.

The lowest layer of ``experiments``: every other helper module (``experiments.checkpoints``, the figures, the run
control) writes through here, and this module imports nothing of ``experiments``.

Locks (issue #22 item 4, #32): a run takes the lock of each folder it writes or deletes in
(``resjax.train.lock.DirectoryLock``) before it changes anything there: the output folder for the whole run, the
checkpoint root for the whole run once the root exists (``experiments.checkpoints``), and a cell's folder before
``--fresh`` empties it. A folder another running process holds is refused with :class:`FolderInUseError`, a
``ValueError`` naming the folder's setting, the folder and the process (its id, host, start time and, on this host,
its command line); the entry points print it as one line and exit with status 75 (``EX_TEMPFAIL``: try again
later), nothing in that folder changed.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FolderInUseError", "acquire", "is_main", "lock_folder", "write_atomically"]


def is_main() -> bool:
    """Whether this process writes files: always with one process, process 0 of several."""
    from resjax.train.distributed import is_main_process

    return is_main_process()


def write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], Any], setting: str = "out") -> None:
    """``write(tmp)`` then ``tmp`` renamed to ``path``: ``path`` is the old file or the whole new one, never a
    part; a failed write leaves no temporary file behind. A write the storage refuses (a full disk, a read-only
    file system, no permission) is ``resjax.train.storage.StorageError`` naming ``setting`` and the folder."""
    from resjax import paths
    from resjax.train.storage import raise_storage_error

    path = paths.as_path(path, setting)  # a local file, or an object in a bucket (written in one request: whole)
    existed = path.exists()
    try:
        paths.write_atomically(path, write, f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    except OSError as err:
        raise_storage_error(err, path.parent, setting, f"writing {path.name}",
                            f"{path.name} {'keeps its previous content' if existed else 'was not written'}, and "
                            "the checkpoints are kept: the same command writes it once there is room")
        raise


class FolderInUseError(ValueError):
    """A folder a run would write or delete in is locked by another running process (see the module docstring).
    ``directory``: the folder; ``holder``: the lock's record (``pid``, ``host``, ``started``), and ``command``, the
    process's command line where this host can read it."""

    def __init__(self, message: str, directory: pathlib.Path, holder: dict) -> None:
        super().__init__(message)
        self.directory = directory
        self.holder = holder


def _command_of(pid: int) -> str | None:
    """The command line of process ``pid`` on this host (Linux's ``/proc``), None where it cannot be read."""
    try:
        words = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text or None


@contextlib.contextmanager
def lock_folder(directory, setting: str) -> Iterator[Any]:
    """Inside the block this process holds ``DirectoryLock(directory, setting)`` (``resjax.train.lock``; the
    folder is created). Another running process's lock is :class:`FolderInUseError`: ``'<setting>: <directory>
    is in use by process <pid> on host <host> (since <time>; command: <its command line>); ...'``."""
    lock = acquire(directory, setting)
    try:
        yield lock
    finally:
        lock.release()


def acquire(directory, setting: str):
    """``DirectoryLock(directory, setting)`` acquired (``release()`` it), or :class:`FolderInUseError` naming the
    process that holds it (see :func:`lock_folder`)."""
    from resjax.train.lock import DirectoryLock, LockHeldError

    lock = DirectoryLock(directory, setting)
    try:
        return lock.acquire()
    except LockHeldError as err:
        if not err.holder:  # a lock file that cannot be read: the library's message names the file to remove
            raise FolderInUseError(str(err), lock.directory, {}) from None
        pid, host = err.holder.get("pid"), err.holder.get("host")
        here = host == socket.gethostname()
        command = _command_of(int(pid)) if here else None
        holder = {**err.holder, "command": command}
        advice = ("wait for that run to end, or use another folder" if here else
                  f"wait for that run to end, or use another folder; if that run is gone, remove {err.path}")
        raise FolderInUseError(
            f"{setting}: {lock.directory} is in use by process {pid} on host {host} (since "
            f"{holder.get('started', '?')}" + (f"; command: {command}" if command else "") + "); nothing in it was "
            f"changed: {advice}", lock.directory, holder) from None
