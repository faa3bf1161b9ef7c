"""``python -m benchmarks.torch_cpu --quick``: resjax against PyTorch on the CPU. PyTorch is an optional
dependency of the benchmarks (``pip install -e ".[bench]"``), never of the tests: without it this module is
skipped."""
import json
import math

import pytest

pytest.importorskip("torch")

from benchmarks import torch_cpu  # noqa: E402


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("depth,count", [(20, 269_722), (56, 853_018)])
def test_the_pytorch_resnet_has_the_published_parameter_count(depth, count):
    net = torch_cpu.torch_cifar_resnet(depth)
    assert sum(p.numel() for p in net.parameters()) == count  # as cifar_resnet(depth)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_cpu") / "torch_cpu.json"
    returned = torch_cpu.main(["--quick", "--out", str(out)])
    loaded = json.loads(out.read_text())
    assert loaded.keys() == returned.keys()
    return loaded


def test_the_training_step_side_by_side(result):
    run = result["step"]["every core a device"]
    assert run["params"]["resjax"] == run["params"]["torch"]
    assert set(run["variants"]) == set(torch_cpu.QUICK_VARIANTS)
    for v in run["variants"].values():
        assert _positive(v["step"]["median_s"]) and _positive(v["step_compile_s"])
        assert len(v["losses"]) == result["settings"]["check_steps"] and all(map(math.isfinite, v["losses"]))
    default = run["variants"]["default"]
    assert default["max_loss_diff"] == 0 and default["params_after_one_step_max_rel_diff"] == 0
    # resjax's CPU_XLA_FLAGS reach XLA: its program differs from jaxlib's own choice exactly when they are set
    flags_set = "-individual_convolution" in run["xla_flags"]
    assert (run["variants"]["ynn_jaxlib_default"]["program"] != default["program"]) == flags_set
    assert _positive(run["torch_nchw"]["median_s"]) and _positive(run["torch_channels_last"]["median_s"])


@pytest.mark.parametrize("part", ["sweep", "pair"])
def test_the_sweep_from_process_start(result, part):
    sw = result[part]  # one cell, and two side by side
    for r in sw["resjax"]:
        assert _positive(r["from_start_s"]) and _positive(r["steady_per_epoch_s"])
        assert r["from_start_s"] > sum(r["phases"].values()) - 1e-6 > 0
        assert r["first_sweep"]["compile_s"] > 0 and r["first_sweep"]["cache_hits"] == 0
    for runs in sw["torch"].values():
        for r in runs:
            assert _positive(r["from_start_s"]) and _positive(r["run_per_epoch_s"])


def test_a_later_start_reads_the_compilation_cache_and_trains_the_same(result):
    st = result["startup"]
    assert st["cold"]["first_sweep"]["cache_misses"] > 0 and st["cache_files"] > 0
    for warm in st["warm"]:
        assert warm["first_sweep"]["cache_hits"] > 0 and warm["first_sweep"]["cache_misses"] == 0
        assert warm["final_train_loss"] == st["cold"]["final_train_loss"]  # bit for bit
    no_cache = result["sweep"]["resjax"][0]
    assert no_cache["final_train_loss"] == st["cold"]["final_train_loss"]


def test_the_summary_ratios(result):
    s = result["summary"]
    assert all(_positive(v["torch_over_resjax"]) for v in s["resnet_step"].values())
    for key in ("steady_torch_over_resjax", "from_start_torch_over_resjax", "from_start_torch_over_resjax_cached"):
        assert _positive(s["sweep"][key])
    for key in ("steady_torch_over_resjax", "from_start_torch_over_resjax"):
        assert _positive(s["pair"][key])
