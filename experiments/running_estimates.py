"""Running estimates over training: lag against noise at two update rates rho (lecture 000, "Running
estimates", "Running estimates over training", "Reading the running estimates").

Settings the lecture states: a synthetic unit whose true activation mean drifts from 0 to 2 between
steps 100 and 500; the batch mean at each step is the true mean plus noise of standard deviation 0.3;
running estimates start at 0; two values of rho; each step ``m <- (1 - rho) m + rho m_batch``.

Choices where the lecture is silent, fixed before any number was looked at:

- rho = 0.1 and 0.01, an order of magnitude apart: 0.1 is PyTorch's default (``momentum=0.1``) and
  resjax's BatchNorm default (flax ``momentum=0.9``); 0.01 is flax's own default (``momentum=0.99``),
  so the two curves are what a user of each framework gets by default. (PyTorch's momentum is rho;
  flax's momentum is 1 - rho; neither is optimiser momentum.)
- the update is ``resjax.analysis.batchnorm.running_update``, written as flax's BatchNorm updates its
  ``batch_stats`` (``momentum * m + (1 - momentum) * m_batch``); as a check the same run is driven
  through resjax's BatchNorm layer itself (``make_norm('batch', rho=...)`` in training mode, fed at
  each step a batch of two values whose mean is that step's batch mean) and the stored ``mean`` is
  compared (``max_abs_diff.layer_vs_update``).
- 800 steps (300 after the drift ends, enough for the slow estimate to catch up: its time constant
  is about 1/rho = 100 steps); the drift is linear (slope 2/400 = 0.005 per step); steps are numbered
  1..800 and the true mean at step t is 0 until t = 100, 2 (t - 100) / 400 until t = 500, then 2.
- noise: i.i.d. N(0, 0.3^2) per step, ``jax.random.key(seed)``, seed 0 fixed before any run; the
  figure shows that one run. Beyond the lecture, 1,000 independent runs (vmapped) give the noise
  statistics.

Lag and noise (exact split, the update being linear; ``lag_and_noise``): lag = true mean - the
estimate of the noise-free true mean; noise = the estimate of the noise alone (from 0).

Metrics, for ``fast`` (the larger rho) and ``slow``: ``rho.{fast,slow}``, ``flax_momentum.*``,
``lag.*.at_drift_end`` (true - estimate at step 500, noise-free), ``lag.*.steps_at_drift_end`` (that
gap divided by the slope: how many steps the estimate trails by), ``lag.*.theory_steps`` ((1 - rho)/rho,
the settled lag on a long ramp), ``lag.*.mean_abs_drift`` (mean |lag| over steps 101..500),
``lag.*.settle_steps`` (steps after 500 until |lag| < ``settle_tol`` = 0.05),
``noise.*.std`` (standard deviation over the 1,000 runs of the noise part, root-mean-square over steps
``noise_from``..800 with ``noise_from`` = 200), ``noise.*.std_one_run`` (over those steps of the
figure's run), ``noise.*.theory`` (0.3 sqrt(rho / (2 - rho))), ``rmse.*`` (estimate - true over all
steps, the figure's run), ``max_abs_diff.layer_vs_update``, and the curves ``curves.*``.

Claims (the lecture's qualitative reading, as inequalities): the larger rho lags less and is noisier.
``--quick``: 100 runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis import batchnorm as bn

NAME = "running_estimates"
WHICH = ("fast", "slow")


HELP = {
    "num_steps": "training steps simulated (the true mean drifts between drift_start and drift_end)",
    "drift_start": "step at which the true activation mean starts to drift",
    "drift_end": "step at which the drift ends (the mean stays at mean_end after it)",
    "mean_start": "the true mean before the drift",
    "mean_end": "the true mean after the drift",
    "noise_std": "standard deviation of the batch mean's noise around the true mean, per step",
    "rhos": "the update rates rho compared, e.g. \"(0.1, 0.01)\" (PyTorch's momentum; flax's is 1 - rho)",
    "init": "the running estimate's starting value",
    "num_runs": "independent noisy runs for the noise statistics",
    "noise_from": "first step of the noise statistics (after the estimates have settled)",
    "settle_tol": "|lag| below which an estimate counts as settled after the drift",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_steps = 800
    c.drift_start = 100
    c.drift_end = 500
    c.mean_start = 0.0
    c.mean_end = 2.0
    c.noise_std = 0.3
    c.rhos = (0.1, 0.01)
    c.init = 0.0
    c.num_runs = 1000
    c.noise_from = 200
    c.settle_tol = 0.05
    c.seed = 0
    if size == "quick":
        c.num_runs = 100
    elif size == "full":
        c.num_runs = 10000
    return c


def layer_trace(batch_means, rho, init) -> jnp.ndarray:
    """The stored ``mean`` of resjax's BatchNorm layer (training mode) fed, at step t, the batch
    ``[m_t - 1, m_t + 1]`` whose mean is ``m_t``."""

    def step(stats, m):
        x = jnp.stack([m - 1.0, m + 1.0])[:, None]
        _, stats = bn.apply_norm("batch", x, train=True, batch_stats=stats, rho=rho)
        return stats, stats["mean"][0]

    init_stats = {"mean": jnp.full((1,), init, jnp.float32), "var": jnp.ones((1,), jnp.float32)}
    return jax.lax.scan(step, init_stats, jnp.asarray(batch_means, jnp.float32))[1]


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): two update rates in (0, 1], step settings inside the run."""
    if len(config.rhos) != 2:
        raise ValueError(f"rhos: two update rates, got {config.rhos!r}")
    bn.check_rho(np.asarray(config.rhos))
    if config.noise_std < 0:
        raise ValueError(f"noise_std: must be >= 0, got {config.noise_std}")
    if not 1 <= config.noise_from < config.num_steps:
        raise ValueError(f"noise_from: must lie in [1, num_steps), got {config.noise_from}")
    if config.num_runs < 2:
        raise ValueError(f"num_runs: must be >= 2, got {config.num_runs}")
    if config.drift_end > config.num_steps:
        raise ValueError(f"drift_end: must be <= num_steps ({config.num_steps}), got {config.drift_end}")


