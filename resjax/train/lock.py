"""One run per directory: ``DirectoryLock(directory)``, a lock file naming the process that uses the directory.

Two runs writing one checkpoint directory corrupt each other (each one's saves are skipped as "step exists"
or overwrite the other's), so a training run locks its checkpoint directory (``Core.open_checkpoints``) and
an experiment its output folder (``experiments.common.run_experiment``) for as long as it runs. The lock is
the file ``DIR/.resjax.lock``, holding the owner's process id, host, start time and a token unique to this
acquisition as JSON. A second run is refused at its start with :class:`LockHeldError` (a ``ValueError``) naming
the directory and the process that holds it. With several processes, process 0 alone locks (they share the
directory by design).

How a lock is taken (issue #54): the holder's record is written whole to a temporary file of this process, which
is then hard-linked to ``.resjax.lock`` (``link`` fails when the name exists: create-if-absent, atomically). So
a lock file is never seen empty or half written, by any reader; and a full disk fails while writing the record,
before any lock file exists. Every acquirer on this host does its read-judge-take-over-create sequence while
holding an exclusive ``flock`` on the directory itself, so two processes that find the same stale lock cannot
both take it over (the second one finds the first one's new lock, held by a running process). Where ``flock``
or ``link`` is not available (some network file systems), the same steps run without it (``O_EXCL`` creation).

On a bucket (``gs://``, ``s3://``: ``resjax.paths``) there is no ``O_EXCL``, no ``link`` and no process id to
check, so the lock is an object created only if absent, with the store's own precondition (GCS
``ifGenerationMatch=0``, S3 ``If-None-Match: *``), holding the same record and a lease: the holder rewrites it
every ``lease/3`` seconds (on the condition that it is still the version the holder wrote: GCS
``ifGenerationMatch``, S3 ``If-Match``), so a run that is alive keeps it. A lock whose lease has run out (the
object not rewritten for ``lease`` seconds: a lost VM) is taken over with a message, by a conditional rewrite that
only one taker can win; a live one is refused naming its holder. A lock whose holder ran on this machine (the
same kernel boot and process namespace, recorded with it) and whose process is gone (SIGKILL, a crash) is taken
over at once, with a message, as a local folder's is: a restart loop on the VM does not wait out the lease. After
its write the taker reads the lock back and holds it only if the record there is its own. Giving the lock up
deletes it only while it is still the version this run wrote (a conditional delete): a run that stalled past its
lease never removes the lock of the run that took over. The lease is :data:`LEASE_S` seconds
(``RESJAX_LOCK_LEASE_S`` overrides it). The tests' stores (a GCS server and an S3 server) both honour the
preconditions; each step of the protocol is tested against a run that interleaves with it
(``tests/test_bucket_lock.py``).

Judging a lock that is there (in a local folder):

- its process runs on this host: refused, naming the process;
- its process is not running on this host (killed by SIGKILL, a crash, a lost machine's restart): stale; it is
  reported and taken over;
- it comes from another host: that host's processes cannot be checked, so it is refused, naming the file to
  remove if that run is gone;
- it cannot be read (not JSON: written by an older resjax or damaged): refused, naming the file, unless its age
  (the file's modification time) is over :data:`UNREADABLE_STALE_S`, which proves no run is still writing it;
  then it is reported and taken over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import socket
import sys
import time
import uuid
from collections.abc import Iterator

__all__ = ["LEASE_S", "LOCK_FILE", "UNREADABLE_STALE_S", "DirectoryLock", "LockHeldError", "release_all"]

#: The lock file's name inside a locked directory.
LOCK_FILE = ".resjax.lock"
#: An unreadable lock file older than this many seconds is stale (no run takes that long to write a few bytes).
UNREADABLE_STALE_S = 60.0
#: Seconds a bucket lock's lease lasts without renewal (renewed every third of it while the run lives).
LEASE_S = 60.0
_HELD: list[DirectoryLock] = []  # the locks this process holds (release_all)


class LockHeldError(ValueError):
    """A directory locked by another process (or by a lock file that cannot be read): ``directory``, ``path``
    (its lock file) and ``holder`` (the lock's record: ``pid``, ``host``, ``started``; empty when unreadable)."""

    def __init__(self, message: str, directory: pathlib.Path, path: pathlib.Path, holder: dict) -> None:
        super().__init__(message)
        self.directory, self.path, self.holder = directory, path, holder


def _machine() -> str:
    """This kernel's boot id and this process's pid namespace: two processes with the same value see the same
    process ids, so one of them can tell whether the other is running ('' where it cannot be read)."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


@contextlib.contextmanager
def _acquirers_serialised(directory: pathlib.Path) -> Iterator[None]:
    """Inside the block no other process on this host (sharing this file system) is inside it for the same
    directory: an exclusive ``flock`` on the directory, held for the few file operations of an acquisition.
    Where the file system cannot lock a directory, nothing is held (the lock file's atomic creation remains)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield
    finally:
        os.close(fd)  # closing releases the flock


class DirectoryLock:
    """The lock of ``directory`` (see the module docstring); ``setting`` names it in messages."""

    def __init__(self, directory: str | os.PathLike, setting: str = "checkpoint_dir") -> None:
        from resjax.paths import as_path, is_url

        self.directory = as_path(directory, setting)
        self.path = self.directory / LOCK_FILE
        self.setting = setting
        self.held = False
        self.token: str | None = None
        self._bucket = _BucketLock(self) if is_url(self.directory) else None

    def acquire(self) -> DirectoryLock:
        """Take the lock (creating the directory); :class:`LockHeldError` when a running process holds it,
        ``resjax.train.storage.StorageError`` when the directory cannot be written (full, read-only, no
        permission), ``ValueError`` naming the setting for a path that cannot be a directory."""
        from resjax.train.distributed import is_main_process
        from resjax.train.storage import probe_writable

        if not is_main_process():
            return self
        if self._bucket is not None:
            self._bucket.acquire()
            self.held, self.token = True, self._bucket.token
            _HELD.append(self)
            return self
        probe_writable(self.directory, self.setting)  # a full, read-only or forbidden folder: found here
        token = uuid.uuid4().hex
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "token": token}
        record = self.directory / f".resjax.lock.{os.getpid()}.{token[:8]}.tmp"
        self._write_record(record, owner)
        try:
            with _acquirers_serialised(self.directory):
                for _ in range(3):  # a stale lock removed, or a racing run's lock gone, then one more try
                    if self._create(record):
                        self.held, self.token = True, token
                        _HELD.append(self)
                        return self
                    self._refuse_or_clear()
        finally:
            with contextlib.suppress(FileNotFoundError):
                record.unlink()
        raise ValueError(f"{self.setting}: could not lock {self.directory} (its lock file {self.path} keeps coming "
                         "back)")

    def _write_record(self, record: pathlib.Path, owner: dict) -> None:
        from resjax.train.storage import raise_storage_error

        try:
            with open(record, "x") as f:
                f.write(json.dumps(owner))
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            with contextlib.suppress(OSError):
                record.unlink()
            raise_storage_error(err, self.directory, self.setting, "writing its lock file")
            raise ValueError(f"{self.setting}: cannot write into {self.directory} ({err.strerror or err})") from None

    def _create(self, record: pathlib.Path) -> bool:
        """``record`` in place as the lock file, atomically and only if there is none; whether it was."""
        try:
            os.link(record, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK):
                raise
        try:  # a file system without hard links: exclusive creation, then the record written into it
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(record.read_text())
        return True

    def _refuse_or_clear(self) -> None:
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile
        except OSError as err:
            raise LockHeldError(f"{self.setting}: the lock file {self.path} cannot be read ({err.strerror or err}); "
                                f"if no run uses {self.directory}, remove it", self.directory, self.path, {}) from None
        try:
            held = json.loads(text)
            pid, host = int(held["pid"]), str(held["host"])
        except (ValueError, KeyError, TypeError):
            if age < UNREADABLE_STALE_S:
                raise LockHeldError(
                    f"{self.setting}: {self.directory} has a lock file that cannot be read ({self.path}, "
                    f"{len(text)} bytes, written {age:.0f} s ago); if no run uses that folder, remove it",
                    self.directory, self.path, {}) from None
            print(f"resjax: {self.setting}: taking over the unreadable lock of {self.directory} (its lock file is "
                  f"{age:.0f} s old)", file=sys.stderr, flush=True)
            self._remove_stale()
            return
        here = host == socket.gethostname()
        if here and pid > 0 and pid != os.getpid() and _running(pid):
            raise LockHeldError(f"{self.setting}: {self.directory} is in use by process {pid} (since "
                                f"{held.get('started', '?')}); wait for that run to end or use another directory",
                                self.directory, self.path, held)
        if not here:
            raise LockHeldError(f"{self.setting}: {self.directory} is in use by process {pid} on host {host} (since "
                                f"{held.get('started', '?')}); if that run is gone, remove {self.path}",
                                self.directory, self.path, held)
        print(f"resjax: {self.setting}: taking over the stale lock of {self.directory} (process {pid} is not "
              "running)", file=sys.stderr, flush=True)
        self._remove_stale()

    def _remove_stale(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def release(self) -> None:
        """Give the lock up (nothing when it is not held); the lock file is removed only while it is this
        acquisition's (its token), never another run's."""
        if self.held:
            self.held = False
            if self in _HELD:
                _HELD.remove(self)
            if self._bucket is not None:
                self._bucket.release()
                return
            try:
                mine = json.loads(self.path.read_text()).get("token") == self.token
            except (OSError, ValueError, AttributeError):
                mine = False
            if mine:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def release_all() -> None:
    """Give up every lock this process holds: for an exit that skips ``finally`` blocks (``os._exit`` after a
    stop signal, ``experiments.checkpoints``), so the next run finds no stale lock."""
    for lock in list(_HELD):
        lock.release()


class _BucketLock:
    """The lock of a bucket folder (see the module docstring): a create-if-absent object with a renewed lease."""

    def __init__(self, lock: DirectoryLock) -> None:
        self.lock = lock
        self.token: str | None = None
        self.version: str | None = None  # the generation (GCS) or ETag (S3) of the object this run wrote last
        self._stop = None
        self._thread = None

    def _store(self):
        from resjax.paths import filesystem

        fs, inner = filesystem(self.lock.path)
        return fs, inner

    def _record(self) -> bytes:
        lease = float(os.environ.get("RESJAX_LOCK_LEASE_S", LEASE_S))
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "machine": _machine(),
                           "started": self.started, "token": self.token, "lease_s": lease}).encode()

    def acquire(self) -> None:
        from resjax.paths import check_url

        check_url(self.lock.directory, self.lock.setting)  # reachable, the bucket there, writable: before training
        self.token, self.started = uuid.uuid4().hex, time.strftime("%Y-%m-%d %H:%M:%S")
        fs, key = self._store()
        for _ in range(3):
            current = _object(fs, key)
            if current is None:
                try:
                    self.version = _put(fs, key, self._record(), create=True)
                except FileExistsError:  # another run created it first: judged in the next round
                    continue
            else:
                self._judge(current)  # refuses a live holder; returns when its lease has run out
                try:
                    self.version = _put(fs, key, self._record(), match=current["version"])
                except FileExistsError:  # another run took it over first
                    continue
            mine = _object(fs, key)
            if mine is not None and mine["record"].get("token") == self.token:
                self._renew_in_background()
                return
        raise ValueError(f"{self.lock.setting}: could not lock {self.lock.directory} (its lock object "
                         f"{self.lock.path} keeps changing)")

    def _judge(self, current: dict) -> None:
        held, age = current["record"], current["age"]
        lease = float(held.get("lease_s", LEASE_S)) if isinstance(held, dict) else LEASE_S
        who = (f"process {held.get('pid', '?')} on host {held.get('host', '?')} (since {held.get('started', '?')})"
               if isinstance(held, dict) and held else "an unreadable lock object")
        if isinstance(held, dict) and _dead_here(held):
            print(f"resjax: {self.lock.setting}: taking over the lock of {self.lock.directory} from {who}: that "
                  "process ran on this machine and is not running", file=sys.stderr, flush=True)
            return
        if age < lease:
            raise LockHeldError(
                f"{self.lock.setting}: {self.lock.directory} is in use by {who}, whose lease was renewed {age:.0f} s "
                f"ago; if that run is gone, the lock is taken over {lease:.0f} s after its last renewal, or remove "
                f"{self.lock.path}", self.lock.directory, self.lock.path, held if isinstance(held, dict) else {})
        print(f"resjax: {self.lock.setting}: taking over the lock of {self.lock.directory} from {who}: its lease "
              f"ran out {age - lease:.0f} s ago (renewed every {lease / 3:.3g} s while a run lives)",
              file=sys.stderr, flush=True)

    def _renew_in_background(self) -> None:
        import threading

        self._stop = threading.Event()
        lease = float(os.environ.get("RESJAX_LOCK_LEASE_S", LEASE_S))

        def renew() -> None:
            fs, key = self._store()
            while not self._stop.wait(lease / 3):
                try:
                    self.version = _put(fs, key, self._record(), match=self.version)
                except FileExistsError:
                    print(f"resjax: {self.lock.setting}: the lock of {self.lock.directory} was taken over by another "
                          "run (this run's lease had run out); this run no longer holds it", file=sys.stderr,
                          flush=True)
                    return
                except Exception as err:  # noqa: BLE001  (a network hiccup: the next renewal tries again)
                    print(f"resjax: {self.lock.setting}: could not renew the lease of {self.lock.path} ({err})",
                          file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=renew, name="resjax-lock-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=30)
        fs, key = self._store()
        current = _object(fs, key)
        if current is not None and current["record"].get("token") == self.token:
            # only that version: a run that took the lock over since it was read keeps it
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                _delete(fs, key, current["version"])


def _dead_here(held: dict) -> bool:
    """Whether the lock's holder ran on this machine (its recorded ``machine`` is ours) and its process is gone."""
    try:
        pid = int(held.get("pid", 0))
    except (TypeError, ValueError):
        return False
    machine = held.get("machine")
    return bool(machine) and machine == _machine() and 0 < pid != os.getpid() and not _running(pid)


def _object(fs, key: str) -> dict | None:
    """The lock object at ``key``: ``{"record", "version", "age"}`` (its JSON, or {} when unreadable; the
    generation or ETag; seconds since it was last written), None when there is none."""
    fs.invalidate_cache()
    try:
        info = fs.info(key)
        data = fs.cat_file(key)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
        record = record if isinstance(record, dict) else {}
    except ValueError:
        record = {}
    version = info.get("generation") or info.get("ETag") or info.get("etag")
    written = info.get("updated") or info.get("LastModified") or info.get("mtime")
    return {"record": record, "version": None if version is None else str(version), "age": _age(written)}


def _age(written) -> float:
    import datetime

    if written is None:
        return float("inf")
    if isinstance(written, str):
        written = datetime.datetime.fromisoformat(written.replace("Z", "+00:00"))
    if isinstance(written, datetime.datetime):
        if written.tzinfo is None:
            written = written.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, time.time() - written.timestamp())
    return max(0.0, time.time() - float(written))


