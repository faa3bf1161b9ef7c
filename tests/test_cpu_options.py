"""resjax.use_every_cpu_core: the XLA_FLAGS it writes (a pure function of the environment and jaxlib's version;
nothing here starts JAX's backend, whose flags were fixed when the suite's first program ran)."""

import os

import pytest

import resjax

YNN = resjax.CPU_XLA_FLAGS[0].split("=")[0]


def flags_after(monkeypatch, xla_flags="", devices="3", cpu_flags=None, jaxlib=(0, 10, 2), fast=None):
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    if fast is None:
        monkeypatch.delenv("RESJAX_FAST_COMPILE", raising=False)  # the suite's own runs with it (tests/conftest.py)
    else:
        monkeypatch.setenv("RESJAX_FAST_COMPILE", fast)
    monkeypatch.setenv("RESJAX_CPU_DEVICES", devices)
    if cpu_flags is None:
        monkeypatch.delenv("RESJAX_XLA_CPU_FLAGS", raising=False)
    else:
        monkeypatch.setenv("RESJAX_XLA_CPU_FLAGS", cpu_flags)
    monkeypatch.setattr(resjax, "_jaxlib_version", lambda: jaxlib)
    resjax.use_every_cpu_core()
    return os.environ["XLA_FLAGS"].split()


def test_by_default_every_core_is_a_device_and_convolutions_leave_ynnpack(monkeypatch):
    assert flags_after(monkeypatch) == ["--xla_force_host_platform_device_count=3", *resjax.CPU_XLA_FLAGS]


@pytest.mark.parametrize("value", ["0", "off", "false", ""])
def test_resjax_xla_cpu_flags_off_leaves_them_out(monkeypatch, value):
    assert flags_after(monkeypatch, cpu_flags=value) == ["--xla_force_host_platform_device_count=3"]


def test_options_the_user_set_are_kept(monkeypatch):
    mine = f"--xla_force_host_platform_device_count=5 {YNN}=individual_dot"
    assert flags_after(monkeypatch, xla_flags=mine) == mine.split()
    assert flags_after(monkeypatch, devices="1") == list(resjax.CPU_XLA_FLAGS)


def test_an_older_jaxlib_gets_no_flag_it_would_abort_on(monkeypatch):
    assert flags_after(monkeypatch, jaxlib=(0, 9, 0)) == ["--xla_force_host_platform_device_count=3"]
    assert flags_after(monkeypatch, jaxlib=None) == ["--xla_force_host_platform_device_count=3"]


@pytest.fixture
def jax_optimisations(monkeypatch):
    """``JAX_DISABLE_MOST_OPTIMIZATIONS`` unset, and JAX's setting restored after the test."""
    import jax

    old = jax.config.read("jax_disable_most_optimizations")
    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    jax.config.update("jax_disable_most_optimizations", False)
    yield jax
    jax.config.update("jax_disable_most_optimizations", old)


@pytest.mark.parametrize("value", ["1", "true"])
def test_fast_compile_turns_xla_passes_off_and_adds_no_flag(monkeypatch, jax_optimisations, value):
    # no XLA flag: the loop emitters (--xla_cpu_use_fusion_emitters=false) compile faster still, but a run chunked
    # otherwise then no longer ends bit-identical (resjax/__init__.py)
    assert flags_after(monkeypatch, fast=value) == ["--xla_force_host_platform_device_count=3", *resjax.CPU_XLA_FLAGS]
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"  # for the processes this one starts
    assert jax_optimisations.config.read("jax_disable_most_optimizations")  # and this one, JAX imported already


def test_fast_compile_keeps_what_the_user_set(monkeypatch, jax_optimisations):
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    assert flags_after(monkeypatch, fast="0") == ["--xla_force_host_platform_device_count=3", *resjax.CPU_XLA_FLAGS]
    assert flags_after(monkeypatch, fast="1", cpu_flags="0", jaxlib=(0, 9, 0)) == [
        "--xla_force_host_platform_device_count=3"]  # an older jaxlib: no flag it would abort on
    assert not jax_optimisations.config.read("jax_disable_most_optimizations")


@pytest.mark.parametrize("argv, env, fast", [(["--quick"], None, True), (["--out", "x"], None, False),
                                             (["--quick"], "0", False), ([], "1", True)])
def test_an_entry_point_compiles_fast_for_quick_sizes_unless_the_environment_decides(monkeypatch, jax_optimisations,
                                                                                     argv, env, fast):
    from experiments import runner

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(resjax, "_jaxlib_version", lambda: (0, 10, 2))
    if env is None:
        monkeypatch.delenv("RESJAX_FAST_COMPILE", raising=False)
    else:
        monkeypatch.setenv("RESJAX_FAST_COMPILE", env)
    runner.start(argv)
    assert jax_optimisations.config.read("jax_disable_most_optimizations") == fast
