"""A process of ``test_locks.test_racing_processes_never_share_a_lock`` (and of ``test_buckets``' race on S3): in every round it locks the round's folder
at the same instant as the other racers (a barrier), reports whether it holds the lock while every racer has tried,
then gives it up. Imports only the lock (no JAX computation), so the race is between file operations."""

import os


def race(root: str, rounds: int, barrier, results) -> None:
    from resjax.train.lock import DirectoryLock

    for r in range(rounds):
        lock = DirectoryLock(f"{root.rstrip('/')}/round{r}", "out")  # a local folder or a bucket URL
        barrier.wait()  # every racer starts its acquisition at once
        try:
            lock.acquire()
        except ValueError:  # held by another racer
            pass
        barrier.wait()  # every racer has tried while the winner still holds it
        results.put((r, os.getpid(), lock.held))
        barrier.wait()
        lock.release()


def holders_per_round(root: str, rounds: int, racers: int) -> dict[int, int]:
    """``racers`` processes (spawned: no JAX state shared) race for the lock of ``root/round<r>`` in every round;
    returns how many held it in each round."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(racers), ctx.Queue()
    procs = [ctx.Process(target=race, args=(root, rounds, barrier, results)) for _ in range(racers)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=120) for _ in range(rounds * racers)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
    return {r: sum(held for rr, _, held in rows if rr == r) for r in range(rounds)}
