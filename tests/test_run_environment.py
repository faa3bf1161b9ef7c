"""The test run's own environment (``tests/conftest.py``): its processes keep the bytecode of what they import, and
compile with XLA:CPU's loop emitters except where a promise is about what users compile."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import conftest


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


def _emitter_options(monkeypatch, block) -> list:
    """The per-program XLA options of each program that JAX compiles inside ``block`` (a context manager), as JAX
    asks the run's ``get_compile_options`` for them."""
    seen = []
    wrapped = conftest._jax_compiler.get_compile_options

    def spy(*args, **kwargs):
        options = wrapped(*args, **kwargs)
        seen.append(dict(options.env_option_overrides))
        return options

    with monkeypatch.context() as patch, block:
        patch.setattr(conftest._jax_compiler, "get_compile_options", spy)
        jax.jit(lambda v: jnp.tanh(v).sum()).lower(np.arange(7.0, dtype=np.float32)).compile()
    return seen


@pytest.mark.skipif(not conftest._loop_emitters_wanted(),
                    reason="the loop emitters are off for this run (RESJAX_TEST_LOOP_EMITTERS=0, XLA_FLAGS or jaxlib)")
def test_fast_programs_use_the_loop_emitters_and_programs_as_users_compile_them_the_default_ones(monkeypatch):
    """The run compiles with ``--xla_cpu_use_fusion_emitters=false`` (its processes inherit it), and every program
    compiled with XLA's optimisation passes on, or in a ``default_emitters`` block, is given the default emitters
    back as a per-program option. Broken on purpose (the wrapper no longer adds the option): this test fails."""
    assert conftest.LOOP_EMITTERS in os.environ["XLA_FLAGS"].split()
    fast = _emitter_options(monkeypatch, conftest.xla_optimisations(False))
    optimised = _emitter_options(monkeypatch, conftest.xla_optimisations(True))
    default = _emitter_options(monkeypatch, conftest.default_emitters_block())
    assert fast == [{}]
    assert optimised == default == [{"xla_cpu_use_fusion_emitters": True}]
