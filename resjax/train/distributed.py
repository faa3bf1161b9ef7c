"""Data parallelism: a one-axis device mesh, batches placed on it, and multi-host start-up.

One mesh axis, ``'data'``. The training state is replicated (``P()``); a batch has its example axis
sharded, ``P('data')`` (or ``P(None, 'data')`` behind a leading seed axis). Under ``jax.jit`` with sharded
inputs XLA (GSPMD) computes every reduction over the batch -- the loss mean, BatchNorm's batch mean and
variance -- over the GLOBAL batch, inserting the cross-device sums itself; no ``axis_name`` and no
``pmean`` appear anywhere, so the seed axis can never be pooled by accident.

Several hosts (processes): call ``initialize_if_needed()`` first thing in the entry point. Every process
then builds the same mesh over all devices (``jax.devices()`` is ordered process by process, so process
``p`` owns the contiguous block ``[p * B/P, (p+1) * B/P)`` of each global batch of ``B`` examples) and
passes only its block to ``global_batch``, which assembles the global ``jax.Array`` with
``jax.make_array_from_process_local_data``. The image trainer iterates the same deterministic epoch on
every host and keeps its block (``host_block``). Only the single-host path (one process, one or more
devices) is tested in this repository; the multi-host path follows JAX's documented recipe but has not
been run here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["DATA_AXIS", "batch_sharding", "data_size", "global_batch", "host_block", "initialize_if_needed",
           "make_data_mesh", "replicated"]

#: The name of the mesh's one axis, over which the example axis of a batch is sharded.
DATA_AXIS = "data"


def initialize_if_needed() -> bool:
    """Call ``jax.distributed.initialize()`` when the environment asks for several processes.

    It does so when ``JAX_COORDINATOR_ADDRESS`` is set (then ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    are passed on when set, else JAX's cluster detection fills them in) or when ``RESJAX_DISTRIBUTED`` is
    ``1``/``true`` (JAX detects SLURM, Open MPI or a Cloud TPU pod by itself). Otherwise, and when JAX's
    distributed runtime is already up, it does nothing. Returns whether it initialised. Must run before
    any other JAX call that touches devices.
    """
    flag = os.environ.get("RESJAX_DISTRIBUTED", "").strip().lower() in ("1", "true", "yes")
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (flag or address):
        return False
    if jax.distributed.is_initialized():
        return False
    kwargs = {}
    if address:
        kwargs["coordinator_address"] = address
        for env, name in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
            if os.environ.get(env):
                kwargs[name] = int(os.environ[env])
    jax.distributed.initialize(**kwargs)
    return True


def make_data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh ``('data',)`` over ``devices`` (default: every device, ``jax.devices()``; on one
    host these are the local devices)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("devices: the mesh needs at least one device")
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def data_size(mesh: Mesh | None) -> int:
    """How many ways the batch is split (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[DATA_AXIS])


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a whole copy on every device of ``mesh`` (``P()``: the training state)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, seed_axis: bool) -> NamedSharding:
    """The example axis on ``'data'``; behind a leading seed axis when ``seed_axis``."""
    return NamedSharding(mesh, P(None, DATA_AXIS) if seed_axis else P(DATA_AXIS))


def host_block(x: np.ndarray, axis: int) -> np.ndarray:
    """This process's contiguous block of a global batch along ``axis`` (all of it on one host)."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1:
        return x
    size = x.shape[axis] // count
    return np.take(x, np.arange(index * size, (index + 1) * size), axis=axis)


def global_batch(local: np.ndarray, sharding: NamedSharding, global_shape: Sequence[int]) -> jax.Array:
    """The global array from this process's block (``jax.make_array_from_process_local_data``)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), tuple(global_shape))
