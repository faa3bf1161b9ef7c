"""TPU compile tests (``benchmarks.tpu_plan``), MLP programs: a degradation cell with its seeds over 4 chips, a
packed grid, a Jacobian path expansion; and the plan's cost counts on known programs (no libtpu needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks import tpu_plan
from tests.tpu import programs


def check_row(row: dict) -> None:
    """Compiled for the TPU, within the chip's HBM, and the same dense work as the CPU program."""
    assert row["compiled"], row["error"]
    assert row["fits"] and 0 < row["hbm_per_chip"] <= row["hbm"]
    assert row["flops"] == row["cpu_flops"]
    assert row["unresolved_loops"] == 0


@pytest.fixture(scope="module")
def mlp_rows():
    return programs("mlp")


def test_degradation_cell_compiles_for_four_chips_with_the_cpus_work(mlp_rows):
    rows = [r for r in mlp_rows if r["what"] == "degradation cell"]
    assert [r["name"].split(" (")[0] for r in rows] == ["init", "train"]
    for r in rows:
        check_row(r)
        assert r["layout"] == "3 runs (1 per chip) over 4 chips"
    train = rows[1]
    # 2 epochs of 40 steps of batch 100 (4000 examples), each run's work: the loop counted by its trip count
    assert train["flops"] > 0 and train["flops_per_chip"] * 4 == pytest.approx(train["flops"])


def test_packed_grid_is_one_program_for_the_tpu(mlp_rows):
    rows = [r for r in mlp_rows if r["what"] == "packed grid"]
    assert [r["name"].split(" (")[0] for r in rows] == ["init", "train"]  # 4 runs of two depths, one program
    for r in rows:
        check_row(r)
    assert rows[1]["layout"] == "4 runs (1 per chip) over 4 chips"


def test_path_expansion_compiles_for_the_tpu():
    (row,) = programs("paths")
    check_row(row)
    assert row["flops"] > 0


def test_seed_axis_auto_plans_both_layouts_and_chooses_the_cheaper_that_fits():
    rows = programs("host_mlp")
    for r in rows:
        check_row(r)
    by_mode: dict = {}
    for r in rows:
        if r["name"] != "init":
            by_mode.setdefault(r["layout"].split("(")[1].split(")")[0], []).append(r)
    assert sorted(by_mode) == ["loop", "vmap"]
    total = {m: sum(r["calls"] * r["padded_s"] for r in rs) for m, rs in by_mode.items()}
    chosen = {m for m, rs in by_mode.items() if all(r["chosen"] for r in rs)}
    assert len(chosen) == 1 and not any(r["chosen"] for m, rs in by_mode.items() if m not in chosen for r in rs)
    assert total[chosen.pop()] == min(total.values())
    loop, vmap = (next(r for r in by_mode[m] if r["name"].startswith("train step")) for m in ("loop", "vmap"))
    assert loop["calls"] == 3 * vmap["calls"] and vmap["flops"] == 3 * loop["flops"]  # the same work either way


def test_lane_fill_of_a_width_64_layer_is_half():
    """A dense layer of 64 output features fills half of a 128-lane matrix unit; 256 fill it twice over."""
    def fill(width):
        text = jax.jit(lambda x, w: x @ w).lower(jnp.ones((8, 32)), jnp.ones((32, width))).as_text(dialect="hlo")
        dense = tpu_plan.flops.Program(text).flops()[0]
        return dense / tpu_plan.LaneFlops(text, 128).flops()[0]
    assert fill(64) == 0.5 and fill(256) == 1.0 and fill(192) == 0.75


def test_hbm_bytes_of_shapes():
    assert tpu_plan.hbm_bytes("f32[2,3]{1,0:T(8,128)}") == 24
    assert tpu_plan.hbm_bytes("f32[2,3]{1,0:T(8,128)S(1)}") == 0  # on-chip memory, not HBM
    assert tpu_plan.hbm_bytes("(f32[2,3]{1,0}, bf16[4]{0}, s32[])") == 24 + 8 + 4


def test_unknown_topology_is_refused_naming_it():
    with pytest.raises(ValueError, match="topology: 'x9:2x2'"):
        tpu_plan.chip_of("x9:2x2")
