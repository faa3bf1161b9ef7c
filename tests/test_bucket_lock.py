"""The bucket lock's protocol step by step (issue #63), against the tests' real local stores (``tests/buckets.py``:
a GCS server and an S3 server, both honouring preconditions). Each test lets a second run act at the one moment
that step guards (a deterministic interleaving, not a race left to chance), so each guard is needed by a test:

- create-if-absent: a run that read "no lock" and is overtaken before its write is refused, not a second holder;
- the conditional takeover: of two runs taking over one expired lease, the one that is overtaken is refused;
- the read-back: a run whose record is overwritten before it reads it back does not hold the lock;
- the conditional release: a run giving up a lock that was taken over since it read it leaves the new holder's;
- a holder on this machine whose process is gone is taken over at once; a live one on this machine is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from resjax.paths import as_path
from resjax.train import lock as lockmod
from resjax.train.lock import LOCK_FILE, DirectoryLock, LockHeldError

STORES = ["gcs", "s3"]


def _holder(url: str) -> dict:
    return json.loads((as_path(url) / LOCK_FILE).read_text())


def _second_refused_first_holds(url: str, first: DirectoryLock, second: DirectoryLock) -> None:
    """``second.acquire()`` (during which ``first`` acquires, by the test's interleaving) is refused, and ``first``
    alone holds the lock."""
    try:
        with pytest.raises(LockHeldError, match="is in use by process"):
            second.acquire()
        assert first.held and not second.held
        assert _holder(url)["token"] == first.token
    finally:
        first.release()


def _once(monkeypatch, name: str, before=None, after=None):
    """Replace ``resjax.train.lock.<name>`` so that its first call runs ``before()`` first, or ``after(result,
    *args)`` after it; later calls (the other run's among them) are the real function."""
    real, fired = getattr(lockmod, name), []

    def wrapper(*args, **kwargs):
        if fired:
            return real(*args, **kwargs)
        fired.append(True)
        if before is not None:
            before()
        out = real(*args, **kwargs)
        if after is not None:
            after(out, *args)
        return out

    monkeypatch.setattr(lockmod, name, wrapper)


# Broken on purpose: _put(create=True) without its precondition (ifGenerationMatch=0 / If-None-Match) -> the
# overtaken run overwrites the first one's lock and holds it too.
@pytest.mark.parametrize("store", STORES)
def test_a_run_overtaken_between_finding_no_lock_and_creating_it_is_refused(store, request, monkeypatch):
    url = request.getfixturevalue(store).url("create")
    first, second = DirectoryLock(url, "out"), DirectoryLock(url, "out")
    real = lockmod._object

    def stale_read(fs, key):  # the second run reads "no lock"; the first creates it before the second writes
        monkeypatch.setattr(lockmod, "_object", real)
        first.acquire()
        return None

    monkeypatch.setattr(lockmod, "_object", stale_read)
    _second_refused_first_holds(url, first, second)


# Broken on purpose: the takeover's _put without match= (an unconditional rewrite) -> both takers hold the lock.
@pytest.mark.parametrize("store", STORES)
def test_of_two_runs_taking_over_one_expired_lease_the_overtaken_one_is_refused(store, request, monkeypatch):
    url = request.getfixturevalue(store).url("takeover")
    (as_path(url) / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "a-lost-vm", "token": "lost",
                                                      "lease_s": 0.001}))
    time.sleep(1.1)  # past the lease, whatever the store's clock resolution
    first, second = DirectoryLock(url, "out"), DirectoryLock(url, "out")
    real_judge = lockmod._BucketLock._judge

    def judge_then_overtaken(self, current):  # the second run judges the expired lease; the first takes it over
        real_judge(self, current)             # before the second's conditional rewrite
        monkeypatch.setattr(lockmod._BucketLock, "_judge", real_judge)
        first.acquire()

    monkeypatch.setattr(lockmod._BucketLock, "_judge", judge_then_overtaken)
    _second_refused_first_holds(url, first, second)


# Broken on purpose: acquire without reading the lock back (holding it once its write returned) -> the run whose
# record was overwritten holds the lock beside the run that wrote last.
@pytest.mark.parametrize("store", STORES)
def test_a_run_whose_record_is_overwritten_before_it_reads_it_back_does_not_hold_the_lock(store, request,
                                                                                          monkeypatch):
    url = request.getfixturevalue(store).url("readback")
    other = {"pid": 1, "host": "another-vm", "started": "now", "token": "another run's", "lease_s": 60.0}

    def overwritten(version, fs, key, *args, **kwargs):  # another writer lands between the write and its read-back
        fs.pipe_file(key, json.dumps(other).encode())

    _once(monkeypatch, "_put", after=overwritten)
    run = DirectoryLock(url, "out")
    with pytest.raises(LockHeldError, match="is in use by process 1 on host another-vm"):
        run.acquire()
    assert not run.held and _holder(url)["token"] == "another run's"


# Broken on purpose: release with fs.rm_file (an unconditional delete) -> the lock of the run that took over is gone.
@pytest.mark.parametrize("store", STORES)
def test_a_run_giving_up_a_lock_taken_over_since_it_read_it_leaves_the_new_holders(store, request, monkeypatch):
    url = request.getfixturevalue(store).url("release")
    stalled = DirectoryLock(url, "out").acquire()
    stalled._bucket._stop.set()  # its lease renewals stop (a stalled run)
    taker = {"pid": 2, "host": "another-vm", "started": "now", "token": "the taker's", "lease_s": 60.0}

    def taken_over(current, fs, key):  # the stalled run read its own record; another run takes the lock over
        lockmod._put(fs, key, json.dumps(taker).encode(), match=current["version"])

    _once(monkeypatch, "_object", after=taken_over)
    stalled.release()
    assert not stalled.held
    assert _holder(url)["token"] == "the taker's"


def test_a_holder_on_this_machine_whose_process_is_gone_is_taken_over_at_once_and_a_live_one_refused(gcs, capsys):
    """SIGKILLed, a run leaves a live-looking lease: a restart on the same machine takes it over at once (its
    process is gone), while a running process's lock is refused whatever the lease's age."""
    url = gcs.url("dead")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"pid": int(dead.stdout), "host": "this", "machine": lockmod._machine(), "started": "then",
              "token": "killed", "lease_s": 60.0}
    (as_path(url) / LOCK_FILE).write_text(json.dumps(record))
    with DirectoryLock(url, "out") as run:
        assert _holder(url)["token"] == run.token
    assert "that process ran on this machine and is not running" in capsys.readouterr().err
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (as_path(url) / LOCK_FILE).write_text(json.dumps({**record, "pid": live.pid, "token": "live"}))
        with pytest.raises(LockHeldError, match=f"is in use by process {live.pid}"):
            DirectoryLock(url, "out").acquire()
    finally:
        live.kill()
        live.wait()
