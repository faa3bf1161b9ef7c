"""Verified Orbax checkpoints of a whole training state.

Layout of a checkpoint directory (``orbax.checkpoint.CheckpointManager``, one folder per saved step)::

    DIR/<step>/state/    the state pytree (Orbax ``StandardSave``: params, batch_stats, opt_state, step,
                         epoch, PRNG key, divergence, history so far -- everything a bit-exact resume needs)
    DIR/<step>/meta/     JSON (``JsonSave``): what the caller adds (the trainers write the epoch, the batch
                         within it, the run config, the model's description and the history so far) and
                         ``integrity``: a SHA-256 per saved array (with its shape and dtype) and one of the
                         rest of the JSON
    DIR/damaged/<step>   a step that failed verification, set aside by ``set_aside`` (never read again)
    DIR/unfinished/<step>  a save that never finished (a run killed inside it), set aside by
                         ``set_aside_unfinished`` before a run trains there again (never read again)

A save that never finished is not damage. On a local disk Orbax writes a step into a temporary folder
(``<step>.orbax-checkpoint-tmp-*``) and renames it when complete, so an interrupted save leaves no step folder.
On ``gs://`` Orbax writes the step folder in place and its commit marker (``commit_success.txt``) last, so a step
folder without the marker is a save that was cut off; on other buckets the rename is a copy, so a step folder with
its temporary folder still beside it is one too. Those are :meth:`Checkpoints.unfinished`; a training run sets
them aside when it opens its directory (``Core.open_checkpoints``, holding the directory's lock) and resumes from
the newest committed step, or starts from the beginning when there is none. A committed step that fails its
checks stays damage: reported, and refused when no older step is good.

``<step>`` is a number that grows with the run; the trainers use the number of training steps (batches)
done. Saving is synchronous (no background thread, so the next jitted step may donate the buffers just
written) and keeps the newest ``keep`` checkpoints. Typed PRNG keys are stored as their key data and
wrapped again on restore (the template says which leaves are keys). With several processes every process
calls ``save``/``restore`` at the same point: Orbax writes every array once and the JSON from process 0;
a checkpoint written by several processes restores in any number of them (the template's sharding says
where the arrays go).

Integrity. Orbax 0.12 writes no checksums of its own (TensorStore's OCDBT format has none for the array
data, and a flipped byte in a data file can decode into wrong numbers without an error), so ``save``
records a SHA-256 of every array's bytes as saved, and ``restore``/``meta`` recompute them. Any failure
to read a step (a missing or truncated file, a manifest deleted, an empty step folder, a checksum that
differs) is a ``CheckpointError`` naming the directory, the step and what is wrong. Arrays sharded over
several processes are gathered to compute their checksums.

    ckpt = Checkpoints(directory)       # or the one-shot helpers below
    ckpt.save(step, state, meta={...})
    state = ckpt.restore(template)      # the newest; template: a state (or ShapeDtypeStructs) of the same shape
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from resjax._quiet import quiet_import, root_logger_kept
from resjax.paths import as_path, filesystem, is_url, remove_tree
from resjax.train.distributed import barrier, is_main_process, to_host
from resjax.train.storage import raise_storage_error, storage_errno

if TYPE_CHECKING:
    import flax.linen as nn

__all__ = ["CheckpointError", "Checkpoints", "array_checksums", "check_free_space", "closed_on_error", "describe_model",
           "estimated_size", "latest", "restore", "same_model_description", "save"]


def _ocp():
    """``orbax.checkpoint``, imported on first use and without leaving a handler on the root logger
    (``resjax._quiet``: Orbax's import calls absl's logging, which runs ``logging.basicConfig()``)."""
    return quiet_import("orbax.checkpoint")


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(tree):
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(template):
    """ShapeDtypeStructs (with the template's sharding) for the savable form of ``template``."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            if sharding is not None and not isinstance(x, jax.ShapeDtypeStruct):
                sharding = jax.random.key_data(x).sharding
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
    return jax.tree_util.tree_map(one, template)


def _from_savable(restored, template):
    def one(r, t):
        if _is_key(t):
            return jax.random.wrap_key_data(r, impl=jax.random.key_impl(t))
        return r
    return jax.tree_util.tree_map(one, restored, template)


_TMP = ".orbax-checkpoint-tmp"  # Orbax's temporary folder of a step being written: <step>.orbax-checkpoint-tmp-<time>
_COMMITTED = "commit_success.txt"  # Orbax's commit marker of a step written in place (gs://), written last


class CheckpointError(ValueError):
    """A checkpoint step that cannot be used: ``directory``, ``step`` and ``problem`` (what is wrong)."""

    def __init__(self, directory: str, step: int | str, problem: str) -> None:
        self.directory, self.step, self.problem = directory, step, problem
        super().__init__(f"checkpoint_dir: {directory}, step {step}: {problem}")


def _sha256(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def array_checksums(tree: Any) -> dict:
    """``{path: {"sha256", "shape", "dtype"}}`` for every array of the savable form of ``tree``. An array
    sharded over several processes is gathered first (``distributed.to_host``), so with several processes
    every one must call this at the same point; all of them get the same checksums."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(_to_savable(tree))[0]:
        out[jax.tree_util.keystr(path)] = {"sha256": _sha256(np.asarray(to_host(x))),
                                           "shape": list(np.shape(x)), "dtype": str(x.dtype)}
    return out


def _meta_sha256(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "integrity"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split()).split(" See full TensorStore details")[0].split(" [tensorstore_spec")[0]
    return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _late_read_after_closed_loop(unraisable) -> bool:
    """Whether an unraisable exception is Orbax's harmless ``RuntimeError: Event loop is closed``: when a
    restore fails (a damaged step), Orbax closes the event loop it ran the reads in while TensorStore still
    has reads of other arrays in flight; each of them, finishing later, calls ``call_soon_threadsafe`` on the
    closed loop, and Python printed about 100 such tracebacks around resjax's one-line message (#22)."""
    exc = unraisable.exc_value
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def _write_of_a_failed_save_at_exit(unraisable) -> bool:
    """Whether an unraisable exception is a write coroutine of a failed Orbax save (``write_fragment``, left
    pending when a full disk stopped the save, which ``Checkpoints.save`` reported as one ``StorageError``)
    closed while Python shuts down: about ten tracebacks after that one line (#54)."""
    return (isinstance(unraisable.exc_value, ImportError) and "Python is likely shutting down" in
            str(unraisable.exc_value) and getattr(unraisable.object, "__qualname__", "").endswith("write_fragment"))


def _quiet_hook(unraisable) -> None:
    if not (_late_read_after_closed_loop(unraisable) or _write_of_a_failed_save_at_exit(unraisable)):
        _quiet_hook.previous(unraisable)


class _UnretrievedReadFilter(logging.Filter):
    """Drops asyncio's ``Task exception was never retrieved`` reports of Orbax's reads of a damaged step (a task
    of ``async_deserialize`` whose error nobody awaited once the restore had failed on another array): the failed
    restore is reported by resjax's one-line message, and this traceback of its other reads buried it (#22; seen
    once in about three runs of ``test_unusable_checkpoints_end_the_run_...``). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(("Task exception was never retrieved", "Future exception was never retrieved")) \
                and record.exc_info and storage_errno(record.exc_info[1]) is not None:
            return False  # the writes of a save that a full disk stopped: reported once as a StorageError (#54)
        if not message.startswith("Task exception was never retrieved") or not record.exc_info:
            return True
        tb = record.exc_info[2] if len(record.exc_info) > 2 else None
        tb = tb or getattr(record.exc_info[1], "__traceback__", None)
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "async_deserialize":
                return False
            tb = tb.tb_next
        return True


_UNRETRIEVED_READS = _UnretrievedReadFilter()


def _quiet_closed_loop_noise() -> None:
    """Drop Orbax's late ``Event loop is closed`` reports (``_late_read_after_closed_loop``) from
    ``sys.unraisablehook``, keeping every other unraisable exception for the hook that was there, and asyncio's
    reports of its reads whose errors nobody retrieved (``_UnretrievedReadFilter``) from the ``asyncio`` logger.
    Installed by every ``Checkpoints`` and left in place: the late reads arrive after the failed restore returned."""
    import sys

    if sys.unraisablehook is not _quiet_hook:
        _quiet_hook.previous = sys.unraisablehook
        sys.unraisablehook = _quiet_hook
    asyncio_logger = logging.getLogger("asyncio")
    if _UNRETRIEVED_READS not in asyncio_logger.filters:
        asyncio_logger.addFilter(_UNRETRIEVED_READS)


@contextlib.contextmanager
def _writer_thread_errors_held() -> Iterator[list]:
    """Inside the block, the ``absl`` logger's error records (Orbax's writer threads log each failed write with
    its traceback, ``_SignalingThread.run() raised an exception``) are held in the list yielded; at the end those
    still in it are logged as they would have been. ``Checkpoints.save`` clears the list when it reports the
    error itself (a full disk: one ``StorageError`` instead of three thread tracebacks)."""
    held: list[logging.LogRecord] = []
    logger = logging.getLogger("absl")

    class _Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.ERROR:
                held.append(record)
                return False
            return True

    hold = _Hold()
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)


class Checkpoints:
    """A checkpoint directory (see the module docstring); ``keep`` newest checkpoints are kept."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = 2) -> None:
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"checkpoint_keep: must be an integer >= 1 or None, got {keep!r}")
        _quiet_closed_loop_noise()  # Orbax's tracebacks after a refused step would bury resjax's message
        # a local folder (absolute) or a bucket URL (resjax.paths: Orbax and TensorStore write there themselves)
        self.directory = os.fspath(directory) if is_url(directory) else os.path.abspath(os.fspath(directory))
        self._path = as_path(self.directory, "checkpoint_dir")
        self.lock = None  # a training run's DirectoryLock (resjax.train.lock), released by close()
        ocp = _ocp()
        with root_logger_kept():
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
            self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "meta"), options=options)

    def latest(self) -> int | None:
        """The newest step folder in the directory (saved by Orbax or not), or None."""
        steps = self.steps()
        return steps[0] if steps else None

    def all(self) -> list[int]:
        """Every step folder on disk, oldest first (``steps`` in increasing order)."""
        return sorted(self.steps())

    def steps(self) -> list[int]:
        """Every step folder on disk, newest first, including ones Orbax would not list (an empty folder,
        one whose commit marker is missing): those are reported as damaged when read."""
        folders = [p for p in self._path.iterdir() if p.name.isdigit()] if self._path.is_dir() else []
        return sorted((int(p.name) for p in folders if p.is_dir()), reverse=True)

    def unfinished(self) -> list[int]:
        """The step folders whose save never finished (see the module docstring), newest first: on ``gs://``
        those without Orbax's commit marker, on any store those with Orbax's temporary folder beside them."""
        if not self._path.is_dir():
            return []
        names = [p.name for p in self._path.iterdir()]
        renaming = {n.split(".", 1)[0] for n in names if _TMP in n}
        marked = self.directory.startswith("gs://")  # Orbax's rule (gcs_utils.is_gcs_path): a commit file there
        return [step for step in self.steps()
                if str(step) in renaming or (marked and not (self._path / str(step) / _COMMITTED).exists())]

    def set_aside_unfinished(self) -> list[str]:
        """Move every unfinished save (:meth:`unfinished`) to ``DIR/unfinished/<step>``, with one line each
        saying so; returns where they went. Called by the run that holds the directory's lock, before it trains."""
        steps = self.unfinished()
        barrier("resjax_unfinished_listed")  # every process has listed them before any is moved
        moved = []
        for step in steps:
            moved.append(self.set_aside(step, into="unfinished"))
            print(f"resjax: checkpoint_dir: step {step} in {self.directory} is a save that never finished (the run "
                  f"was stopped inside it): moved to {moved[-1]}; it is not read again", file=sys.stderr, flush=True)
        return moved

    def save(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Save ``state`` as ``step`` with ``meta`` and the checksums (an existing step is left as it is)."""
        step = int(step)
        if step in self.steps():
            return
        meta = _json(meta or {})
        meta["integrity"] = {"arrays": array_checksums(state), "meta_sha256": _meta_sha256(meta)}
        ocp = _ocp()
        with root_logger_kept(), _writer_thread_errors_held() as held:
            try:
                self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_to_savable(state)),
                                                                 meta=ocp.args.JsonSave(meta)), force=True)
                self._manager.wait_until_finished()
            except Exception as err:  # noqa: BLE001  (Orbax and TensorStore raise many types)
                if storage_errno(err) is None:
                    raise
                held.clear()  # Orbax's writer threads logged this error with their tracebacks: said once below
                self._discard_partial(step)
                previous = [s for s in self.steps() if s < step]
                raise_storage_error(err, self.directory, "checkpoint_dir", f"saving step {step}",
                                    f"the previous checkpoint (step {previous[0]}) is intact, and the same command "
                                    "resumes from it once there is room" if previous else
                                    "no checkpoint of this run was saved before")

    def _discard_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` left (Orbax's temporary folder): worthless, and on a full disk
        the space the user is asked to free."""
        if is_main_process():
            for folder in self._path.iterdir():
                if folder.name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    with contextlib.suppress(OSError):
                        remove_tree(folder)

    def _step(self, step: int | None) -> int:
        step = self.latest() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"checkpoint_dir: no checkpoint in {self.directory}")
        return step

    def meta(self, step: int | None = None) -> dict:
        """The JSON saved beside the state at ``step`` (default: the newest), verified against its checksum
        (``CheckpointError`` when it cannot be read or does not match)."""
        step = self._step(step)
        folder = self._path / str(step)
        if not (folder / "meta").is_dir() or not (folder / "state").is_dir():
            missing = [n for n in ("state", "meta") if not (folder / n).is_dir()]
            raise CheckpointError(self.directory, step, f"the step folder has no {' and no '.join(missing)} "
                                  "(an interrupted or damaged save)")
        ocp = _ocp()
        try:
            with root_logger_kept():
                meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
        except Exception as e:  # noqa: BLE001  (Orbax and TensorStore raise many types)
            raise CheckpointError(self.directory, step, f"its meta cannot be read ({_describe(e)})") from e
        recorded = (meta.get("integrity") or {}).get("meta_sha256")
        if recorded is not None and recorded != _meta_sha256(meta):
            raise CheckpointError(self.directory, step, "its meta JSON does not match the checksum saved with it")
        return meta

    def restore(self, template: Any, step: int | None = None) -> Any:
        """The state saved at ``step`` (default: the newest), shaped, typed and sharded like ``template``,
        verified against the checksums saved with it (``CheckpointError`` naming the first array that differs,
        or saying why the step cannot be read). Checkpoints written without checksums are restored unverified."""
        step = self._step(step)
        meta = self.meta(step)
        ocp = _ocp()
        try:
            with root_logger_kept():
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(template))))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(self.directory, step, f"its state cannot be read ({_describe(e)})") from e
        recorded = (meta.get("integrity") or {}).get("arrays")
        if recorded is not None:
            found = array_checksums(restored.state)
            if set(found) != set(recorded):
                extra, missing = sorted(set(recorded) - set(found)), sorted(set(found) - set(recorded))
                raise CheckpointError(self.directory, step, f"its arrays do not match the run's state (saved only: "
                                      f"{extra[:3]}, the run's only: {missing[:3]})")
            for path, want in recorded.items():
                got = found[path]
                if want["sha256"] is not None and got["sha256"] is not None and want != got:
                    raise CheckpointError(self.directory, step, f"array {path} {got['dtype']}{got['shape']} does not "
                                          "match the SHA-256 recorded when it was saved (the files were changed or damaged)")
        return _from_savable(restored.state, template)

    def set_aside(self, step: int, into: str = "damaged") -> str:
        """Move a step folder to ``DIR/<into>/<step>`` (``damaged``, or ``unfinished`` for a save that never
        finished; numbered if that exists), with Orbax's temporary folders of that step; returns the new path."""
        target = self._path / into / str(step)
        n = 1
        while target.exists():
            target, n = self._path / into / f"{step}-{n}", n + 1
        temporary = [p.name for p in self._path.iterdir() if p.name.startswith(f"{step}{_TMP}")]
        if is_main_process():  # one process moves it; the others wait until it is gone
            moves = [(str(step), target.name)] + [(name, f"{target.name}/{name}") for name in temporary]
            if is_url(self.directory):  # a bucket has no folders to rename: its objects are moved
                fs, inner = filesystem(self.directory)
                for source, dest in moves:
                    fs.mv(f"{inner.rstrip('/')}/{source}", f"{inner.rstrip('/')}/{into}/{dest}", recursive=True)
                fs.invalidate_cache()
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                for source, dest in moves:
                    shutil.move(os.path.join(self.directory, source), os.path.join(os.path.dirname(target), dest))
        target = os.fspath(target)
        barrier(f"resjax_set_aside_{step}")
        with root_logger_kept():
            self._manager.reload()
        return target

    def close(self) -> None:
        """Close the Orbax checkpoint manager (done on leaving a ``with`` block) and release the directory's
        lock when a training run holds it (``Core.open_checkpoints``)."""
        try:
            with root_logger_kept():
                self._manager.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe_model(model: nn.Module) -> str:
    """The module's fields as text (its ``repr`` without memory addresses), for comparing checkpoints
    (``same_model_description``)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(model))


#: Fields a description may lack that mean nothing when at these values (added to the models since).
_ADDED_DEFAULTS = {"param_dtype": "None", "remat": "False"}


def _attributes(text: str) -> tuple[str, dict[str, str]]:
    """A flax module's ``repr``: its class name and its top-level attributes (name -> value text, with the
    value's own indented lines)."""
    lines = text.splitlines()
    attrs: dict[str, str] = {}
    current = None
    for line in lines[1:]:
        match = re.match(r"^    (\w+) = (.*)$", line)
        if match:
            current = match.group(1)
            attrs[current] = match.group(2)
        elif current is not None and line.startswith("     "):
            attrs[current] += "\n" + line
    return (lines[0].rstrip("(") if lines else ""), attrs