def _protocol(fs) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


@contextlib.contextmanager
def _precondition_refused(key: str) -> Iterator[None]:
    """S3's refusal of a conditional write or delete (412, which s3fs raises as an ``OSError``) as
    ``FileExistsError(key)``: another run wrote the object since."""
    try:
        yield
    except OSError as err:
        if "pre-condition" in str(err) or "PreconditionFailed" in str(err) or isinstance(err, FileExistsError):
            raise FileExistsError(key) from None
        raise


def _delete(fs, key: str, match: str | None) -> None:
    """Delete the object ``key`` only if it is still at version ``match`` (GCS ``ifGenerationMatch``, S3
    ``If-Match``); ``FileExistsError`` when it is not (another run rewrote it). Unconditional where the store has
    no version to match."""
    protocol = _protocol(fs)
    bucket, _, name = key.partition("/")
    if match is not None and protocol in ("gs", "gcs"):
        from urllib.parse import quote

        fs.call("DELETE", f"{fs._location}/storage/v1/b/{bucket}/o/{quote(name, safe='')}", ifGenerationMatch=match)
    elif match is not None and protocol in ("s3", "s3a"):
        with _precondition_refused(key):
            fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=match)
    else:
        fs.rm_file(key)
    fs.invalidate_cache()


def _put(fs, key: str, data: bytes, create: bool = False, match: str | None = None) -> str | None:
    """Write the object ``key`` only if it is absent (``create``) or still at version ``match``; returns its new
    version. ``FileExistsError`` when the condition does not hold (another run wrote it)."""
    protocol = _protocol(fs)
    bucket, _, name = key.partition("/")
    if protocol in ("gs", "gcs"):
        # one multipart upload (the object's name, then its bytes), as gcsfs's own simple_upload sends it, with
        # the generation precondition; gcsfs raises FileExistsError for the store's 412
        body = (f'--==0==\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({"name": name})}\n--==0==\n'
                "Content-Type: application/json\n\n").encode() + data + b"\n--==0==--"
        out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="multipart", data=body,
                      headers={"Content-Type": 'multipart/related; boundary="==0=="'}, json_out=True,
                      ifGenerationMatch="0" if create else str(match))
        return str(out.get("generation"))
    if protocol in ("s3", "s3a"):
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": match}
        with _precondition_refused(key):
            out = fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, **condition)
        return out.get("ETag")
    # another file system: no precondition to ask for; check, then write (no protection against a race)
    if create and fs.exists(key):
        raise FileExistsError(key)
    fs.pipe_file(key, data)
    return None
