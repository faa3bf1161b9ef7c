"""``python -m benchmarks.reproduce``: the FLOP ledger, a row per experiment, each run in its own process, with its
peak memory; ``benchmarks.flops``, the counter behind it, on programs whose FLOPs are known."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import reproduce
from benchmarks.flops import FlopCounter

N = 64
MATMUL = 2 * N**3  # the FLOPs of one (N, N) @ (N, N)


@pytest.fixture(params=[False, True], ids=["unoptimised", "optimised"])
def xla_passes(request):
    """Both ways a program reaches the counter: compiled without XLA's optimisation passes (the test run's
    default; loops keep the test they were written with) and with them, as the experiments compile (fusions;
    XLA's ``known_trip_count`` on loops)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not request.param)
    yield request.param
    jax.config.update("jax_disable_most_optimizations", old)


def matrices():
    a = jax.random.normal(jax.random.key(0), (N, N))
    return a, jnp.linalg.qr(jax.random.normal(jax.random.key(1), (N, N)))[0]  # orthogonal: no overflow in chains


def test_a_jitted_matmul_run_k_times_counts_k_times_2n3(xla_passes):
    a, b = matrices()
    matmul = jax.jit(jnp.matmul)
    with FlopCounter() as counter:
        for _ in range(10):
            matmul(a, b)  # after the first call, jit's C++ path would run it without Python: not for this program
    assert counter.flops == pytest.approx(10 * MATMUL, rel=0.01)
    assert counter.summary()["dense_executions"] == 10


def test_loops_count_their_body_times_the_trip_count_also_when_it_is_an_argument(xla_passes):
    a, b = matrices()

    def scan(x, b, length=7):
        return jax.lax.scan(lambda c, _: (c @ b, None), x, None, length=length)[0]

    def fori(x, b, n):  # n an argument: one program for every n, its trip count read when it runs
        return jax.lax.fori_loop(0, n, lambda i, c: c @ b, x)

    def nested(unused, x, b, n):  # a scan inside a loop of n; an argument before n that the program drops
        return jax.lax.fori_loop(0, n, lambda i, c: scan(c, b, 3), x)

    with FlopCounter() as counter:
        jax.jit(scan)(a, b)
    assert counter.flops == pytest.approx(7 * MATMUL, rel=0.01)
    with FlopCounter() as counter:
        run = jax.jit(fori)
        for n in (3, 5, 0):
            run(a, b, n)
    assert counter.flops == pytest.approx(8 * MATMUL, rel=0.01)
    with FlopCounter() as counter:
        jax.jit(nested)(jnp.ones(2), a, b, 4)
    assert counter.flops == pytest.approx(12 * MATMUL, rel=0.01)
    assert counter.summary()["unresolved_loop_executions"] == 0


def test_xla_cost_analysis_counts_a_scanned_body_once_the_reason_for_the_counter():
    """What ``benchmarks.flops`` says of XLA:CPU's ``cost_analysis()``: right for one matmul, the body of a scan
    once whatever its length. (Should XLA count trip counts one day, this fails: the docstrings then need
    updating, the counter does not.)"""
    a, b = matrices()

    def flops(length):
        scan = lambda x, b: jax.lax.scan(lambda c, _: (c @ b, None), x, None, length=length)[0]  # noqa: E731
        return jax.jit(scan).lower(a, b).compile().cost_analysis()["flops"]

    assert jax.jit(jnp.matmul).lower(a, b).compile().cost_analysis()["flops"] == MATMUL
    assert flops(10) == pytest.approx(flops(1), rel=0.01)


def test_convolutions_and_their_gradients():
    x, w = jnp.ones((8, 16, 16, 3)), jnp.ones((3, 3, 3, 5))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    expected = 2 * 8 * 14 * 14 * 5 * 3 * 3 * 3  # 2 x output elements x (3 x 3 x 3 inputs each)
    with FlopCounter() as counter:
        jax.jit(conv)(x, w)
    assert counter.flops == expected
    with FlopCounter() as counter:
        jax.jit(jax.grad(lambda w: conv(x, w).sum()))(w)  # the kernel's gradient: a convolution as large
    assert counter.flops == expected


def test_a_program_on_several_devices_counts_every_device():
    if jax.device_count() < 2:
        pytest.skip("one device")
    a, b = jnp.ones((4, N, N)), jnp.ones((N, N))
    sharded = jax.device_put(a, NamedSharding(jax.make_mesh((2,), ("s",)), PartitionSpec("s")))
    with FlopCounter() as counter:
        jax.jit(lambda a, b: a @ b)(sharded, b)  # two devices, two matrices each
    assert counter.flops == 4 * MATMUL


def test_compile_seconds_are_counted():
    with FlopCounter() as counter:
        jax.jit(lambda x: jnp.sin(x) @ x)(np.arange(9.0, dtype=np.float32).reshape(3, 3))
    summary = counter.summary()
    assert summary["compiles"] >= 1 and summary["compile_s"] > 0 and summary["lower_s"] > 0


def test_a_row_per_experiment_with_its_flops_seconds_and_peak_memory(tmp_path, capsys):
    names = ["batchnorm_example", "gradient_scale"]  # two of the quickest; gradient_scale multiplies matrices
    rows = reproduce.main(["--size", "quick", "--only", ",".join(names), "--out", str(tmp_path / "runs"),
                           "--json", str(tmp_path / "rows.json"), "--peak", "quick"])
    assert [name for name, _ in rows] == names
    for name, row in rows:
        assert row["status"] == 0, (tmp_path / "runs" / f"{name}.log").read_text()
        assert (tmp_path / "runs" / name / "results.json").exists()  # reproduce ran it, into --out
        assert row["seconds"] > 0
        assert row["peak_rss_mb"] > 50  # the child's own peak (Python, NumPy and JAX loaded), not 0 or the parent's
        for key in ("gflop", "compile_s", "gflops", "of_peak"):
            assert math.isfinite(row[key]) and row[key] >= 0, (name, key, row[key])
    scale = dict(rows)["gradient_scale"]
    assert scale["gflop"] > 0 and scale["gflops"] > 0 and 0 < scale["of_peak"] < 1
    assert scale["ledger"]["unresolved_loop_executions"] == 0
    written = json.loads((tmp_path / "rows.json").read_text())
    assert set(written["rows"]) == set(names) and written["peak"]["peak_gflops"] > 0
    assert written["total"]["flops"] == sum(r["flops"] for _, r in rows)
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "total" in table and "GFLOP" in table and "of peak" in table