def same_model_description(saved: str, current: str) -> bool:
    """Whether a checkpoint's recorded ``describe_model`` text ``saved`` describes the model ``current``
    describes: equal texts, or the same class and attributes except (1) the block settings of other branch kinds
    that ``ResNet`` and the MLPs carried before each model took only its kind's (``resjax.nn.moved_settings``:
    the model ignored them, so their values change nothing) and (2) ``param_dtype = None`` and ``remat = False``
    (added since; also on ``TakiResNet``). So a checkpoint written before those changes resumes."""
    if saved == current:
        return True
    from resjax.nn import BlockSettings, PlainMLP, ResidualMLP, ResidualStack, ResNet, TakiResNet, moved_settings

    name, old = _attributes(saved)
    name_now, new = _attributes(current)
    models = {cls.__name__: cls for cls in (ResNet, ResidualMLP, PlainMLP, ResidualStack, TakiResNet)}
    if name != name_now or name not in models:
        return False
    dropped = set(moved_settings(models[name], BlockSettings))
    for key in old.keys() | new.keys():
        if key not in new and key in dropped:
            continue
        if key not in old and new[key] == _ADDED_DEFAULTS.get(key):
            continue
        if old.get(key) != new.get(key):
            return False
    return True


def estimated_size(state: Any) -> int:
    """Bytes one checkpoint of ``state`` takes, roughly and on the high side: its arrays (key data for PRNG
    keys) and 10% for Orbax's chunking, the meta JSON's copy of the history (about 25 bytes a number), a
    checksum entry per array and Orbax's own files."""
    leaves = jax.tree_util.tree_leaves(_abstract(state))
    arrays = sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in leaves)
    history = getattr(state, "history", None)
    numbers = sum(int(np.prod(np.shape(v), dtype=np.int64)) for v in jax.tree_util.tree_leaves(history or {}))
    return int(1.1 * arrays + 25 * numbers + 300 * len(leaves) + 256 * 1024)  # 2.1 MB for the 2.0 MB of a degradation cell


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} kB"


