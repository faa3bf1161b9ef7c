"""The test run's environment, set before JAX starts in this process and inherited by every subprocess.

Compiled programs are shared across the whole run: one persistent compilation cache in a folder of the
run's own (``RESJAX_TEST_RUN_DIR``, made by the first pytest process and removed by it at the end), used by
the test processes (pytest-xdist workers too), the experiments' entry points they start
(``RESJAX_COMPILATION_CACHE``) and every other JAX process they start (``JAX_COMPILATION_CACHE_DIR``), for
every program however fast it compiled. A program the suite compiled once, in any module or process, is
loaded from disk the next time (after ``release_compiled_programs`` dropped it, in a subprocess, in the other
worker). ``RESJAX_COMPILATION_CACHE=0`` set before pytest starts turns the cache off for the run.
"""

import contextlib
import functools
import gc
import os
import shutil
import sys
import tempfile

# Tests compile many tiny programs whose XLA optimisation passes cost far more than they save (initialising a
# small ResNet compiles in ~8 s with them, ~1 s without): the whole run, subprocesses included, compiles without
# them unless told otherwise (``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` before pytest starts). Modules whose programs
# are heavy to run (float64 convolutions) or whose promise is about the production compile (a seed in the
# vmapped sweep equals the seed alone) turn them back on with ``optimized_compiles``. Measured on the 2-core
# CPU, one module at a time (-n 0, CPU seconds): test_readme 88 -> 44, test_tau 53 -> 26, test_batchnorm
# 45 -> 23, test_paths 38 -> 24; test_peer_training 42 -> 51 (float64 convolutions; kept optimised).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA:CPU's older loop emitters (``--xla_cpu_use_fusion_emitters=false``) for the same reason: they compile the suite's
# programs in about two thirds of the time of the default fusion emitters (the whole suite from a warm virtual
# environment on the 2-core CPU, 2026-12-06: 527 -> 407 s). Every program compiled with XLA's optimisation passes on
# (``optimized_compiles``, ``xla_optimisations(True)``: the promises about what users compile) and every program in
# a ``default_emitters`` block is compiled with the default emitters again (``_users_codegen_when_optimised``), as a
# user's program is: the two emitters round some fused reductions differently, so a promise of bit-identity
# between two programs holds under the default emitters (what users run) and may fail under the loop emitters (the
# traced momentum of test_grid_settings did). ``RESJAX_TEST_LOOP_EMITTERS=0`` before pytest starts turns this off.
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# The experiments' entry points at --quick sizes compile so too (``resjax.use_every_cpu_core(fast_compile=True)``),
# and keep what the run set here: the suite's processes all compile alike (tests compare numbers across them bit
# for bit).

# Python's cyclic garbage collector less often: tracing and lowering JAX programs allocate millions of small
# objects, and with the default thresholds (700, 10, 10) the collector keeps walking the young ones. The run
# still frees each module's garbage (``release_compiled_programs`` collects after every module). Measured on the
# 2-core CPU, test_residual + test_batchnorm + test_tau in one process, alternating: 69.7 / 66.6 s with the
# default thresholds, 65.2 / 63.9 s with these (about 5% less).
gc.set_threshold(100_000, 50, 1000)