def run(config, out_dir) -> dict:
    check(config)
    true = bn.drifting_mean(config.num_steps, config.drift_start, config.drift_end, config.mean_start,
                            config.mean_end).astype(np.float32)
    slope = (config.mean_end - config.mean_start) / (config.drift_end - config.drift_start)
    noise = config.noise_std * jax.random.normal(jax.random.key(config.seed), (config.num_runs, config.num_steps))
    batch = true + noise  # run 0 is the figure's
    rhos = dict(zip(WHICH, sorted((float(r) for r in config.rhos), reverse=True)))
    t = np.arange(1, config.num_steps + 1)
    end = config.drift_end - 1  # index of step drift_end
    out: dict = {"curves.step": t, "curves.true": true, "curves.batch_mean": np.asarray(batch[0])}
    for w, rho in rhos.items():
        split = jax.jit(jax.vmap(lambda b: bn.lag_and_noise(true, b, rho, config.init)))(batch)
        split = {k: np.asarray(v) for k, v in split.items()}
        lag, nz = split["lag"][0], split["noise"]
        after = np.nonzero(np.abs(lag[end:]) < config.settle_tol)[0]
        window = slice(config.noise_from - 1, None)
        layer = np.asarray(jax.jit(lambda b: layer_trace(b, rho, config.init))(batch[0]))
        out.update({
            f"rho.{w}": rho, f"flax_momentum.{w}": float(bn.flax_from_rho(rho)),
            f"lag.{w}.at_drift_end": float(lag[end]),
            f"lag.{w}.steps_at_drift_end": float(lag[end] / slope),
            f"lag.{w}.theory_steps": float(bn.lag_steps(rho)),
            f"lag.{w}.mean_abs_drift": float(np.mean(np.abs(lag[config.drift_start:config.drift_end]))),
            f"lag.{w}.settle_steps": int(after[0]) if after.size else None,
            f"noise.{w}.std": float(np.sqrt(np.mean(np.var(nz[:, window], axis=0)))),
            f"noise.{w}.std_one_run": float(np.std(nz[0, window])),
            f"noise.{w}.theory": float(bn.noise_std(rho, config.noise_std)),
            f"rmse.{w}": float(np.sqrt(np.mean(split["error"][0] ** 2))),
            f"max_abs_diff.layer_vs_update.{w}": float(np.max(np.abs(layer - split["estimate"][0]))),
            f"curves.estimate.{w}": split["estimate"][0], f"curves.lag.{w}": lag,
            f"curves.noise_std.{w}": np.std(nz, axis=0),
        })
    plot(out, config, rhos, out_dir / f"{NAME}.png")
    return out


# ---- claims ------------------------------------------------------------------------------------------

SRC = "000 lecture, Reading the running estimates"

