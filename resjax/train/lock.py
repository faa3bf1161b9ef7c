"""One run per directory: ``DirectoryLock(directory)``, a lock file naming the process that uses the directory.

Two runs writing one checkpoint directory corrupt each other (each one's saves are skipped as "step exists"
or overwrite the other's), so a training run locks its checkpoint directory (``Core.open_checkpoints``) and
an experiment its output folder (``experiments.common.run_experiment``) for as long as it runs. The lock is
the file ``DIR/.resjax.lock``, created atomically (``O_CREAT | O_EXCL``), holding the owner's process id,
host and start time as JSON. A second run is refused at its start with a ``ValueError`` naming the directory
and the process that holds it. A lock whose process is no longer running on this host (killed by SIGKILL, a
crash, a lost machine's restart) is stale: it is reported and taken over. A lock from another host cannot be
checked and is refused with the path to remove if that run is gone. With several processes, process 0 alone
locks (they share the directory by design).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import time

__all__ = ["LOCK_FILE", "DirectoryLock", "release_all"]

#: The lock file's name inside a locked directory.
LOCK_FILE = ".resjax.lock"
_HELD: list[DirectoryLock] = []  # the locks this process holds (release_all)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class DirectoryLock:
    """The lock of ``directory`` (see the module docstring); ``setting`` names it in messages."""

    def __init__(self, directory: str | os.PathLike, setting: str = "checkpoint_dir") -> None:
        self.directory = pathlib.Path(directory)
        self.path = self.directory / LOCK_FILE
        self.setting = setting
        self.held = False

    def acquire(self) -> DirectoryLock:
        """Take the lock (creating the directory); ``ValueError`` when a running process holds it."""
        from resjax.train.distributed import is_main_process

        if not is_main_process():
            return self
        try:  # a path through a file, a read-only or full disk: found here, before any training
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".resjax.probe.{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ValueError(f"{self.setting}: cannot write into {self.directory} ({err.strerror or err})") from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):  # a stale lock removed, or a racing run's lock gone, then one more try
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_clear()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            self.held = True
            _HELD.append(self)
            return self
        raise ValueError(f"{self.setting}: could not lock {self.directory} (its lock file {self.path} keeps coming "
                         "back)")

    def _refuse_or_clear(self) -> None:
        try:
            held = json.loads(self.path.read_text())
            pid, host = int(held["pid"]), str(held["host"])
        except FileNotFoundError:
            return  # released meanwhile
        except (ValueError, KeyError, TypeError, OSError):
            held, pid, host = {}, -1, socket.gethostname()  # unreadable (cut short by a kill): stale
        here = host == socket.gethostname()
        if here and pid > 0 and pid != os.getpid() and _running(pid):
            raise ValueError(f"{self.setting}: {self.directory} is in use by process {pid} (since "
                             f"{held.get('started', '?')}); wait for that run to end or use another directory")
        if not here:
            raise ValueError(f"{self.setting}: {self.directory} is in use by process {pid} on host {host} (since "
                             f"{held.get('started', '?')}); if that run is gone, remove {self.path}")
        print(f"resjax: {self.setting}: taking over the stale lock of {self.directory} (process {pid} is not "
              "running)", file=sys.stderr, flush=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Give the lock up (nothing when it is not held)."""
        if self.held:
            self.held = False
            if self in _HELD:
                _HELD.remove(self)
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def release_all() -> None:
    """Give up every lock this process holds: for an exit that skips ``finally`` blocks (``os._exit`` after a
    stop signal, ``experiments.checkpoints``), so the next run finds no stale lock."""
    for lock in list(_HELD):
        lock.release()