# Bytecode kept: with PYTHONDONTWRITEBYTECODE set (this project's machines set it for every command), every
# process of the run (pytest-xdist's workers, the ~150 subprocesses that start JAX) would compile every source it
# imports again, ~1 s of CPU per JAX process; the whole suite from a fresh clone took 13.3 min so on the 2-core
# machine, 11.1 min without it (2026-12-06). ``.ci/run`` unsets it too, for this first process's imports.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Tests never write to the user's cache.
os.environ.setdefault("RESJAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "resjax"))

_OWNS_RUN_DIR = "RESJAX_TEST_RUN_DIR" not in os.environ  # the first pytest process; workers inherit its folder
if _OWNS_RUN_DIR:
    os.environ["RESJAX_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="resjax-tests-")
    if os.environ.get("RESJAX_COMPILATION_CACHE", "").strip().lower() not in ("0", "off", "false", "no", "none"):
        cache = os.path.join(os.environ["RESJAX_TEST_RUN_DIR"], "jax")
        os.environ["RESJAX_COMPILATION_CACHE"] = cache
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


import resjax  # noqa: E402

resjax.use_every_cpu_core()  # as the experiment entry points run: one JAX device per CPU core
resjax.enable_compilation_cache()

import jax  # noqa: E402
import pytest  # noqa: E402

# the local object stores' fixtures, defined once for every test module: a session fixture imported into two modules
# is two fixtures, and the second S3 server's endpoint would replace the first's under fsspec's cached file systems
from tests.buckets import gcs, s3, s3_reader  # noqa: E402, F401

try:  # JAX's own module (not public API): without it the run keeps the default emitters (_loop_emitters_wanted)
    from jax._src import compiler as _jax_compiler  # noqa: E402
except ImportError:  # pragma: no cover - a JAX that moved it
    _jax_compiler = None

#: Programs compiled with XLA's default (fusion) emitters however the run's ``XLA_FLAGS`` chose: set by
#: ``default_emitters``.
_DEFAULT_EMITTERS = [False]


def _loop_emitters_wanted() -> bool:
    """The loop emitters for the run: unless ``RESJAX_TEST_LOOP_EMITTERS`` is off, ``XLA_FLAGS`` chose emitters
    already, jaxlib is older than the flag (XLA aborts on a flag it does not know), or JAX's compile options can not
    be given back the default emitters (``_users_codegen_when_optimised``) for the programs that need them."""
    if os.environ.get("RESJAX_TEST_LOOP_EMITTERS", "1").strip().lower() in resjax.OFF_VALUES + ("",):
        return False
    if "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", "").replace(LOOP_EMITTERS, ""):
        return False
    jaxlib = resjax._jaxlib_version()
    return (jaxlib is not None and jaxlib >= resjax.CPU_XLA_FLAGS_SINCE
            and callable(getattr(_jax_compiler, "get_compile_options", None)))


def _users_codegen_when_optimised(get_compile_options):
    """JAX's ``get_compile_options`` with XLA:CPU's default emitters put back (a per-program option, as
    ``jax.jit(...).lower(...).compile({...})`` gives one) whenever XLA's optimisation passes are on or a
    ``default_emitters`` block is open: those programs are compiled exactly as a user's are."""
    @functools.wraps(get_compile_options)
    def wrapped(*args, env_options_overrides=None, **kwargs):
        if _DEFAULT_EMITTERS[0] or not jax.config.read("jax_disable_most_optimizations"):
            env_options_overrides = {"xla_cpu_use_fusion_emitters": True, **(env_options_overrides or {})}
        return get_compile_options(*args, env_options_overrides=env_options_overrides, **kwargs)
    return wrapped


# Before JAX's backend starts, which reads XLA_FLAGS once; pytest-xdist's workers and subprocesses inherit the flag
# (a worker finds it set and wraps its own JAX's compile options).
if _loop_emitters_wanted():
    if LOOP_EMITTERS not in os.environ.get("XLA_FLAGS", "").split():
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LOOP_EMITTERS}".strip()
    _jax_compiler.get_compile_options = _users_codegen_when_optimised(_jax_compiler.get_compile_options)


def pytest_unconfigure(config):
    if _OWNS_RUN_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["RESJAX_TEST_RUN_DIR"], ignore_errors=True)


