"""Forward and backward stability at initialisation against tau and depth (Zhang et al., seed 003,
Section 3: Theorems 1-3 and the gradient bound; the paper states these as theorems, without a figure).

The papers' fully connected ResNet (``resjax.nn.tau_resnet``, kind ``'tau'``: h_0 = relu(A x),
h_l = relu(h_(l-1) + tau W_l h_(l-1)), y = B h_L, Gaussian A, W_l at variance 2/m, B at 1/d, no biases),
width m = 128, depths L = 10, 100, 1000 (L blocks), tau in {1, L^(-1/4), L^(-1/2), L^(-1)}, 20 weight
draws, vmapped. For every draw and each of 16 fixed MNIST-1D training inputs:

- forward: |h_l| / |h_0| for every block l (the seed's theorems bound each block output of a unit-norm
  h_0), tracked in log space by ``resjax.analysis.stability.log_space_propagation`` (the module's own
  block applied to the renormalised stream; exact because the block is positively homogeneous), so
  tau = 1 at depth 1000 gives a finite log ratio where float32 overflows;
- backward: |grad_(W_l) F| for every block, F = <v, y> with v a fixed random unit vector per input
  (the seed's per-sample gradient ``tau D_l dh_l h_(l-1)^T`` for an output cotangent of unit size; a
  linear read-out rather than the cross-entropy, whose output cotangent saturates when y overflows),
  also in log space; and the total |grad_W F| = sqrt(sum_l |grad_(W_l) F|^2) over all blocks.

The feedforward (plain) network is measured the same way with the *same* A, W_l and B draws
(``plain_params_from_residual``: common random numbers), h_l = relu(W_l h_(l-1)).

Settings the seed leaves open, and what is used: the inputs (16 MNIST-1D training examples; the seed
assumes |x| = 1, irrelevant here since every quantity is a ratio or the network is homogeneous in x);
the read-out v (uniform on the unit sphere, one per input, shared by all models); 20 draws and 16
inputs, medians over both. The L blocks are l = 1..L (``seed_indexing=False``; see
``resjax.nn.tau_resnet``). All taus of one depth reuse the same draws (tau is a traced call argument),
so one compiled program per depth serves every tau.

Metrics (<tau> in ``1``, ``L^-1/4``, ``L^-1/2``, ``L^-1``; ``plain`` for the feedforward network):
``log10_forward_norm_ratio.<tau>.L<d>`` (median over draws and inputs of log10 |h_L| / |h_0|, the last
block), ``forward_norm_ratio.<tau>.L<d>`` (10 to that power; ``inf``, written as JSON null, where it
exceeds float32's range), ``log10_max_forward_norm_ratio.<tau>.L<d>`` (median of max_l),
``median_grad_norm.<tau>.L<d>`` (median over blocks, draws and inputs of |grad_(W_l) F|) and its log10
``log10_median_grad_norm``, ``total_grad_norm.<tau>.L<d>`` (median over draws and inputs) and its log10,
``grad_ratio_to_plain_over_tau.<tau>.L<d>`` = median_grad_norm(tau) / median_grad_norm(plain) / tau
(the seed: "the gradient of residual layers could be tau times smaller than the usual feedforward
layer"), per-depth curves ``curves.<tau>.L<d>.{log10_ratio,log10_grad}`` (median over draws and inputs,
l = 0..L and l = 1..L), and ``seconds.L<d>`` (wall time of the depth: initialisation, compilation and
every tau; ``seconds_depth_1000`` repeats the deepest).

A note on "the gradient norms do not depend on depth": the seed's Theorem 2 makes each |grad_(W_l) F|
about tau times a depth-independent size, so with tau = L^(-1/2) the per-block norm falls like L^(-1/2);
what is depth-independent is the norm over all blocks (L blocks of size L^(-1/2)), "the norm of all
layer gradient" in the seed's words. The claims test that total norm, and the per-block norm against
tau times the plain network's.

``--quick`` (tests): width 16, depth 4, 4 draws, 4 inputs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis.stability import log_space_propagation
from resjax.data import load_dataset
from resjax.nn.tau_mlp import plain_params_from_residual, tau_resnet

NAME = "tau_stability"
TAUS = {"1": lambda L: 1.0, "L^-1/4": lambda L: L ** -0.25, "L^-1/2": lambda L: L ** -0.5, "L^-1": lambda L: 1.0 / L}
COLOURS = {"1": "tab:red", "L^-1/4": "tab:orange", "L^-1/2": "tab:green", "L^-1": "tab:blue", "plain": "black"}
LN10 = float(np.log(10.0))
F32_LOG10_MAX = float(np.log10(np.finfo(np.float32).max))


HELP = {
    "width": "width m of the networks (units per block)",
    "depths": "depths L measured (blocks), e.g. \"(10, 100, 1000)\"; a leading + adds depths (+300)",
    "taus": "the branch scales tau, comma-separated rules of L: 1, L^-1/4, L^-1/2, L^-1",
    "num_draws": "random weight draws per depth (medians are over draws and inputs)",
    "num_inputs": "MNIST-1D training inputs propagated per draw",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.width = 128
    c.depths = (10, 100, 1000)
    c.taus = tuple(TAUS)
    c.num_draws = 20
    c.num_inputs = 16
    c.seed = 0
    if size == "quick":
        c.width, c.depths, c.num_draws, c.num_inputs = 16, (4,), 4, 4
    elif size == "full":
        c.num_draws, c.num_inputs = 100, 64
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    for t in config.taus:
        if t not in TAUS:
            raise ValueError(f"taus: unknown tau {t!r}; choose from {tuple(TAUS)}")
    for d in config.depths:
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"depths: every depth must be an integer >= 1, got {d!r}")
    for name in ("width", "num_draws", "num_inputs"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {config[name]!r}")


def _summaries(prefix: str, out: dict, m: dict, tau: float | None) -> None:
    """Medians of one model's log-space measurements (log_ratio (D, L+1, B), log_grad (D, L, B), total (D, B))."""
    log10_ratio = np.asarray(out["log_ratio"], np.float64) / LN10
    log10_grad = np.asarray(out["log_grad_norm"], np.float64) / LN10
    log10_total = np.asarray(out["log_total_grad_norm"], np.float64) / LN10
    name, depth = prefix.split("|")
    final = float(np.median(log10_ratio[:, -1, :]))
    m[f"log10_forward_norm_ratio.{name}.L{depth}"] = final
    m[f"forward_norm_ratio.{name}.L{depth}"] = 10.0 ** final if final < F32_LOG10_MAX else float("inf")
    m[f"log10_max_forward_norm_ratio.{name}.L{depth}"] = float(np.median(log10_ratio.max(axis=1)))
    g = float(np.median(log10_grad))
    m[f"log10_median_grad_norm.{name}.L{depth}"] = g
    m[f"median_grad_norm.{name}.L{depth}"] = 10.0 ** g if g < 300 else float("inf")
    t = float(np.median(log10_total))
    m[f"log10_total_grad_norm.{name}.L{depth}"] = t
    m[f"total_grad_norm.{name}.L{depth}"] = 10.0 ** t if t < 300 else float("inf")
    if tau is not None:
        m[f"tau.{name}.L{depth}"] = tau
    # median over draws and inputs at every depth
    m[f"curves.{name}.L{depth}.log10_ratio"] = np.median(log10_ratio.transpose(1, 0, 2).reshape(log10_ratio.shape[1], -1), axis=1)
    m[f"curves.{name}.L{depth}.log10_grad"] = np.median(log10_grad.transpose(1, 0, 2).reshape(log10_grad.shape[1], -1), axis=1)


