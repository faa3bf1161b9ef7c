"""Real local object stores for the bucket tests, started by fixtures and ended by them (issue #50).

- ``gcs``: the ``gcp-storage-emulator`` package's server (pure Python; the JSON API over plain HTTP), in memory, on
  127.0.0.1 and a free port, with a bucket, run by ``tests/gcs_server.py`` (which adds the preconditions and the
  download generation header the emulator lacks); this process and the processes it starts reach it through
  ``STORAGE_EMULATOR_HOST`` (gcsfs, the Python client) and ``TENSORSTORE_GCS_HTTP_URL`` (TensorStore, which writes
  Orbax's arrays). ``GCE_METADATA_HOST`` points at a closed port, so the credential search ends at once.
- ``s3``: ``moto``'s S3 server (``moto_server``), which honours S3's conditional writes (``If-None-Match``,
  ``If-Match``): the lock's races are tested there too.
- ``s3_reader``: a second moto server that checks credentials (``INITIAL_NO_AUTH_ACTION_COUNT``: every request
  after the setup's is authenticated against its IAM users), with a bucket and a user allowed only to read it:
  read-only buckets and refused credentials are tested there.

One server of each kind per test process (session scope: fsspec keeps one file system per endpoint), each test in a
folder of its own (``url(name)``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

BUCKET = "resjax-tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        if process.poll() is not None:
            process.log.seek(0)
            pytest.fail(f"the {what} server exited at its start: {process.log.read()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    process.kill()
    pytest.fail(f"the {what} server did not answer on port {port} within 60 s")


def _command(name: str) -> str:
    found = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(found):
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' installs it")
    return found


class Server:
    def __init__(self, scheme: str, endpoint: str, process: subprocess.Popen) -> None:
        self.scheme, self.endpoint, self.process = scheme, endpoint, process

    def url(self, name: str = "") -> str:
        """A folder of this test's own in the bucket."""
        return f"{self.scheme}://{BUCKET}/{name or 'run'}-{uuid.uuid4().hex[:8]}"


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.log.close()


@pytest.fixture(scope="session")
def gcs():
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="gcs-server-", suffix=".log")  # not a pipe: a full pipe stalls it
    process = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "gcs_server.py"), "127.0.0.1",
                                str(port), BUCKET], stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    _wait_for(port, process, "GCS emulator")
    endpoint = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint,
           "GCE_METADATA_HOST": f"127.0.0.1:{_free_port()}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield Server("gs", endpoint, process)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        _stop(process)


def _moto(what: str, prefix: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A ``moto_server`` on 127.0.0.1 and a free port, answering (its output in a temporary file, not a pipe):
    ``(process, endpoint)``."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=prefix, suffix=".log")
    process = subprocess.Popen([_command("moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                               stderr=subprocess.STDOUT, text=True, env=env)
    process.log = log
    _wait_for(port, process, what)
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def s3():
    process, endpoint = _moto("S3 (moto)", "s3-server-")
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        yield Server("s3", endpoint, process)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        _stop(process)


#: The requests that set up ``s3_reader`` (bucket, user, policy, key) before the server starts checking credentials.
_SETUP_REQUESTS = 4


@pytest.fixture
def s3_reader(monkeypatch):
    """A moto server that authenticates every request after its setup, holding the bucket ``read-only-bucket`` and
    a user who may only read; this process's S3 settings point at it with that user's keys (``s3fs``'s cached file
    systems are dropped before and after, as they hold the endpoint and keys they were made with)."""
    import json

    import boto3
    import s3fs

    process, endpoint = _moto("S3 (moto, credentials checked)", "s3-reader-server-",
                              {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_REQUESTS)})
    try:
        settings = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                        aws_secret_access_key="setup")
        boto3.client("s3", **settings).create_bucket(Bucket="read-only-bucket")
        iam = boto3.client("iam", **settings)
        iam.create_user(UserName="reader")
        read = ["s3:GetObject", "s3:ListBucket", "s3:ListAllMyBuckets", "s3:GetBucketLocation"]
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": read, "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        yield endpoint
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        _stop(process)
