"""A grid of depths x widths x seeds run packed (one program) and unpacked (a program per depth and width), in one
sitting.

Run from the project root::

    python -m benchmarks.grid_packing [--quick] [--epochs E] [--scan] [--out runs/benchmarks/grid_packing.json]

The grid: a residual MLP with BatchNorm on MNIST-1D (``experiments.degradation``'s data, batch 64 and optimiser:
SGD at a constant learning rate 0.005, no momentum; ``--learning_rate`` and ``--momentum`` change them) over
depth {2, 8, 16, 32} x width {32, 64} x 3 seeds (quick: depth {2, 8} x width {16, 32} x 2 seeds, 2 epochs; default
10 epochs, ``--epochs``), run packed (``pack=True``: one program), depth-packed
(``pack='depth'``: a program per width) and unpacked (``pack=False``: a program per depth and width). Each is
``fit_grid(trainer, g, pack=...)`` timed from the call to the results on the host, compilation included, on every
device the process has (``benchmarks`` is an entry point: every CPU core is one device, see
``resjax.use_every_cpu_core``; with several programs, they run side by side, one per device, as ``fit_grid`` runs
them). The packed grid goes first, then the depth-packed and the unpacked ones, then the packed one again (the
better of the two packed times is reported; both are in the JSON), so a machine that slows during the sitting does
not favour either. The compilation cache is off (each program compiles in this process). The largest difference
between a packed run's final train loss and its unpacked run's is reported too (they are the same networks:
``resjax.train.packing``), with the run it comes from and the median over the runs: the packed and the unpacked
programs round differently (a width-packed run's matmuls sum over zero-padded units), and training amplifies
that where it is unstable (at learning rate 0.05 with momentum 0.9 the depth-32 runs' losses jump between 4 and
11 in the first epoch, and a first-step difference of 1e-7 grew to 1e-2 in 30 steps). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import resjax

resjax.use_every_cpu_core()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from resjax.data import load_dataset  # noqa: E402
from resjax.train import fit_grid, grid, make_train, run_config, train_config  # noqa: E402


def run(quick: bool, epochs: int | None, scan: bool, learning_rate: float = 0.005, momentum: float = 0.0) -> dict:
    depths, widths, seeds = ([2, 8], [16, 32], 2) if quick else ([2, 8, 16, 32], [32, 64], 3)
    epochs = epochs or (2 if quick else 10)
    data = load_dataset("mnist1d")
    config = run_config(dict(kind="residual_mlp", width=max(widths), num_blocks=max(depths), norm="batch", scan=scan),
                        train_config(batch_size=64, epochs=epochs, learning_rate=learning_rate, momentum=momentum,
                                     schedule="constant"))
    trainer = make_train(config, data)
    g = grid(seeds, {"model.num_blocks": depths, "model.width": widths})
    out = {"grid": {"depths": depths, "widths": widths, "seeds": seeds, "epochs": epochs, "scan": scan,
                    "runs": g.num_runs, "learning_rate": learning_rate, "momentum": momentum},
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "devices": jax.device_count(), "load_1min": os.getloadavg()[0]}}
    results = {}
    for label, pack in (("packed", True), ("depth_packed", "depth"), ("unpacked", False), ("packed_again", True)):
        began = time.perf_counter()
        result = fit_grid(trainer, g, pack=pack, progress=False)
        jax.block_until_ready(jax.tree_util.tree_leaves([p.run for p in result.programs]))
        seconds = time.perf_counter() - began
        results[label] = result
        out[label] = {"seconds": seconds, "programs": len(result.programs)}
        print(f"{label}: {g.num_runs} runs in {len(result.programs)} programs, {seconds:.1f} s", flush=True)
    packed_s = min(out["packed"]["seconds"], out["packed_again"]["seconds"])
    out["speedup"] = out["unpacked"]["seconds"] / packed_s
    out["depth_packed_speedup"] = out["unpacked"]["seconds"] / out["depth_packed"]["seconds"]
    a, b = results["packed"].history["train_loss"][:, -1], results["unpacked"].history["train_loss"][:, -1]
    gaps = np.abs(a - b)
    worst = int(np.nanargmax(gaps))
    out["max_abs_final_train_loss_difference"] = float(gaps[worst])
    out["median_abs_final_train_loss_difference"] = float(np.nanmedian(gaps))
    out["largest_difference_run"] = {k: v for k, v in g.labels()[worst].items()}
    print(f"median |final train loss packed - unpacked| {out['median_abs_final_train_loss_difference']:.2e}; "
          f"largest at {out['largest_difference_run']}")
    print(f"packed {packed_s:.1f} s, depth packed {out['depth_packed']['seconds']:.1f} s, unpacked "
          f"{out['unpacked']['seconds']:.1f} s: {out['speedup']:.2f}x and {out['depth_packed_speedup']:.2f}x; "
          f"largest |final train loss packed - unpacked| {out['max_abs_final_train_loss_difference']:.2e}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--scan", action="store_true", help="the blocks as one nn.scan (default: unrolled)")
    parser.add_argument("--learning_rate", type=float, default=0.005)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--out", default="runs/benchmarks/grid_packing.json")
    args = parser.parse_args(argv)
    out = run(args.quick, args.epochs, args.scan, args.learning_rate, args.momentum)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
