"""Storage that refuses a write: a full disk, a quota, a read-only file system, no permission (issue #54).

Every place a run writes (its lock, its checkpoints, ``metrics.jsonl``, an experiment's results and report) turns
such an error into one :class:`StorageError`: a line naming the setting and the folder, what happened, what to
free or change, and what is intact (the previous checkpoint), instead of an ``OSError`` or Orbax's
``RESOURCE_EXHAUSTED`` with the tracebacks of its writer threads. The experiments' command lines print it as that
one line and exit with status 1. A run stopped so loses nothing it had saved: the same command, once there is
room, resumes from the newest checkpoint.

Other ``OSError``\\ s (a path through a file, a missing parent on a read) keep their own handling.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import shutil
from typing import NoReturn

__all__ = ["PROBE_BYTES", "StorageError", "free_bytes", "probe_writable", "raise_storage_error", "storage_errno"]

#: Bytes the write probe writes (``probe_writable``): a disk that cannot take these cannot take a lock or a result.
PROBE_BYTES = 4096

#: The errors this module explains, with what to do about each.
_ADVICE = {
    errno.ENOSPC: ("no space is left on its disk", "free some space there or choose another folder"),
    errno.EDQUOT: ("the disk quota there is used up", "free some space there or choose another folder"),
    errno.EROFS: ("it is on a read-only file system", "choose a folder on a writable disk"),
    errno.EACCES: ("this process may not write there", "change the folder's permissions or choose another folder"),
    errno.EPERM: ("this process may not write there", "change the folder's permissions or choose another folder"),
}
# How TensorStore (Orbax's array writer) reports the same errors: in its message, with the OS's error number.
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='?(\d+)")
_TEXT_ERRNO = (("No space left on device", errno.ENOSPC), ("Disk quota exceeded", errno.EDQUOT),
               ("Read-only file system", errno.EROFS), ("Permission denied", errno.EACCES))


class StorageError(OSError):
    """A write refused by the storage under ``directory`` (see the module docstring): ``setting`` (what names the
    folder: ``checkpoint_dir``, ``out``, ...), ``directory`` and ``errno``; ``str()`` is the whole message."""

    def __init__(self, message: str, code: int, directory: str | os.PathLike, setting: str) -> None:
        super().__init__(code, message)
        self.message, self.directory, self.setting = message, str(directory), setting

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # raised in one process, reported by another (the suite's, reproduce's workers)
        return (type(self), (self.message, self.errno, self.directory, self.setting))


def storage_errno(err: BaseException) -> int | None:
    """The error number of a refused write behind ``err`` (an ``OSError``, or Orbax's and TensorStore's
    ``ValueError`` whose message carries it, or an error caused by one), when it is one this module explains."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "errno", None) if isinstance(err, OSError) else None
        if code is None:
            text = str(err)
            match = _TENSORSTORE_ERRNO.search(text)
            code = int(match.group(1)) if match else next((c for t, c in _TEXT_ERRNO if t in text), None)
        if code in _ADVICE:
            return code
        err = err.__cause__ or err.__context__
    return None


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Free bytes on the disk that holds ``directory`` (its nearest existing parent), None when it cannot be asked."""
    path = os.path.abspath(os.fspath(directory))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} kB"


def raise_storage_error(err: BaseException, directory: str | os.PathLike, setting: str, doing: str,
                        intact: str | None = None) -> None:
    """Raise :class:`StorageError` from ``err`` when it is a refused write (``storage_errno``), saying that it
    happened while ``doing`` in ``directory`` and what is ``intact``; return when it is not one."""
    code = storage_errno(err)
    if code is None:
        return
    _raise(code, directory, setting, doing, intact, err)


def _raise(code: int, directory, setting: str, doing: str, intact: str | None, err: BaseException) -> NoReturn:
    what, fix = _ADVICE[code]
    free = free_bytes(directory) if code in (errno.ENOSPC, errno.EDQUOT) else None
    message = (f"{setting}: could not write into {os.fspath(directory)} while {doing}: {what}"
               + (f" ({_size(free)} free)" if free is not None else "") + f"; {fix}"
               + (f"; {intact}" if intact else "") + ".")
    raise StorageError(message, code, directory, setting) from err


def probe_writable(directory: str | os.PathLike, setting: str) -> None:
    """Create ``directory`` and write (then remove) a file of :data:`PROBE_BYTES` bytes in it, so that a full,
    read-only or forbidden folder is found before any training: :class:`StorageError`; a path that cannot be a
    folder (through a file): ``ValueError`` naming ``setting``."""
    directory = pathlib.Path(directory)
    probe = directory / f".resjax.probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise_storage_error(err, directory, setting, "checking that it can be written")
        raise ValueError(f"{setting}: cannot write into {directory} ({err.strerror or err})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
