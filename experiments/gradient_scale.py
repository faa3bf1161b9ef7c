"""Gradient scale through depth: products of random ReLU-layer Jacobians, plain and residual (lecture
000, "Gradient scale through depth" and "Reading the gradient scale").

The lecture's figure: the size of a gradient with respect to the activations after passing back
through k layers from size 1, k up to 50, over 200 draws; plain (a product of k random ReLU-layer
Jacobians J), residual (a product of I + J) and small branches (I + J/sqrt(50)); the median and the
10th-90th percentile band against k on a log axis.

How a factor is drawn (``resjax.analysis.propagation.random_relu_jacobian``). The lecture says only
"random ReLU-layer Jacobians"; the udlbook Chapter 11 notebooks have no such experiment (notebook 11.1
backpropagates through whole networks as ``dl/dh = W^T (1[f >= 0] * dl/df)``, the same factor used
here). Each factor is the Jacobian of one He-initialised ReLU layer ``y = relu(x W)`` at its own random
input x ~ N(0, I_D): ``J = diag(1[x W > 0]) W^T``, W a ``(D, D)`` draw at variance 2/D (``he_normal``,
untruncated Gaussian; Gaussian draws make the product's law independent of the start direction), zero
bias, a fresh W and x for every layer and every draw (an i.i.d. model of the layers, not a chain
through one network). The gradient passes back as ``g <- M^T g`` with M = J, I + J or I + J/sqrt(K),
K = 50 (``branch_scale_blocks``), the same factor for all three products, from a start vector uniform
on the unit sphere. Under He draws E|J^T g|^2 = |g|^2 and E[J] = 0, so E|g_k|^2 is 1, 2^k and
(1 + 1/K)^k; the figure shows the square roots of these as dotted guides.

Settings the lecture leaves open: the width D. Chosen: 64, the width of the lecture's MNIST-1D
networks (a wider layer gives a narrower plain band: the spread of log|J^T g| per layer falls like
1/D). Draws are seeded by ``seed`` (0, fixed before any run).

Claims. The lecture gives no numbers for this figure, only its reading: plain shrinks a typical
gradient and makes its scale highly variable; unscaled residual factors make it grow; small branches
keep it stable. The thresholds that turn these into pass/fail tests (plain median below 1 with
p90/p10 above 4; residual median above 1000; small branches' p10 and p90 within a factor 2 of 1) were
set by this script's author after a first probe run at the default settings; they encode the
lecture's reading, not a lecture number.

``--quick`` (tests): depth 10, 20 draws, width 16, K = 10.

Metrics: ``grad_norm_at_50.{plain,residual,residual_scaled}.{p10,median,p90}`` (at k = ``depth``; the
name keeps 50 as the lecture's depth), curves ``curves.{kind}.{p10,median,p90}`` (k = 0..depth) and
``curves.{kind}.rms_guide``, and ``mean_log_norm_at_50.{kind}``.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from experiments import common
from resjax.nn.init import INITIALIZERS
from resjax.analysis import propagation as prop

NAME = "gradient_scale"
KINDS = prop.KINDS
LABELS = {"plain": "plain: product of J", "residual": "residual: product of I + J",
          "residual_scaled": "small branches: product of I + J/sqrt(K)"}
COLOURS = {"plain": "tab:red", "residual": "tab:blue", "residual_scaled": "tab:green"}


HELP = {
    "depth": "layers k the gradient passes back through (the lecture's 50)",
    "num_draws": "independent draws of the product (gradients) per kind; the median and 10th-90th percentiles "
                 "are over them",
    "width": "width D of each random ReLU layer (units)",
    "branch_scale_blocks": "K of the small-branch factor I + J/sqrt(K) (the lecture's 50)",
    "kernel_init": "initialiser of each layer's weights W: a resjax initialiser name ('he_normal', 'he_uniform', "
                   "'fan_in', ...)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.depth = 50
    c.num_draws = 200
    c.width = 64
    c.branch_scale_blocks = 50
    c.kernel_init = "he_normal"
    c.seed = 0
    if size == "quick":
        c.depth, c.num_draws, c.width, c.branch_scale_blocks = 10, 20, 16, 10
    elif size == "full":
        c.num_draws = 2000
    return c


def _at(m: dict, kind: str, stat: str) -> float:
    return m[f"grad_norm_at_50.{kind}.{stat}"]


SRC = "000 lecture, Gradient scale through depth"
CLAIMS = [
    common.Claim("plain: the typical gradient shrinks (median |g| after 50 layers below 1) and its scale varies "
                 "widely across draws (p90/p10 above 4)", SRC, "shrinks, highly variable (figure only)",
                 lambda m: f"median {_at(m, 'plain', 'median'):.3g}, p10-p90 {_at(m, 'plain', 'p10'):.3g}-"
                           f"{_at(m, 'plain', 'p90'):.3g}",
                 lambda m: bool(_at(m, "plain", "median") < 1 and _at(m, "plain", "p90") / _at(m, "plain", "p10") > 4),
                 probe_threshold=True),
    common.Claim("residual, unscaled: repeated I + J factors make the gradient grow (median after 50 layers "
                 "above 1000; expectation of |g|^2 is 2^50)", SRC, "grows (figure only)",
                 lambda m: f"median {_at(m, 'residual', 'median'):.3g} (sqrt(2^50) = {2 ** 25:.3g})",
                 lambda m: bool(_at(m, "residual", "median") > 1000),
                 probe_threshold=True),
    common.Claim("small branches (I + J/sqrt(50)): gradient scale much more stable (p10 and p90 after 50 "
                 "layers within a factor 2 of 1)", SRC, "stable (figure only)",
                 lambda m: f"median {_at(m, 'residual_scaled', 'median'):.3g}, p10-p90 "
                           f"{_at(m, 'residual_scaled', 'p10'):.3g}-{_at(m, 'residual_scaled', 'p90'):.3g}",
                 lambda m: bool(0.5 <= _at(m, "residual_scaled", "p10") and _at(m, "residual_scaled", "p90") <= 2),
                 probe_threshold=True),
]


def report_section(m: dict) -> str:
    lines = ["Gradient norm after 50 layers from a unit start (percentiles over draws):", "",
             "| product | p10 | median | p90 | sqrt(E\\|g\\|^2) |", "|---|---|---|---|---|"]
    for kind in KINDS:
        guide = m[f"curves.{kind}.rms_guide"][-1]
        lines.append(f"| {LABELS[kind]} | {_at(m, kind, 'p10'):.4g} | {_at(m, kind, 'median'):.4g} | "
                     f"{_at(m, kind, 'p90'):.4g} | {guide:.4g} |")
    return "\n".join(lines)


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): integer sizes and a known initialiser."""
    for setting in ("depth", "num_draws", "width", "branch_scale_blocks"):
        prop._check_int(setting, config[setting])
    if config.kernel_init not in INITIALIZERS:
        raise ValueError(f"kernel_init: unknown initialiser {config.kernel_init!r}; choose one of {INITIALIZERS}")


