"""The test run's own environment (``tests/conftest.py``): its processes keep the bytecode of what they import."""

import os
import subprocess
import sys


# Broken on purpose: conftest's two lines removed and the run started with PYTHONDONTWRITEBYTECODE=1 (as this
# project's machines start every command): this test fails.
def test_the_run_and_its_subprocesses_write_bytecode(tmp_path):
    """With PYTHONDONTWRITEBYTECODE set, every process of the run would compile every source it imports again
    (~1 s of CPU per JAX process; the suite 13.3 min against 11.1 from a fresh clone): the run unsets it for itself
    and for every process it starts."""
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ and sys.dont_write_bytecode is False
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import probe_module"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc")), "the subprocess wrote no bytecode"