def measure_depth(config, depth: int, x, v, key) -> dict:
    """Every tau and the plain network at one depth: one initialisation (vmapped draws), one program per model."""
    m: dict = {}
    start = time.time()
    res = tau_resnet("tau", config.width, depth, int(v.shape[-1]), tau=1.0)
    plain = tau_resnet("plain", config.width, depth, int(v.shape[-1]))
    keys = jax.random.split(key, config.num_draws)
    params = jax.jit(jax.vmap(lambda k: res.init(k, x)["params"]))(keys)

    def measure_res(p, tau):
        o = log_space_propagation(res, {"params": p}, x, cotangent=v, tau=tau)
        return {k: o[k] for k in ("log_ratio", "log_grad_norm", "log_total_grad_norm")}

    def measure_plain(p):
        o = log_space_propagation(plain, {"params": plain_params_from_residual(p)}, x, cotangent=v)
        return {k: o[k] for k in ("log_ratio", "log_grad_norm", "log_total_grad_norm")}

    run_res = jax.jit(jax.vmap(measure_res, in_axes=(0, None)))
    for name in config.taus:
        tau = TAUS[name](depth)
        out = jax.device_get(run_res(params, jnp.float32(tau)))
        _summaries(f"{name}|{depth}", out, m, tau)
    out = jax.device_get(jax.jit(jax.vmap(measure_plain))(params))
    _summaries(f"plain|{depth}", out, m, None)
    for name in config.taus:
        ratio = m[f"log10_median_grad_norm.{name}.L{depth}"] - m[f"log10_median_grad_norm.plain.L{depth}"]
        m[f"grad_ratio_to_plain_over_tau.{name}.L{depth}"] = 10.0 ** ratio / m[f"tau.{name}.L{depth}"]
    m[f"seconds.L{depth}"] = round(time.time() - start, 2)
    return m


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    x = jnp.asarray(data.x_train[: config.num_inputs])
    key = jax.random.key(config.seed)
    k_v, k_w = jax.random.split(key)
    v = jax.random.normal(k_v, (config.num_inputs, data.num_classes))
    v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    m: dict = {}
    for i, depth in enumerate(config.depths):
        m.update(measure_depth(config, depth, x, v, jax.random.fold_in(k_w, i)))
    m["seconds_depth_1000" if max(config.depths) == 1000 else f"seconds_deepest.L{max(config.depths)}"] = \
        m[f"seconds.L{max(config.depths)}"]
    plot(m, config, out_dir / f"{NAME}.png")
    return m