def run(config, out_dir) -> dict:
    check(config)
    fn = jax.jit(lambda key: prop.gradient_scale(key, config.depth, config.width, config.num_draws,
                                                 config.branch_scale_blocks, KINDS, config.kernel_init))
    norms = {k: np.asarray(v) for k, v in fn(jax.random.key(config.seed)).items()}
    out: dict = {}
    for kind in KINDS:
        bands = {k: np.asarray(v) for k, v in prop.percentile_bands(norms[kind]).items()}
        for stat, curve in bands.items():
            out[f"grad_norm_at_50.{kind}.{stat}"] = float(curve[-1])
            out[f"curves.{kind}.{stat}"] = curve
        out[f"curves.{kind}.rms_guide"] = np.sqrt(prop.expected_sq_norm_guide(kind, config.depth,
                                                                              config.branch_scale_blocks))
        out[f"mean_log_norm_at_50.{kind}"] = float(np.mean(np.log(norms[kind][:, -1])))
    plot(out, config, out_dir / f"{NAME}.png")
    return out


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    K = config.branch_scale_blocks
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(14, 6.2))
    k = np.arange(config.depth + 1)
    for a, kinds in ((ax, KINDS), (zoom, ("plain", "residual_scaled"))):
        for kind in kinds:
            c = COLOURS[kind]
            a.fill_between(k, m[f"curves.{kind}.p10"], m[f"curves.{kind}.p90"], color=c, alpha=0.2, lw=0)
            a.plot(k, m[f"curves.{kind}.median"], color=c, lw=2, label=LABELS[kind].replace("K)", f"{K})"))
            a.plot(k, m[f"curves.{kind}.rms_guide"], color=c, lw=1, ls=":")
        a.set_yscale("log")
        a.set_xlim(0, config.depth)
        common.integer_ticks(a)
        a.set_xlabel(f"layers passed back through, k (0 to {config.depth})")
        a.grid(alpha=0.3, which="both")
        common.legend_outside(a, ncol=1)
    zoom.set_ylabel("gradient norm |g_k| (start |g_0| = 1)")
    zoom.set_title("The same, plain and small branches only (zoomed)", fontsize=9)
    ax.set_ylabel("gradient norm |g_k| (start |g_0| = 1)")
    ax.set_title(f"Gradient scale through depth (lecture, seed 000, fig. 'Gradient scale through depth')\n"
                 f"width {config.width}, ReLU layers with {config.kernel_init} weights, "
                 f"{common.plural(config.num_draws, 'draw')}: median, band 10th-90th percentile;\n"
                 f"dotted: sqrt(E|g_k|^2) under He draws = 1, 2^(k/2), (1 + 1/{K})^(k/2)", fontsize=9)
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
