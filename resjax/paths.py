"""Where runs live: one path layer for local folders and buckets (issue #50).

Every place resjax reads or writes a run (checkpoints, their lock, ``metrics.jsonl``, an experiment's ``--out``
with its results, figures and report, ``experiments.compare``) takes a local path or a URL and goes through
:func:`as_path`:

- a local path (or ``file://...``) is a ``pathlib.Path``: local runs behave, and write their files, exactly as
  before;
- a URL (``gs://bucket/run``, ``s3://bucket/run``, or any other scheme of an installed ``fsspec`` file system) is an
  ``etils.epath.Path``, the path type Orbax and the Flax examples use, whose ``read_text``, ``write_text``,
  ``mkdir``, ``iterdir``, ``exists``, ``/`` ... are those of ``pathlib``. ``epath`` reaches buckets through
  ``fsspec`` (``gcsfs`` for ``gs://``, ``s3fs`` for ``s3://``: ``pip install 'resjax[cloud]'``), imported only when
  a URL is used; Orbax writes the checkpoints' arrays there through TensorStore's own GCS and S3 drivers.

Why ``etils.epath`` rather than ``fsspec`` directly: Orbax already takes and returns ``epath.Path``, so checkpoints
and every other file of a run share one path type and one set of credentials; ``epath`` hands buckets to
``fsspec`` underneath, so ``fsspec``'s file systems (and their options, e.g. ``STORAGE_EMULATOR_HOST``,
``AWS_ENDPOINT_URL``) are what a URL reaches.

What an object store lacks, and how resjax does without it: no rename (an object written in one request is whole
or absent, so :func:`write_atomically` writes it directly), no appends (``metrics.jsonl`` is written again whole),
no ``O_EXCL`` and no process ids (the run lock is a create-if-absent object with a renewed lease:
``resjax.train.lock``). :func:`check_url` finds, before anything compiles, a URL whose scheme has no installed
file system, an endpoint that does not answer, a bucket that does not exist, missing credentials and a bucket
that cannot be written, each as one ``ValueError`` naming the setting and the URL.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["EXTRA", "FILESYSTEMS", "Path", "as_path", "cache_dir", "check_url", "filesystem", "is_url", "remove_tree",
           "write_atomically"]

#: The pip extra that installs the bucket file systems.
EXTRA = "pip install 'resjax[cloud]'"
#: The fsspec file system package of each bucket scheme.
FILESYSTEMS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs"}

Path = Any  # pathlib.Path for local paths, etils.epath.Path for URLs (both have pathlib's methods)


def _text(path: str | os.PathLike) -> str:
    return path if isinstance(path, str) else os.fspath(path)


def is_url(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a URL of a remote file system (``gs://``, ``s3://``, ...; not ``file://``)."""
    if path is None:
        return False
    text = _text(path)
    return "://" in text and not text.startswith("file://")


def _check_scheme(url: str, setting: str) -> None:
    scheme = url.split("://", 1)[0].lower()
    package = FILESYSTEMS.get(scheme)
    _no_listings_cache(scheme)
    if package is not None:
        if package == "gcsfs" and os.environ.get("STORAGE_EMULATOR_HOST"):
            # gcsfs's bucket-type probe over gRPC with TLS waits a minute against a plain-HTTP emulator
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            __import__(package)
        except ImportError:
            raise ValueError(f"{setting}: {url} needs the {package} package for {scheme}:// URLs: {EXTRA}") from None
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        raise ValueError(f"{setting}: {url}: no file system for {scheme}:// URLs is installed ({err}); resjax reads "
                         f"gs:// and s3:// with {EXTRA}") from None


def cache_dir() -> pathlib.Path:
    """Where resjax caches what it can make again (MNIST-1D's arrays, copies of data sets kept in buckets):
    ``$RESJAX_CACHE``, else ``~/.cache/resjax``."""
    return pathlib.Path(os.environ.get("RESJAX_CACHE", pathlib.Path.home() / ".cache" / "resjax"))


def _no_listings_cache(scheme: str) -> None:
    """No cached folder listings for ``scheme``'s file systems (``fsspec.config``, read when a file system is first
    made): a run's folder is also written by others than this file system (TensorStore writes Orbax's arrays, another
    process resumes the run), and a cached listing then misses steps, or gives a file's old size, so that a read
    returns its old length."""
    import fsspec.config

    fsspec.config.conf.setdefault(scheme, {}).setdefault("use_listings_cache", False)


