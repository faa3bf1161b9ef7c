"""How the host feeder lays several seeds out on a TPU (``ImageTrainer.laid_out``, run by ``fit`` before its first
step on a chip): the vmapped and the looped seeds compiled for one v5e chip (libtpu, no TPU), the cheaper layout
that fits taken, and a program that fits in no layout refused before training with the setting to change. The
rule itself (``resjax.train.planning.choose_layout``) and the compiler's out-of-memory message are checked on
the CPU."""

from __future__ import annotations

import math

import pytest

from resjax.train import planning
from tests.tpu import programs


def test_the_rule_takes_the_cheapest_layout_that_fits_and_refuses_when_none_does():
    cost = planning.LayoutCost
    costs = {"vmap": cost(10e9, 16e9, 0.004), "loop": cost(2e9, 16e9, 0.001, calls=8)}
    assert planning.choose_layout(costs) == "vmap"  # 4 ms a step against 8 x 1 ms
    costs["vmap"] = cost(20e9, 16e9, 0.004)  # no longer fits: the slower layout that fits
    assert planning.choose_layout(costs) == "loop"
    costs["loop"] = cost(17e9, 16e9, 0.001, calls=8)
    with pytest.raises(planning.NoLayoutFits, match=r"the step does not fit .*\(in no layout: vmap needs 18.63 GiB, "
                                                    r"loop needs 15.83 GiB\): lower train.batch_size"):
        planning.choose_layout(costs, "the step", "lower train.batch_size")


def test_the_compilers_out_of_memory_refusal_is_read_for_its_sizes():
    new = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
                       "(80.00G) exceeds available HBM (15.75G).")
    assert planning.out_of_memory(new) == (80 * 2**30, 15.75 * 2**30)
    assert planning.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Used 27.85G of 15.75G hbm.")) == (
        27.85 * 2**30, 15.75 * 2**30)
    assert planning.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: something else")) == (math.inf, 0.0)
    assert planning.out_of_memory(ValueError("a shape error")) is None
    err = ValueError("a shape error")
    assert planning.refused(err, "x", "y") is err  # not memory: raised as it is
    said = planning.refused(new, "the run", "train fewer runs a call")
    assert isinstance(said, planning.NoLayoutFits) and "needs 80.00 GiB, the device has 15.75 GiB" in str(said)


@pytest.fixture(scope="module")
def cases():
    return {r["case"]: r for r in programs("layout")}


def test_vmapped_seeds_are_taken_where_they_fit_and_cost_less(cases):
    small = cases["small"]
    vmap, loop = small["costs"]["vmap"], small["costs"]["loop"]
    assert vmap["fits"] and loop["fits"] and loop["calls"] == 8  # the looped program runs once per seed
    # looped, the other 7 seeds' states wait in HBM beside the one stepped: counted in what the layout needs
    assert loop["needed"] == small["loop_alone"] + 7 * small["state_bytes"]
    assert small["mode"] == min(("vmap", "loop"), key=lambda m: small["costs"][m]["step_seconds"]) == "vmap"
    (line,) = small["said"]
    assert line.startswith("seed_axis='auto': 8 seeds vmapped on TPU v5 lite (vmap: ") and "loop: " in line


def test_seeds_are_looped_when_vmapped_they_do_not_fit_the_chip(cases):
    big = cases["vmap too large"]
    vmap, loop = big["costs"]["vmap"], big["costs"]["loop"]
    assert not vmap["fits"] and vmap["needed"] > vmap["limit"]  # the compiler refused it, saying what it needs
    assert loop["fits"] and big["mode"] == "loop" and "does not fit" in big["said"][0]
    # the looped layout holds the other 7 seeds' states beside the one it steps: more than one seed's program
    assert loop["needed"] > cases["small"]["costs"]["loop"]["needed"]


def test_an_evaluation_batch_over_the_chips_memory_is_refused_naming_its_setting(cases):
    refused = cases["eval too large"]["refused"]
    assert refused.startswith("the evaluation step (batch 4194304, 8 seeds vmapped) does not fit the device's "
                              "15.75 GiB of memory (it needs ")
    assert ": lower train.eval_batch_size" in refused
