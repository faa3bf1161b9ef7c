import gc
import os

# Tests never write to the user's cache.
os.environ.setdefault("RESJAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "resjax"))
# The experiments' entry points keep compiled programs on disk (resjax.enable_compilation_cache); in the tests
# that would write every program of the suite, so it is off unless a test turns it on.
os.environ.setdefault("RESJAX_COMPILATION_CACHE", "0")


import resjax  # noqa: E402

resjax.use_every_cpu_core()  # as the experiment entry points run: one JAX device per CPU core

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA's optimisation passes cost far more than tiny test programs' run time (initialising a small
    ResNet compiles in ~8 s with them, ~1 s without); modules that only check numbers of such programs
    compile without them (``jax_disable_most_optimizations``)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each executable's machine code into
    memory, and a process may hold at most ``vm.max_map_count`` (65530 on Linux by default) mappings: the
    whole suite in one process kept ~700 tests' programs alive, crossed that limit inside XLA's compiler
    and crashed (SIGSEGV/SIGABRT) in whichever module came next. No test relies on a program compiled in
    another module."""
    yield
    jax.clear_caches()
    gc.collect()
