"""The TPU compile tests' child processes (``tests/tpu_programs.py``): libtpu found, the child run, its rows read.

libtpu is looked for in this interpreter (``pip install -e '.[tpu]'``) and in ``<repo>/.tpu`` (where ``.ci/run``
installs it, ``pip install --target .tpu libtpu==...``, outside the test environment: with libtpu importable,
every JAX process on a machine without a TPU prints libtpu's start-up warnings to stderr, which the suite's
one-line error checks would read). The tests are skipped only where neither has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = ROOT / ".tpu"


def libtpu_path() -> str | None:
    """The folder to put on PYTHONPATH for libtpu ('' when this interpreter has it), or None when none has it."""
    if importlib.util.find_spec("libtpu") is not None:
        return ""
    if (TARGET / "libtpu").is_dir():
        return str(TARGET)
    return None


def programs(which: str, timeout: float = 280) -> list[dict]:
    """Run ``tests/tpu_programs.py which`` and return its rows (skips the test without libtpu)."""
    path = libtpu_path()
    if path is None:
        pytest.skip("libtpu is not installed (pip install -e '.[tpu]', or .ci/run's pip install --target .tpu)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "tpu_programs.py"), which], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
