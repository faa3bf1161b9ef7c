"""Data parallelism: a one-axis device mesh, batches placed on it, and multi-host start-up.

One mesh axis, ``'data'``. The training state is replicated (``P()``); a batch has its example axis
sharded, ``P('data')`` (or ``P(None, 'data')`` behind a leading seed axis). Under ``jax.jit`` with sharded
inputs XLA (GSPMD) computes every reduction over the batch -- the loss mean, BatchNorm's batch mean and
variance -- over the GLOBAL batch, inserting the cross-device sums itself; no ``axis_name`` and no
``pmean`` appear anywhere, so the seed axis can never be pooled by accident.

Several hosts (processes): call ``initialize_if_needed()`` first thing in the entry point (the experiment
entry points do; ``resjax.launch`` starts several local processes with the environment it reads). Every
process then builds the same mesh over all devices (``jax.devices()`` is ordered process by process, so
process ``p`` owns the contiguous block ``[p * B/P, (p+1) * B/P)`` of each global batch of ``B`` examples:
``process_block``) and passes only its block to ``global_batch``, which assembles the global ``jax.Array``
with ``jax.make_array_from_process_local_data``. The image trainer asks its source for that block only
(``ImageSource.epoch(..., part=process_part())``), so no process reads another's examples. A seed sweep
shards its seed axis over all devices of all processes. Values the host needs (histories, checkpoint
checksums) come back through ``to_host``, which gathers a sharded array from every process; every
process must therefore run the same sequence of programs. Files (results, figures, checkpoint metadata)
are written by process 0 only (``is_main_process``); Orbax writes each checkpoint once, every process
taking part. ``tests/test_multiprocess.py`` runs all of this with 2 local CPU processes (gloo collectives).

What equals what (measured by ``tests/test_equality_claims.py`` on the project's 2-core CPU, one JAX device per
core, a residual MLP of width 8 with 3 BatchNorm blocks, batch 16, at the README's sweep settings -- learning
rate 0.05, no momentum, 3 epochs -- and at learning rate 0.05 with momentum 0.9 for 10 epochs):

- Seeds vmapped together on one device against each seed trained alone (or as a sweep of its own,
  ``sweep([s])``): different programs, which agree to float32 rounding in each step (the test asserts 1e-6
  relative in the loss at epoch 1 and 1e-4 in the parameters after 10 epochs). In the tests' tiny settings on
  this CPU they come out bit-identical (the vmapped program happens to sum each seed's values in the same
  order); nothing promises that elsewhere: 8 seeds of a width-64 MLP with 8 BatchNorm blocks on MNIST-1D at
  momentum 0.9 are 1e-5 apart in the loss at epoch 1 and up to 0.8 apart in the parameters after 3 epochs
  (issue #53), and a seed of that sweep is 0.05 apart from ``sweep([s])``.
- A sweep with one seed per device against the seed alone, and data parallelism over 2 devices against one
  device, are different programs: they agree to float32 rounding at epoch 1 (1.1e-7 relative in the loss), and
  the rounding is then carried by the dynamics. After 10 epochs at the high rate with momentum the parameters
  differ by 1.9e-6 (one seed per device) and 9.5e-7 (2-device data parallelism; 2.4e-7 after the README's 3
  epochs). Where the dynamics are chaotic the gap grows much larger: issue #33 reports 8 MNIST-1D seeds
  vmapped on one device at the high rate ending 1.3% apart in the loss from the seeds alone after a few epochs
  (so on that problem and machine the vmapped program was not bit-identical). Compare such runs to a tolerance,
  or statistically, never bit for bit.
- BatchNorm in a loop of your own under ``shard_map`` or ``pmap``: each device normalises by its own examples'
  statistics unless the layer names the mapped axis (``norm=functools.partial(resjax.nn.BatchNorm,
  axis_name='data')``); without it 4 devices are another model (ghost batches), 2e-2 apart from one device after
  4 steps of a ``cifar_resnet(8)`` (issue #53 measured 3.3e-2). ``make_image_train(..., mesh=...)`` and ``jax.jit``
  on a sharded batch need nothing: the statistics are the global batch's (``tests/test_image_train.py`` checks
  both).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["DATA_AXIS", "barrier", "batch_sharding", "data_size", "global_batch", "host_block",
           "initialize_if_needed", "is_main_process", "make_data_mesh", "process_block", "process_part", "replicated",
           "to_host"]

#: The name of the mesh's one axis, over which the example axis of a batch is sharded.
DATA_AXIS = "data"


def initialize_if_needed() -> bool:
    """Call ``jax.distributed.initialize()`` when the environment asks for several processes.

    It does so when ``JAX_COORDINATOR_ADDRESS`` is set (then ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    are passed on when set, else JAX's cluster detection fills them in) or when ``RESJAX_DISTRIBUTED`` is
    ``1``/``true`` (JAX detects SLURM, Open MPI or a Cloud TPU pod by itself). Otherwise, and when JAX's
    distributed runtime is already up, it does nothing. Returns whether it initialised. Must run before
    any other JAX call that touches devices.

    CPU processes exchange data through gloo (``jax_cpu_collectives_implementation``, unless already set).
    A process that dies is noticed through the coordination service's heartbeats: after
    ``RESJAX_HEARTBEAT_TIMEOUT`` seconds without one (default 100, JAX's) every other process is stopped
    with an error instead of waiting for it forever; ``RESJAX_INIT_TIMEOUT`` (default 300) bounds the wait
    for all processes to join at start-up, and ``RESJAX_SHUTDOWN_TIMEOUT`` (default 300) the wait of a
    process that ends (normally or by an exception) for the others to end too.
    """
    flag = os.environ.get("RESJAX_DISTRIBUTED", "").strip().lower() in ("1", "true", "yes")
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (flag or address):
        return False
    if jax.distributed.is_initialized():
        return False
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"heartbeat_timeout_seconds": _env_seconds("RESJAX_HEARTBEAT_TIMEOUT", 100),
              "initialization_timeout": _env_seconds("RESJAX_INIT_TIMEOUT", 300),
              "shutdown_timeout_seconds": _env_seconds("RESJAX_SHUTDOWN_TIMEOUT", 300)}
    if address:
        kwargs["coordinator_address"] = address
        for env, name in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
            if os.environ.get(env):
                kwargs[name] = int(os.environ[env])
    jax.distributed.initialize(**kwargs)
    return True


def _env_seconds(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}: want a whole number of seconds >= 1, got {text!r}")
    return value


def is_main_process() -> bool:
    """Whether this is process 0, the one that writes results, figures, reports and checkpoint metadata."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(tree: Any) -> Any:
    """Every array of ``tree`` as numpy, on every process: arrays sharded over several processes are
    gathered (a collective, so every process must call it at the same point), replicated and local ones
    are read directly. PRNG key arrays are returned as they are (``jax.random.key_data`` them first)."""
    def one(x):
        if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree_util.tree_map(one, tree)


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


def process_part() -> tuple[int, int]:
    """``(process_index, process_count)``: which block of every global batch this process owns."""
    return jax.process_index(), jax.process_count()


def process_block(batch_size: int, part: tuple[int, int] | None = None) -> slice:
    """The rows of a global batch of ``batch_size`` that process ``part[0]`` of ``part[1]`` owns (default:
    this process): the contiguous block ``[i * B/P, (i+1) * B/P)``. ``batch_size`` must divide evenly."""
    index, count = process_part() if part is None else part
    if batch_size % count:
        raise ValueError(f"batch_size: {batch_size} does not split evenly over {count} processes")
    size = batch_size // count
    return slice(index * size, (index + 1) * size)


def host_block(x: np.ndarray, axis: int) -> np.ndarray:
    """This process's contiguous block of a global batch along ``axis`` (all of it on one host)."""
    if jax.process_count() == 1:
        return x
    return np.take(x, np.arange(x.shape[axis])[process_block(x.shape[axis])], axis=axis)


def global_batch(local: np.ndarray, sharding: NamedSharding, global_shape: Sequence[int]) -> jax.Array:
    """The global array from this process's block (``jax.make_array_from_process_local_data``)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), tuple(global_shape))
