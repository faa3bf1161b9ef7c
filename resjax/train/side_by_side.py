"""Independent sweeps side by side, one per device: ``side_by_side(jobs)``.

``Trainer.sweep`` shards one sweep's seeds over every device, padding the seed axis to a multiple of the
device count: 3 seeds on 2 CPU devices fill 4 slots, a quarter of the work thrown away. An experiment
with several independent sweeps (cells of other models, batch sizes or settings) does better running them
side by side, each whole on one device, as many at once as there are devices; on a CPU, where
``resjax.use_every_cpu_core()`` makes each core a device and small-matmul programs run on one core, this
keeps every core busy without padding::

    from functools import partial
    jobs = [partial(trainer.sweep, keys, chunk_epochs=25) for trainer in trainers]
    results = side_by_side(jobs)      # [(run, metrics), ...] in the order of jobs

A job is a callable taking the keywords ``devices`` (a list of one device) and ``stop`` (the
``StopSignals`` this function opens), as ``Trainer.sweep`` does. Jobs start in the order given, each on the
first device that is free (give the longest first). Each job's result is the one it would give alone on
its device: the same program on the same data, bit for bit (``tests/test_side_by_side.py``).

A SIGTERM or SIGINT lets every running job finish its chunk and save (those with a ``checkpoint_dir``),
starts no other, and raises the first job's ``Preempted``. When a job fails, no other starts, those running
go on to their end, and the failure is raised. With several processes (or one device) the jobs run one after another, as
plain sweeps over every device.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from resjax.train.preemption import StopSignals

__all__ = ["side_by_side"]

T = TypeVar("T")


class _Cancelled(Exception):
    """A job that was never started because another stopped the run."""


def side_by_side(jobs: Sequence[Callable[..., T]], devices: Sequence[jax.Device] | None = None) -> list[T]:
    """Run ``jobs`` (see the module docstring), each on one of ``devices`` (default: this process's), as many
    at once as there are devices; their results in the order of ``jobs``."""
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices: need at least one device")
    if len(devices) == 1 or jax.process_count() > 1 or len(jobs) < 2:
        return [job() for job in jobs]  # one after another, each over every device (the sweep's own handlers)
    free: queue.Queue = queue.Queue()
    for d in devices:
        free.put(d)
    failed = threading.Event()

    with StopSignals() as stop:
        def work(job: Callable[..., T]) -> T:
            device = free.get()
            try:
                if failed.is_set() or stop.requested:
                    raise _Cancelled
                return job(devices=[device], stop=stop)
            except BaseException:
                failed.set()  # no other job starts; those running go on to their end (their work is kept)
                raise
            finally:
                free.put(device)

        with concurrent.futures.ThreadPoolExecutor(len(devices), thread_name_prefix="resjax-side") as pool:
            futures = [pool.submit(work, job) for job in jobs]
            pending = set(futures)
            while pending:  # a timeout, so that the main thread runs the signal handlers promptly
                _, pending = concurrent.futures.wait(pending, timeout=0.2)
    errors = [f.exception() for f in futures if f.exception() is not None]
    first = next((e for e in errors if not isinstance(e, _Cancelled)), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
