"""``python -m benchmarks.accelerator --quick`` runs on the CPU and writes a complete, sensible JSON."""
import json
import math

import numpy as np
import pytest

from benchmarks import accelerator


@pytest.fixture(scope="module")
def result(tmp_path_factory, fast_compiles):
    out = tmp_path_factory.mktemp("acc") / "acc.json"
    returned = accelerator.main(["--quick", "--out", str(out)])
    loaded = json.loads(out.read_text())
    assert loaded.keys() == returned.keys()
    return loaded


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_section_and_the_device_fields(result):
    assert {"settings", "device", "matmul", "degradation", "resnets", "correctness", "wall_s"} <= result.keys()
    d = result["device"]
    assert d["device_kind"] and d["platform"] and d["device_count"] >= 1 and d["devices"]


def test_the_three_peaks_are_positive_and_finite(result):
    assert set(result["matmul"]) == {"highest", "default", "bfloat16"}
    assert result["matmul"]["bfloat16"]["dtype"] == "bfloat16"
    for m in result["matmul"].values():
        assert _positive(m["peak_gflops"])
        assert m["peak_gflops"] == max(r["gflops"] for r in m["sizes"].values())


def test_throughputs_are_positive(result):
    g = result["degradation"]
    assert g["configs"]
    for r in g["configs"].values():
        assert _positive(r["examples_per_s"]) and _positive(r["gflops"])
        assert set(r["fraction_of_peak"]) == {"highest", "default", "bfloat16"}
        assert all(_positive(f) for f in r["fraction_of_peak"].values())
    v = g["vmap_vs_sequential"]
    assert _positive(v["vmapped"]["best_s"]) and _positive(v["sequential"]["best_s"])
    rn = result["resnets"]
    assert {(r["seeds"], r["scan"], r["dtype"]) for r in rn.values()} == {
        (1, True, "float32"), (1, False, "float32"), (2, True, "float32"), (2, False, "float32"),
        (1, False, "bfloat16")}
    for r in rn.values():
        assert _positive(r["images_per_s"]) and _positive(r["compile_s"]) and _positive(r["flops_per_call"])
        assert r["images"] == r["seeds"] * r["batch_size"]
        assert 0 < r["fraction_of_peak"] < math.inf


def test_the_three_correctness_checks_pass_within_their_tolerances(result):
    c = result["correctness"]
    assert set(c) == {"scan_vs_unrolled", "vmapped_sweep_vs_alone", "device_vs_float64"}
    for r in (c["scan_vs_unrolled"], c["vmapped_sweep_vs_alone"]):
        assert r["passed"] is True
        assert r["rtol"] > 0 and r["atol"] > 0
        assert 0 <= r["max_abs_diff"] <= r["atol"] + r["rtol"] * 1e6  # finite and recorded
    f = c["device_vs_float64"]
    assert f["passed"] is True and f["factor"] == 4.0
    # the float32 step really is compared with a float64 one: a small error, not zero, on some leaf
    assert f["dtypes"] == {"device": "float32", "cpu": "float32", "reference": "float64"}
    assert 0 < f["cpu_error"] < 1e-2 and 0 <= f["cpu_median_error"] <= f["cpu_error"] and f["leaves"] > 10
    # on this CPU-only machine the default device is the CPU: the JSON says so, and the two runs are one
    assert f["same_device"] is True
    assert f["device_error"] == f["cpu_error"] and f["device_vs_cpu"]["max_abs_diff"] == 0.0


def test_relative_errors_are_per_leaf_norms_largest_first():
    nan = np.nan
    ref = {"a": np.array([3.0, 4.0]), "b": np.zeros(2), "h": np.array([1.0, nan]), "k": np.array([1, 2])}
    got = {"a": np.array([3.0, 4.5]), "b": np.array([0.0, 0.25]), "h": np.array([1.0, nan]), "k": np.array([5, 6])}
    errors = accelerator.relative_errors(got, ref)
    assert [p for _, p in errors] == ["['b']", "['a']", "['h']"]  # integer leaves left out, NaN = NaN
    assert errors[1][0] == pytest.approx(0.5 / 5.0) and errors[0][0] == pytest.approx(0.25) and errors[2][0] == 0
    got["h"] = np.array([nan, 2.0])  # a NaN the reference does not have: an infinite error, first
    assert accelerator.relative_errors(got, ref)[0] == (math.inf, "['h']")

def test_a_failing_section_is_recorded_and_the_rest_still_run_and_are_kept(monkeypatch):
    """On a new backend one broken code path must not cost the rest of a lease's check: the section's error is
    recorded, the later sections run, and the JSON is kept after each section and each ResNet program."""
    def broken(s):
        raise RuntimeError("no such kernel")

    def program(name):
        if name == "b":
            raise ValueError("out of memory")
        return {"images_per_s": 1.0}

    monkeypatch.setattr(accelerator, "matmul_rates", lambda sizes, repeats, how: {"peak_gflops": 2.0})
    monkeypatch.setattr(accelerator, "correctness", broken)
    monkeypatch.setattr(accelerator, "degradation", lambda s, peaks: {"peaks": dict(peaks)})
    monkeypatch.setattr(accelerator, "resnet_programs", lambda s, peak: [(k, lambda k=k: program(k)) for k in "abc"])
    monkeypatch.setattr(accelerator, "print_degradation", lambda g, s: None)
    monkeypatch.setattr(accelerator, "print_resnets", lambda rows: None)
    kept = []
    res = accelerator.run(quick=True, keep=lambda r: kept.append(json.loads(json.dumps(r, default=str))))
    assert res["finished"] is True and list(res["section_s"]) == list(accelerator.SECTIONS)
    assert res["correctness"]["error"] == "RuntimeError: no such kernel" and "Traceback" in res["correctness"]["traceback"]
    assert res["degradation"] == {"peaks": {"highest": 2.0, "default": 2.0, "bfloat16": 2.0}}
    assert res["resnets"]["b"]["error"] == "ValueError: out of memory"
    assert res["resnets"]["a"] == res["resnets"]["c"] == {"images_per_s": 1.0}
    # kept after matmul, correctness, degradation, each of the three programs and the resnets section
    assert len(kept) == 7 and not any(k["finished"] for k in kept)
    assert "correctness" not in kept[0] and "error" in kept[1]["correctness"] and list(kept[3]["resnets"]) == ["a"]
