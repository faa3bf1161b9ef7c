"""resjax.use_every_cpu_core: the XLA_FLAGS it writes (a pure function of the environment and jaxlib's version;
nothing here starts JAX's backend, whose flags were fixed when the suite's first program ran)."""

import os

import pytest

import resjax

YNN = resjax.CPU_XLA_FLAGS[0].split("=")[0]


def flags_after(monkeypatch, xla_flags="", devices="3", cpu_flags=None, jaxlib=(0, 10, 2)):
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
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