CLAIMS = [
    common.Claim("a larger rho follows changing statistics more quickly: less lag at the end of the drift "
                 "(rho 0.1 against 0.01)", SRC, "qualitative",
                 lambda m: f"{m['lag.fast.steps_at_drift_end']:.1f} steps vs {m['lag.slow.steps_at_drift_end']:.1f} "
                           f"(theory on a long ramp {m['lag.fast.theory_steps']:.0f} vs {m['lag.slow.theory_steps']:.0f})",
                 lambda m: bool(m["lag.fast.at_drift_end"] < m["lag.slow.at_drift_end"])),
    common.Claim("... but the estimate is noisier (batch-mean noise sd 0.3)", SRC, "qualitative",
                 lambda m: f"noise sd {m['noise.fast.std']:.3f} vs {m['noise.slow.std']:.3f} (theory "
                           f"{m['noise.fast.theory']:.3f} vs {m['noise.slow.theory']:.3f})",
                 lambda m: bool(m["noise.fast.std"] > m["noise.slow.std"])),
    common.Claim("the update m <- (1 - rho) m + rho m_batch is what resjax's BatchNorm layer stores "
                 "(flax momentum = 1 - rho)", "000 lecture, Running estimates", "same update",
                 lambda m: f"max |layer - update| = {max(m['max_abs_diff.layer_vs_update.fast'], m['max_abs_diff.layer_vs_update.slow']):.2g}",
                 lambda m: bool(max(m["max_abs_diff.layer_vs_update.fast"], m["max_abs_diff.layer_vs_update.slow"]) <= 1e-4)),
]


def report_section(m: dict) -> str:
    lines = ["| rho (flax momentum) | lag at step 500 | lag (steps) [theory] | steps to settle after 500 | "
             "noise sd [theory] | RMS error, one run |", "|---|---|---|---|---|---|"]
    for w in WHICH:
        lines.append(f"| {m[f'rho.{w}']:g} ({m[f'flax_momentum.{w}']:g}) | {m[f'lag.{w}.at_drift_end']:.3f} | "
                     f"{m[f'lag.{w}.steps_at_drift_end']:.1f} [{m[f'lag.{w}.theory_steps']:.0f}] | "
                     f"{m[f'lag.{w}.settle_steps']} | {m[f'noise.{w}.std']:.4f} [{m[f'noise.{w}.theory']:.4f}] | "
                     f"{m[f'rmse.{w}']:.3f} |")
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, rhos, path) -> None:
    plt = common.pyplot()

    colours = {"fast": "tab:orange", "slow": "tab:blue"}
    t = np.asarray(m["curves.step"])
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.2), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    ax.scatter(t, m["curves.batch_mean"], s=3, color="grey", alpha=0.5,
               label=f"batch mean (true + N(0, {config.noise_std:g}^2))")
    ax.plot(t, m["curves.true"], "k:", lw=2, label="true mean")
    for w, rho in rhos.items():
        ax.plot(t, m[f"curves.estimate.{w}"], color=colours[w], lw=2,
                label=f"running estimate, rho = {rho:g} (PyTorch momentum {rho:g}; flax momentum {1 - rho:g})")
    ax.set_xlabel("training step")
    ax.set_ylabel("activation mean of the unit (unitless)")
    ax.set_title("Running estimates over training (lecture, seed 000, fig. 'Running estimates over training')\n"
                 f"true mean {config.mean_start:g} -> {config.mean_end:g} over steps {config.drift_start}-"
                 f"{config.drift_end}; estimates start at {config.init:g}; m <- (1 - rho) m + rho m_batch", fontsize=9)
    common.legend_outside(ax, ncol=1)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for w, rho in rhos.items():
        ax.plot(t, m[f"curves.lag.{w}"], color=colours[w], lw=2, label=f"lag, rho = {rho:g}")
        ax.plot(t, m[f"curves.noise_std.{w}"], color=colours[w], lw=1.2, ls="--",
                label=f"noise sd over {config.num_runs:,} runs, rho = {rho:g}")
    ax.axvspan(config.drift_start, config.drift_end, color="grey", alpha=0.1,
               label=f"drift (steps {config.drift_start}-{config.drift_end})")
    ax.set_xlabel("training step")
    ax.set_ylabel("true - estimate of the noise-free mean (lag);\nsd of the estimate's noise part (unitless)")
    ax.set_title("Beyond the lecture: the estimate's error split exactly into lag and noise", fontsize=9)
    common.legend_outside(ax)
    ax.grid(alpha=0.3)
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
