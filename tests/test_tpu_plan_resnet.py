"""TPU compile tests (``benchmarks.tpu_plan``): a CIFAR ResNet-8's training step on the host feeder, one seed
data-parallel over v5e:4x4 (16 chips, 4 hosts) and two vmapped seeds data-parallel over v5e:2x2."""

from __future__ import annotations

import pytest

from tests.test_tpu_plan_mlp import check_row
from tests.tpu import programs


@pytest.fixture(scope="module")
def vmapped():
    return programs("resnet")  # 2 seeds vmapped, data-parallel over v5e:2x2


@pytest.fixture(scope="module")
def one_seed():
    return programs("resnet_dp")  # 1 seed, data-parallel over v5e:4x4


def step(rows):
    (row,) = [r for r in rows if r["name"].startswith("train step")]
    return row


def test_resnet8_step_data_parallel_over_four_hosts(one_seed):
    for r in one_seed:
        check_row(r)
    s = step(one_seed)
    assert s["hosts"] == 4 and s["chips"] == 16 and "data-parallel over 16 chips" in s["layout"]
    assert s["collectives"] > 0  # the gradients' and BatchNorm's all-reduces
    assert s["flops_per_chip"] * 16 == pytest.approx(s["flops"])


def test_resnet8_vmapped_seeds_compile_and_do_twice_one_seeds_work(vmapped, one_seed):
    for r in vmapped:
        check_row(r)
    two = step(vmapped)
    assert "2 seeds (vmap)" in two["layout"] and two["chips"] == 4
    assert two["flops"] > 0 and two["flops"] == 2 * step(one_seed)["flops"]  # the same batch, twice the runs