# ---- claims ----------------------------------------------------------------------------------------


def _depths(m: dict) -> list[int]:
    return sorted(int(k.rsplit(".L", 1)[1]) for k in m if k.startswith("log10_forward_norm_ratio.L^-1/2."))


def _ratios(m: dict, tau: str) -> dict[int, float]:
    return {d: 10.0 ** m[f"log10_forward_norm_ratio.{tau}.L{d}"] for d in _depths(m)}


def _fmt_by_depth(values: dict, fmt: str = ".3g") -> str:
    return ", ".join(f"L={d}: {v:{fmt}}" for d, v in values.items())


def _total(m: dict, tau: str) -> dict[int, float]:
    return {d: 10.0 ** m[f"log10_total_grad_norm.{tau}.L{d}"] for d in _depths(m)}


def _spread(values: dict) -> float:
    v = list(values.values())
    return max(v) / min(v)


def _grad_vs_plain(m: dict, tau: str) -> dict[int, float]:
    return {d: m[f"grad_ratio_to_plain_over_tau.{tau}.L{d}"] for d in _depths(m)}


SRC = "003 Zhang et al., Section 3 (Theorems 1-3, gradient bound)"
CLAIMS = [
    common.Claim("tau = L^(-1/2): the median block-output norm ratio |h_L|/|h_0| stays in a constant band "
                 "[1/4, 4] at every depth (Theorems 1 and 2)", SRC, "bounded by (1+c)/(1-eps), any L",
                 lambda m: _fmt_by_depth(_ratios(m, "L^-1/2")),
                 lambda m: all(0.25 <= r <= 4 for r in _ratios(m, "L^-1/2").values())),
    common.Claim("tau = L^(-1/2): the ratio at the largest depth is within 1.5x of the ratio at the smallest",
                 SRC, "depth-independent",
                 lambda m: f"{_ratios(m, 'L^-1/2')[_depths(m)[-1]] / _ratios(m, 'L^-1/2')[_depths(m)[0]]:.3g}x",
                 lambda m: 1 / 1.5 <= _ratios(m, "L^-1/2")[_depths(m)[-1]] / _ratios(m, "L^-1/2")[_depths(m)[0]] <= 1.5),
    common.Claim("tau = L^(-1/4) (slightly larger than L^(-1/2)): the ratio grows with depth and exceeds 10 at "
                 "depth 100 (Theorem 3)", SRC, "grows without bound",
                 lambda m: _fmt_by_depth(_ratios(m, "L^-1/4")),
                 lambda m: (all(a < b for a, b in zip(list(_ratios(m, "L^-1/4").values()),
                                                       list(_ratios(m, "L^-1/4").values())[1:]))
                            and _ratios(m, "L^-1/4").get(100, np.inf) > 10)),
    common.Claim("tau = L^(-1/2): the gradient norm over all blocks, sqrt(sum_l |grad W_l|^2), does not depend on "
                 "depth (within 1.5x across L)", SRC, "independent of depth",
                 lambda m: f"{_fmt_by_depth(_total(m, 'L^-1/2'))} (spread {_spread(_total(m, 'L^-1/2')):.2f}x)",
                 lambda m: _spread(_total(m, "L^-1/2")) <= 1.5),
    common.Claim("tau = L^(-1/2): each block's gradient is about tau times the feedforward network's "
                 "(median |grad W_l| ratio / tau within [1/4, 4] at every depth)", SRC, "tau times smaller",
                 lambda m: _fmt_by_depth(_grad_vs_plain(m, "L^-1/2")),
                 lambda m: all(0.25 <= r <= 4 for r in _grad_vs_plain(m, "L^-1/2").values())),
    common.Claim("depth 1000: initialisation, compilation and the measurement of every tau and the plain network "
                 "take under a minute on a CPU (seconds)", "issue 5", "< 60",
                 lambda m: m.get("seconds_depth_1000", float("nan")),
                 lambda m: bool(m["seconds_depth_1000"] < 60) if "seconds_depth_1000" in m else None),
]