def as_path(path: str | os.PathLike, setting: str = "path") -> Path:
    """``path`` as a path object: ``pathlib.Path`` for a local path or ``file://`` URL, ``etils.epath.Path`` for a
    bucket URL (``ValueError`` naming ``setting`` when no installed file system serves its scheme)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{setting}: must be a path or a URL, got {path!r}")
    text = _text(path)
    if text.startswith("file://"):
        return pathlib.Path(urllib.parse.urlparse(text).path)
    if not is_url(text):
        return path if isinstance(path, pathlib.Path) else pathlib.Path(text)
    if not isinstance(path, str) and type(path).__module__.startswith("etils"):
        return path
    _check_scheme(text, setting)
    from etils import epath

    return epath.Path(text)


def filesystem(url: str | os.PathLike) -> tuple[Any, str]:
    """The ``fsspec`` file system behind ``url`` and the path within it: ``(fs, path)``."""
    import fsspec

    _check_scheme(_text(url), "path")
    return fsspec.core.url_to_fs(_text(url))


def _endpoint(fs) -> tuple[str, int] | None:
    """The host and port a bucket file system talks to, where it says (gcsfs, s3fs)."""
    url = getattr(fs, "_location", None)  # gcsfs
    if url is None:
        client_kwargs = getattr(fs, "client_kwargs", None) or {}
        url = client_kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None) or os.environ.get(
            "AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return None
    parsed = urllib.parse.urlparse(url if "://" in url else f"https://{url}")
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def check_url(url: str | os.PathLike, setting: str, write: bool = True) -> None:
    """Before anything compiles: ``url`` can be reached, its bucket exists, the credentials are accepted, and (with
    ``write``) an object can be written and removed there. Each failure is one ``ValueError`` naming ``setting``
    and ``url``. Nothing for a local path."""
    if not is_url(url):
        return
    text = _text(url)
    fs, inner = filesystem(text)
    bucket = inner.split("/", 1)[0]
    where = _endpoint(fs)
    if where is not None and where[0]:
        try:
            socket.create_connection(where, timeout=10).close()
        except OSError as err:
            raise ValueError(f"{setting}: {text}: the storage endpoint {where[0]}:{where[1]} cannot be reached "
                             f"({err.strerror or err})") from None
    try:
        fs.invalidate_cache()
        found = fs.exists(bucket)
    except (PermissionError, OSError, Exception) as err:  # noqa: BLE001  (each file system has its own errors)
        raise ValueError(f"{setting}: {text}: the bucket {bucket} cannot be read ({_reason(err)})") from None
    if not found:
        try:  # s3fs answers False where the store refused the credentials: listing says which it was
            fs.ls(bucket)
        except FileNotFoundError:
            pass
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"{setting}: {text}: the bucket {bucket} cannot be read ({_reason(err)})") from None
        raise ValueError(f"{setting}: {text}: the bucket {bucket} does not exist (create it, or check the URL)")
    if not write:
        return
    probe = f"{inner.rstrip('/')}/.resjax.probe.{uuid.uuid4().hex[:12]}"
    try:
        fs.pipe_file(probe, b"\0" * 16)
        fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{setting}: {text}: cannot write into the bucket {bucket} ({_reason(err)}); check the "
                         "credentials' permissions or choose another bucket") from None


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    if isinstance(err, PermissionError) or "401" in text or "403" in text or "credential" in text.lower():
        return f"the credentials were refused or are missing: {type(err).__name__}: {text}"
    return f"{type(err).__name__}: {text}"


def write_atomically(path: Path, write: Callable[[Path], Any], tmp_name: str | None = None) -> None:
    """``write(tmp)`` then ``tmp`` renamed to ``path``, locally: ``path`` is the old file or the whole new one,
    never a part, and a failed write leaves no temporary file. On a bucket an object written in one request is
    already whole or absent (and there is no rename): ``write(path)`` directly."""
    if is_url(path):
        write(path)
        return
    path = pathlib.Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_tree(path: Path) -> None:
    """Remove the folder ``path`` and everything in it (nothing when it is not there)."""
    if is_url(path):
        with contextlib.suppress(FileNotFoundError):
            if path.exists():
                path.rmtree()
        return
    if os.path.isdir(path):
        shutil.rmtree(path)