def check_free_space(directory: str | os.PathLike, needed: int, setting: str = "checkpoint_dir",
                     what: str = "one checkpoint of this run") -> bool:
    """Warn (``RuntimeWarning``) naming ``setting`` and ``directory`` when the disk holding
    it has less than ``needed`` bytes free (``shutil.disk_usage``): found before training instead of at the
    first save, after it. Returns whether there is room; a directory whose disk cannot be asked passes."""
    if is_url(directory):  # a bucket has no free-space figure to ask
        return True
    path = os.path.abspath(os.fspath(directory))
    while not os.path.exists(path) and os.path.dirname(path) != path:  # the disk of the nearest existing folder
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return True
    if free >= needed:
        return True
    import warnings

    warnings.warn(f"{setting}: only {_megabytes(free)} free on the disk of {os.fspath(directory)}, less than "
                  f"{what} (about {_megabytes(needed)}); writing there may fail. Free some space or choose another "
                  "folder.", RuntimeWarning, stacklevel=3)
    return False


def _json(value):
    """JSON-safe copy: arrays to lists, non-finite floats to None, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, (np.ndarray, jax.Array)):
        return _json(np.asarray(value).tolist())
    if isinstance(value, (np.floating, float)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def latest(directory: str | os.PathLike) -> int | None:
    """The newest step saved in ``directory``, or None (also when the directory does not exist)."""
    if not as_path(directory, "checkpoint_dir").is_dir():
        return None
    with Checkpoints(directory) as ckpt:
        return ckpt.latest()


def save(directory: str | os.PathLike, step: int, state: Any, meta: dict | None = None, keep: int | None = 2) -> None:
    """Save ``state`` as ``step`` in ``directory`` (see ``Checkpoints.save``)."""
    with Checkpoints(directory, keep=keep) as ckpt:
        ckpt.save(step, state, meta)


def restore(directory: str | os.PathLike, template: Any, step: int | None = None) -> Any:
    """The state saved in ``directory`` at ``step`` (default: the newest); see ``Checkpoints.restore``."""
    with Checkpoints(directory) as ckpt:
        return ckpt.restore(template, step)


@contextlib.contextmanager
def closed_on_error(ckpt: Checkpoints | None) -> Iterator[None]:
    """Close ``ckpt`` (releasing its directory's lock) when the block raises; a run that never starts training
    must not keep its checkpoint directory locked."""
    try:
        yield
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
