"""Orbax checkpoints of a whole training state, one per chunk boundary.

Layout of a checkpoint directory (``orbax.checkpoint.CheckpointManager``, one step per saved epoch)::

    DIR/<epoch>/state/   the state pytree (Orbax ``StandardSave``: params, batch_stats, opt_state, step,
                         epoch, PRNG key, divergence, history so far -- everything a bit-exact resume needs)
    DIR/<epoch>/meta/    JSON (``JsonSave``): whatever the caller adds (the image trainer writes the epoch,
                         the config and the history so far), for people and scripts; restoring does not need it

``<epoch>`` is the number of epochs completed. Saving is synchronous (no background thread, so the
next jitted step may donate the buffers just written) and keeps the newest ``keep`` checkpoints.
Typed PRNG keys are stored as their key data and wrapped again on restore (the template says which
leaves are keys). With several hosts every process calls ``save``/``restore``; Orbax writes once.

    ckpt = Checkpoints(directory)       # or the one-shot helpers below
    ckpt.save(epoch, state, meta={...})
    state = ckpt.restore(template)      # the newest; template: a state (or ShapeDtypeStructs) of the same shape
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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


class Checkpoints:
    """A checkpoint directory (see the module docstring); ``keep`` newest checkpoints are kept."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = 2):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"checkpoint_keep: must be an integer >= 1 or None, got {keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, item_names=("state", "meta"), options=options)

    def latest(self) -> int | None:
        """The newest saved epoch, or None."""
        return self._manager.latest_step()

    def all(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, epoch: int, state, meta: dict | None = None) -> None:
        """Save ``state`` as epoch ``epoch`` (overwriting nothing: an existing epoch is left as it is)."""
        epoch = int(epoch)
        if epoch in self._manager.all_steps():
            return
        self._manager.save(epoch, args=ocp.args.Composite(state=ocp.args.StandardSave(_to_savable(state)),
                                                          meta=ocp.args.JsonSave(_json(meta or {}))), force=True)
        self._manager.wait_until_finished()

    def restore(self, template, epoch: int | None = None) -> Any:
        """The state saved at ``epoch`` (default: the newest), shaped, typed and sharded like ``template``."""
        epoch = self.latest() if epoch is None else int(epoch)
        if epoch is None:
            raise FileNotFoundError(f"checkpoint_dir: no checkpoint in {self.directory}")
        restored = self._manager.restore(epoch, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(template))))
        return _from_savable(restored.state, template)

    def meta(self, epoch: int | None = None) -> dict:
        """The JSON saved beside the state at ``epoch`` (default: the newest)."""
        epoch = self.latest() if epoch is None else int(epoch)
        if epoch is None:
            raise FileNotFoundError(f"checkpoint_dir: no checkpoint in {self.directory}")
        return dict(self._manager.restore(epoch, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def latest(directory) -> int | None:
    """The newest epoch saved in ``directory``, or None (also when the directory does not exist)."""
    if not os.path.isdir(directory):
        return None
    with Checkpoints(directory) as ckpt:
        return ckpt.latest()


def save(directory, epoch: int, state, meta: dict | None = None, keep: int | None = 2) -> None:
    """Save ``state`` as epoch ``epoch`` in ``directory`` (see ``Checkpoints.save``)."""
    with Checkpoints(directory, keep=keep) as ckpt:
        ckpt.save(epoch, state, meta)


def restore(directory, template, epoch: int | None = None):
    """The state saved in ``directory`` at ``epoch`` (default: the newest); see ``Checkpoints.restore``."""
    with Checkpoints(directory) as ckpt:
        return ckpt.restore(template, epoch)
