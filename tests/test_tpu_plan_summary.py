"""``benchmarks.tpu_plan_summary``: a cell's chosen layout, the other layout's reason, and a cell no layout fits,
read from a plan's JSON as ``benchmarks.tpu_plan`` writes it (no libtpu needed)."""

from __future__ import annotations

import math

from benchmarks.tpu_plan_summary import cells, table


def _program(cell, name, layout, chosen, compiled=True, hbm=2**30, total=60.0, error=None, calls=10, ops=100):
    return {"cell": cell, "name": name, "layout": layout, "chosen": chosen, "compiled": compiled, "fits": compiled,
            "hbm_per_chip": hbm if compiled else math.nan, "total_s": total if compiled else math.nan,
            "error": error, "calls": calls, "ops": ops}


PLAN = {"topology": "v5e:2x4", "chips": 8, "hosts": 1, "chip": {"name": "TPU v5e"}, "refusals": [
    "deep: the training step (5 seeds, batch 128) fits in no layout"], "programs": [
    _program("wide", "train step", "5 seeds (vmap), batch 128", False, compiled=False,
             error="JaxRuntimeError: RESOURCE_EXHAUSTED: ... HLO temporaries (27.85G) exceeds available HBM (15.75G)."),
    _program("wide", "eval step", "5 seeds (vmap)", False),
    _program("wide", "train step (x 5 seeds)", "5 seeds (loop), batch 128", True, hbm=7 * 2**30, total=3600.0),
    _program("wide", "eval step (x 5 seeds)", "5 seeds (loop)", True, total=36.0),
    _program("deep", "train step", "5 seeds (vmap), batch 128", True, compiled=False, error="RESOURCE_EXHAUSTED"),
]}


def test_a_cell_reads_its_chosen_layout_the_others_reason_and_a_refusal():
    wide, deep = cells(PLAN)
    assert (wide["layout"], wide["seconds"], wide["fits"], wide["ops"]) == ("loop", 3636.0, True, 2000)
    assert wide["other"] == "vmap: does not fit (27.85G of temporaries)" and wide["hbm"] == 7 * 2**30
    assert not deep["fits"] and deep["seconds"] == math.inf
    text = table([PLAN])
    assert "| wide | v5e-8 (v5e:2x4, 8 x TPU v5e, 1 host) | loop | vmap: does not fit (27.85G of temporaries) | " \
           "7.00 GiB | 2e+03 | 1.01 h |" in text
    assert "| deep | v5e-8 (v5e:2x4, 8 x TPU v5e, 1 host) | vmap | - | - | " in text and "**refused**" in text