#: The settings the claims' texts state (depths 10-1000, 20 draws x 16 inputs): the report names this run's where they differ.
CLAIM_SETTINGS = ("depths", "width", "num_draws", "num_inputs", "taus")


def report_section(m: dict) -> str:
    depths = _depths(m)
    taus = [t for t in TAUS if f"log10_forward_norm_ratio.{t}.L{depths[0]}" in m] + ["plain"]
    lines = ["log10 of the median |h_L|/|h_0| / median per-block |grad W_l| / median total |grad W| "
             "(20 draws x 16 inputs):", "",
             "| tau | " + " | ".join(f"L={d}" for d in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for t in taus:
        cells = [f"{m[f'log10_forward_norm_ratio.{t}.L{d}']:.2f} / {m[f'log10_median_grad_norm.{t}.L{d}']:.2f} / "
                 f"{m[f'log10_total_grad_norm.{t}.L{d}']:.2f}" for d in depths]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", "Wall time per depth (s): " + ", ".join(f"L={d}: {m[f'seconds.L{d}']}" for d in depths)]
    return "\n".join(lines)


# ---- figure ----------------------------------------------------------------------------------------


def _label(name: str, depth: int) -> str:
    """``'tau = L^-1/2 = 0.316'`` (the rule and its value at this depth), ``'tau = 1'``, ``'plain (no skip)'``."""
    if name == "plain":
        return "plain (no skip)"
    value = f"{TAUS[name](depth):.3g}"
    return f"tau = {name}" if value == name else f"tau = {name} = {value}"


def _fit(ax, values, lim: tuple[float, float], pad: float = 0.06) -> tuple[float, float]:
    """Set ``ax``'s y-limits to the range of ``values`` (finite ones), within ``lim``: the axis fits the data, and
    only a curve that leaves ``lim`` is cut (its label says where it ends)."""
    v = np.concatenate([np.ravel(np.asarray(x, float)) for x in values]) if len(values) else np.zeros(0)
    v = v[np.isfinite(v)]
    if not v.size:
        return lim
    lo, hi = max(v.min(), lim[0]), min(v.max(), lim[1])
    span = max(hi - lo, 1e-3)
    lo, hi = lo - pad * span, hi + pad * span
    ax.set_ylim(lo, hi)
    return lo, hi


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    depths = list(config.depths)
    names = list(config.taus) + ["plain"]
    summary = len(depths) > 1  # the against-depth panels need two depths or more
    if summary:  # rows: forward and backward per depth, then 3 panels against depth (a grid both rows divide)
        fig = plt.figure(figsize=(max(5.2 * len(depths), 15), 16.5))
        grid = fig.add_gridspec(3, len(depths) * 3)
        panels = [(grid[0, 3 * j:3 * j + 3], grid[1, 3 * j:3 * j + 3]) for j in range(len(depths))]
    else:  # one depth: its forward and backward panels side by side
        fig = plt.figure(figsize=(13, 6.2))
        grid = fig.add_gridspec(1, 2)
        panels = [(grid[0, 0], grid[0, 1])]
    lim = (-5.0, 5.0)  # the per-depth panels zoom on the stable range; curves that leave it say where they end
    for d, (cell_f, cell_g) in zip(depths, panels):
        ax_f, ax_g = fig.add_subplot(cell_f), fig.add_subplot(cell_g)
        curves = {name: (np.asarray(m[f"curves.{name}.L{d}.log10_ratio"]), np.asarray(m[f"curves.{name}.L{d}.log10_grad"]))
                  for name in names}
        band = (np.log10(0.25), np.log10(4))
        lo_f, hi_f = _fit(ax_f, [*[r for r, _ in curves.values()], band], lim)
        lo_g, hi_g = _fit(ax_g, [g for _, g in curves.values()], lim)
        for name, (r, g) in curves.items():
            off_r = f" (ends at {r[-1]:.3g}, off scale)" if not lo_f <= r[-1] <= hi_f else ""
            off_g = f" (up to {g.max():.3g}, off scale)" if not lo_g <= g.max() <= hi_g else ""
            ax_f.plot(np.arange(len(r)), r, color=COLOURS[name], label=_label(name, d) + off_r)
            ax_g.plot(np.arange(1, len(g) + 1), g, color=COLOURS[name], label=_label(name, d) + off_g)
        ax_f.set_title(f"Forward, L = {d}: log10 |h_l| / |h_0|\n(median over {config.num_draws} draws x "
                       f"{config.num_inputs} inputs)", fontsize=10)
        ax_f.set_xlabel("block l")
        ax_f.set_ylabel("log10 |h_l| / |h_0|")
        ax_f.axhspan(*band, color="tab:green", alpha=0.08, label="ratio in [1/4, 4]")
        ax_g.set_title(f"Backward, L = {d}:\nlog10 |grad_(W_l) <v, y>| per input (median)", fontsize=10)
        ax_g.set_xlabel("block l")
        ax_g.set_ylabel("log10 |grad W_l| (unit read-out v)")
        for ax in (ax_f, ax_g):
            common.integer_ticks(ax)
            ax.grid(alpha=0.3)
            common.legend_outside(ax, ncol=2)
    if summary:
        _plot_against_depth(m, config, [fig.add_subplot(grid[2, k * len(depths):(k + 1) * len(depths)])
                                        for k in range(3)], depths, names)
    note = "" if summary else f"; one depth (L = {depths[0]}): the against-depth panels need two or more"
    fig.suptitle(f"Zhang et al. (seed 003) Section 3: stability at initialisation, width {config.width}\n"
                 f"h_l = relu(h_(l-1) + tau W_l h_(l-1)), norms tracked in log space{note}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if summary else 0.92))  # below the two-line title
    common.save_figure(fig, path, dpi=100, tight=False)


def _plot_against_depth(m: dict, config, axes, depths, names) -> None:
    ax = axes[0]
    forward = []
    for name in names:
        forward += [m[f"log10_forward_norm_ratio.{name}.L{d}"] for d in depths]
        ax.plot(depths, forward[-len(depths):], "o-", color=COLOURS[name], label=name)
    if max(v for v in forward if v is not None and np.isfinite(v)) > F32_LOG10_MAX / 2:  # only where data comes near
        ax.axhline(F32_LOG10_MAX, color="gray", ls=":", label="float32 overflow")
    ax.set_xscale("log")
    ax.set_xlabel("depth L (blocks)")
    ax.set_ylabel("log10 |h_L| / |h_0| (median)")
    ax.set_title("Forward ratio at the last block against depth\n(seed Theorems 1 and 3)", fontsize=10)
    ax = axes[1]
    values = []
    for name in names:
        total = [m[f"log10_total_grad_norm.{name}.L{d}"] for d in depths]
        per_block = [m[f"log10_median_grad_norm.{name}.L{d}"] for d in depths]
        values += total + per_block
        ax.plot(depths, total, "o-", color=COLOURS[name], label=f"{name}: total over blocks")
        ax.plot(depths, per_block, "s--", color=COLOURS[name], alpha=0.6, label=f"{name}: median per block")
    top = _fit(ax, values, (-30.0, 25.0))[1]  # tau = 1 at L = 1000 (about 190) would squash the rest; see the table
    cut = [v for v in values if np.isfinite(v) and v > top]
    ax.set_xscale("log")
    ax.set_xlabel("depth L (blocks)")
    ax.set_ylabel("log10 gradient norm (median)" + (f"; {len(cut)} points above the axis" if cut else ""))
    ax.set_title("Gradient norm against depth (seed Section 3.2):\nsolid = sqrt(sum_l |grad W_l|^2), dashed = per block",
                 fontsize=10)
    ax = axes[2]
    ratios = []
    for name in config.taus:
        r = [m[f"grad_ratio_to_plain_over_tau.{name}.L{d}"] for d in depths]
        ratios += r
        off = [d for d, v in zip(depths, r) if v is None or not np.isfinite(v) or v > 1e6]
        ax.plot(depths, r, "o-", color=COLOURS[name],
                label=f"tau = {name}" + (f" (off scale at L = {', '.join(map(str, off))})" if off else ""))
    ax.axhline(1.0, color="gray", ls=":")
    ax.axhspan(0.25, 4, color="tab:green", alpha=0.08, label="[1/4, 4] (claim's band)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    logs = [np.log10(v) for v in ratios if v is not None and np.isfinite(v) and v > 0] + [np.log10(0.25), np.log10(4)]

    lo, hi = min(logs), min(max(logs), 6.0)  # tau = 1 and L^-1/4 leave 1e6 at depth >= 1000 (see the table)
    ax.set_ylim(10 ** (lo - 0.2), 10 ** (hi + 0.2))
    ax.set_xlabel("depth L (blocks)")
    ax.set_ylabel("(median |grad W_l| ResNet / plain) / tau")
    ax.set_title("Per-block gradient relative to the feedforward\nnetwork's, divided by tau (seed: about 1)", fontsize=10)
    for ax in axes:
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        common.legend_outside(ax)


if __name__ == "__main__":
    common.main(__name__)
