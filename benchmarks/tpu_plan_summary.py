"""The seed papers' runs at their own scale on TPUs, from the plans of ``benchmarks.tpu_plan`` (compile-time
estimates, not measured times): one table of every cell on every topology planned, and one figure.

    python -m benchmarks.tpu_plan_summary runs/tpu_plan/*-paper-*.json [--figure PATH]

Per cell and topology: the seeds' layout the plan chose (``seed_axis='auto'``: vmapped, or looped one seed a call)
and why (the other layout's memory where it does not fit), the training step's HBM a chip, the instructions its
programs execute one after another (``tpu_plan.OpCount``: each a launch latency the roofline does not count, so
where they are many and small the estimate is a lower bound), and the estimated time of the cell's chosen programs (the larger of FLOPs at the layers' lane fill / the chip's peak and HBM bytes / its
bandwidth, by the calls the run makes). Prints the table as Markdown (the benchmarks page's section 10 holds it as
printed) and draws the figure: the estimated hours per cell, one bar per topology, a cell whose every layout is
refused marked as such.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re

#: What each experiment's cells reproduce, for the table's and the figure's labels.
SOURCES = {"cifar_tau": "Zhang et al. (003), CIFAR-10, Table 2", "taki_cifar": "Taki (004), the 100-block CIFAR-10 run",
           "tau_training": "Zhang et al. (003), the FC tau sweep at depth 1000"}


def _hours(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min" if seconds >= 60 \
        else f"{seconds:.3g} s"


def _mode(layout: str) -> str:
    found = re.search(r"\((vmap|loop|unroll)\)", layout or "")
    return found.group(1) if found else "one program"


def cells(plan: dict) -> list[dict]:
    """Every cell of one plan (``benchmarks.tpu_plan``'s JSON): its chosen layout, the training step's HBM a chip,
    the other layout's HBM (or why it does not compile), and the estimated time of its chosen programs."""
    out: dict[str, dict] = {}
    for p in plan["programs"]:
        cell = out.setdefault(p["cell"], {"cell": p["cell"], "seconds": 0.0, "fits": True, "layout": None,
                                          "hbm": math.nan, "other": None, "ops": 0.0})
        train = p["name"].startswith("train")
        if p["chosen"]:
            cell["fits"] &= bool(p["compiled"] and p["fits"])
            cell["seconds"] += p["total_s"] if p["compiled"] else math.inf
            cell["ops"] += p["calls"] * p.get("ops", math.nan)
            if train:
                cell["layout"], cell["hbm"] = _mode(p["layout"]), p["hbm_per_chip"]
        elif train:
            cell["other"] = (f"{_mode(p['layout'])}: {p['hbm_per_chip'] / 2**30:.2f} GiB" if p["compiled"] and p["fits"]
                             else f"{_mode(p['layout'])}: does not fit"
                             + (f" ({m.group(1)} of temporaries)" if (m := re.search(r"temporaries \(([\d.]+G)\)",
                                                                                       p["error"] or "")) else ""))
    for line in plan.get("refusals", []):
        for cell in out.values():
            if cell["cell"] in line:
                cell["fits"], cell["seconds"] = False, math.inf
    return list(out.values())


def _label(plan: dict) -> str:
    """``v4-8 (v4:2x2x1, 8 x TPU v4 TensorCore ...)``: the VM's name where the topology is one."""
    from benchmarks.tpu_plan import VM_TOPOLOGIES

    vm = next((name for name, t in VM_TOPOLOGIES.items() if t == plan["topology"]), None)
    hosts = sorted(plan.get("all_hosts") or {plan["hosts"]})  # the plans merged may differ (planned at other times)
    where = (f"{plan['topology']}, {plan['chips']} x {plan['chip']['name']}, {' or '.join(map(str, hosts))} "
             f"host{'s' * (max(hosts) > 1)}")
    return f"{vm} ({where})" if vm else where


def table(plans: list[dict]) -> str:
    topologies = [_label(p) for p in plans]
    by_cell: dict[str, dict] = {}
    for plan, topology in zip(plans, topologies):
        for c in cells(plan):
            by_cell.setdefault(c["cell"], {})[topology] = c
    lines = ["| cell | topology | seeds' layout | the other layout | train step HBM a chip | ops in sequence | "
             "estimated |", "|---|---|---|---|---|---|---|"]
    for name, per in by_cell.items():
        for topology, c in per.items():
            estimated = _hours(c["seconds"]) if c["fits"] else "**refused**: no layout fits"
            hbm = f"{c['hbm'] / 2**30:.2f} GiB" if math.isfinite(c["hbm"]) else "-"
            ops = f"{c['ops']:.3g}" if math.isfinite(c["ops"]) else "-"
            lines.append(f"| {name} | {topology} | {c['layout'] or '-'} | {c['other'] or '-'} | {hbm} | {ops} | "
                         f"{estimated} |")
    return "\n".join(lines)


def figure(plans: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c["cell"] for plan in plans for c in cells(plan)))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) * max(1, len(plans)) + 1.6))
    height = 0.8 / max(1, len(plans))
    for k, plan in enumerate(plans):
        found = {c["cell"]: c for c in cells(plan)}
        label = _label(plan)
        ys = [i + k * height for i in range(len(names))]
        hours = [found[n]["seconds"] / 3600 if n in found and found[n]["fits"] else 0 for n in names]
        bars = ax.barh(ys, hours, height=height, label=label)
        for y, n, bar in zip(ys, names, bars):
            c = found.get(n)
            note = ("not planned" if c is None else "refused: no layout fits" if not c["fits"]
                    else f"{_hours(c['seconds'])}" + (f", seeds {c['layout']}" if c["layout"] in ("vmap", "loop", "unroll")
                                                       else ", one program of every run"))
            ax.text(bar.get_width() * 1.05 if bar.get_width() else 1e-3, y, note, va="center", fontsize=7)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("estimated hours of the cell on the topology (roofline at the layers' lane fill; log scale)")
    ax.set_title("The seed papers' runs at their own scale on TPUs: compile-time estimates, not measured times\n"
                 + "\n".join(f"{k}: {v}" for k, v in SOURCES.items() if any(n.startswith(k) for n in names)),
                 fontsize=8)
    longest = max((c["seconds"] for plan in plans for c in cells(plan) if c["fits"]), default=3600) / 3600
    ax.set_xlim(right=longest * 12)  # room for the bars' notes
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tpu_plan_summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", nargs="+", help="benchmarks.tpu_plan JSON files (one topology and experiment each)")
    parser.add_argument("--figure", default=None, help="where to draw the figure (PNG)")
    args = parser.parse_args(argv)
    merged: dict[str, dict] = {}
    for name in args.plans:  # one plan per topology: the experiments' programs of each file together
        plan = json.loads(pathlib.Path(name).read_text())
        into = merged.setdefault(plan["topology"], {**plan, "programs": [], "refusals": [], "all_hosts": set()})
        into["all_hosts"].add(plan["hosts"])
        into["programs"] += plan["programs"]
        into["refusals"] += plan.get("refusals", [])
    plans = list(merged.values())
    text = table(plans)
    print(text)
    if args.figure:
        figure(plans, pathlib.Path(args.figure))
        print(f"\nwrote {args.figure}")
    return text


if __name__ == "__main__":
    main()