@contextlib.contextmanager
def xla_optimisations(on: bool):
    """XLA's optimisation passes on or off inside the block, as they were after it: for a few programs of a test
    (``from tests.conftest import xla_optimisations``), e.g. a model's initialisers in a module whose programs are
    compiled optimised (~0.9 s an eager ``jax.random.normal`` optimised, ~0.1 s not)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not on)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module")
def optimized_compiles():
    """XLA's optimisation passes on for the module (the run's default is off, see the top of this file): for
    programs that are heavy to run (float64 convolutions run ~20x slower without them) and for promises about
    what users' programs compile to (a seed inside the vmapped sweep equals the seed alone). Subprocesses the
    module starts inherit ``JAX_DISABLE_MOST_OPTIMIZATIONS`` from the run: pass ``0`` in their environment."""
    with xla_optimisations(True):
        yield


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA's optimisation passes cost far more than tiny test programs' run time (initialising a small
    ResNet compiles in ~8 s with them, ~1 s without); modules that only check numbers of such programs
    compile without them (``jax_disable_most_optimizations``): the run's default, stated where it matters."""
    with xla_optimisations(False):
        yield


def subprocess_xla_flags(device_count: int | None = None) -> str:
    """``XLA_FLAGS`` for a JAX process that a test starts: the run's own (the loop emitters, resjax's CPU options)
    with ``device_count`` host devices in place of the run's count (``None``: no count, the process sets its own)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if device_count is not None:
        flags.insert(0, f"--xla_force_host_platform_device_count={device_count}")
    return " ".join(flags)


@contextlib.contextmanager
def default_emitters_block():
    """XLA:CPU's default (fusion) emitters inside the block, whatever the optimisation passes: for a promise of
    bit-identity between two programs, which users' default compile keeps and the run's faster loop emitters (top
    of this file) may not."""
    old = _DEFAULT_EMITTERS[0]
    _DEFAULT_EMITTERS[0] = True
    try:
        yield
    finally:
        _DEFAULT_EMITTERS[0] = old


@pytest.fixture(scope="module")
def default_emitters():
    """``default_emitters_block`` for the module (programs in memory are dropped after each module, so none
    compiled with the other emitters is reused)."""
    with default_emitters_block():
        yield


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each executable's machine code into
    memory, and a process may hold at most ``vm.max_map_count`` (65530 on Linux by default) mappings: the
    whole suite in one process kept ~700 tests' programs alive, crossed that limit inside XLA's compiler
    and crashed (SIGSEGV/SIGABRT) in whichever module came next. No test relies on a program compiled in
    another module (the persistent cache brings a dropped program back from disk without compiling it)."""
    yield
    jax.clear_caches()
    gc.collect()


#: Test modules that take longest, longest first (each over 20 s, seconds summed over its tests in a ``--junitxml``
#: run of the whole suite on this project's 2-core CPU, 2026-12-06): pytest-xdist hands whole modules
#: (``--dist=loadfile``) to workers in collection order, so a long module collected last would leave the other
#: worker idle at the end (the list of 2026-12-02 had fallen behind: test_signals, 58 s, ran among the last).
#: Every other module follows in name order.
LONGEST_FIRST = ("test_doc_examples", "test_multiprocess", "test_analysis_matrix", "test_signals", "test_reproduce_jobs",
                 "test_flax_native", "test_resnet_signal", "test_interop", "test_resume_experiments", "test_docs",
                 "test_accelerator_benchmark", "test_grid", "test_faults", "test_image_train", "test_residual",
                 "test_training", "test_experiments", "test_tau", "test_paths", "test_grid_settings",
                 "test_resnet_training", "test_equality_claims", "test_import_hygiene", "test_remat", "test_batchnorm",
                 "test_peer_training", "test_image_experiments", "test_resnet", "test_train_core",
                 "test_mixed_precision", "test_objective")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: name order within and after


def pytest_xdist_auto_num_workers(config):
    """``--numprocesses=auto`` (the default, ``pyproject.toml``): one worker per CPU core, at most 4. Each worker
    is a JAX process with one device per core and its own compiled programs (1-3 GB), so more workers than
    that cost memory for little gain; ``-n 0`` runs the suite in this process."""
    return max(1, min(os.cpu_count() or 1, 4))
