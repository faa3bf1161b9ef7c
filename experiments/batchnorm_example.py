"""BatchNorm's worked example: one unit over the minibatch [2, 4, 6, 8] (lecture 000, "Batch
normalisation", steps 1-4, "Worked example: four values" and the figure "Four values, stage by stage").

Settings the lecture states: the minibatch [2, 4, 6, 8], gamma = 2, delta = 1, epsilon = 0; expected
mean 5, centred [-3, -1, 1, 3], population variance 5 (unbiased 6.67, torch.var's default),
standardised [-1.34, -0.45, 0.45, 1.34], output [-1.68, 0.11, 1.89, 3.68].

The output is computed twice: through resjax's own layer (``make_norm('batch', train=True,
epsilon=0)``, flax's ``BatchNorm`` underneath, with its scale set to gamma and its offset to delta;
input shape (4, 1): four examples, one unit) and by the four steps by hand
(``resjax.analysis.batchnorm.batchnorm_steps``). Beside them, the same layer at resjax's default
epsilon 1e-5, and the running estimates the layer stores after this one step (rho = 0.1 from mean 0,
variance 1; flax stores the population variance, PyTorch would store the unbiased one).

Metrics: ``stages.{input,centred,standardised,output}`` (by hand), ``output.layer``,
``output.layer_default_epsilon``, ``mean``, ``variance.{population,unbiased}``,
``max_abs_diff.layer_vs_hand``, ``max_abs_diff.layer_vs_lecture`` (against the lecture's two-decimal
values), ``running.{mean,var}`` after the step. Nothing is random; there is no seed.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis import batchnorm as bn

NAME = "batchnorm_example"
LECTURE = {"mean": 5.0, "centred": [-3, -1, 1, 3], "var_population": 5.0, "var_unbiased": 6.67,
           "standardised": [-1.34, -0.45, 0.45, 1.34], "output": [-1.68, 0.11, 1.89, 3.68]}


HELP = {
    "minibatch": "the unit's values over the minibatch, e.g. \"(2.0, 4.0, 6.0, 8.0)\" (the lecture's)",
    "gamma": "BatchNorm's scale gamma (the lecture's 2)",
    "delta": "BatchNorm's offset delta (the lecture's 1)",
    "epsilon": "BatchNorm's epsilon, added to the variance (the lecture's 0)",
    "rho": "the running estimates' update rate rho (PyTorch's momentum; flax's momentum is 1 - rho)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.minibatch = (2.0, 4.0, 6.0, 8.0)
    c.gamma = 2.0
    c.delta = 1.0
    c.epsilon = 0.0
    c.rho = 0.1
    return c  # the same at every size: four numbers


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): a 1-d minibatch, epsilon >= 0, rho in (0, 1]."""
    h = np.asarray(config.minibatch, np.float32)
    if h.ndim != 1 or h.size < 2:
        raise ValueError(f"minibatch: a list of at least 2 numbers (batch statistics need a spread), got "
                         f"{config.minibatch!r}")
    if config.epsilon < 0:
        raise ValueError(f"epsilon: must be >= 0, got {config.epsilon}")
    bn.check_rho(config.rho)


def run(config, out_dir) -> dict:
    check(config)
    h = np.asarray(config.minibatch, np.float32)
    steps = {k: np.asarray(v) for k, v in bn.batchnorm_steps(h, config.gamma, config.delta, config.epsilon).items()}
    layer = jax.jit(lambda x, eps: bn.apply_norm("batch", x, train=True, gamma=config.gamma, delta=config.delta,
                                                 epsilon=eps, rho=config.rho), static_argnums=1)
    y, stats = layer(h[:, None], float(config.epsilon))
    y_default, _ = layer(h[:, None], 1e-5)
    y = np.asarray(y)[:, 0]
    out = {f"stages.{k}": steps[k] for k in ("input", "centred", "standardised", "output")}
    out.update({
        "mean": float(steps["mean"]),
        "variance.population": float(steps["var_population"]),
        "variance.unbiased": float(steps["var_unbiased"]),
        "output.layer": y,
        "output.layer_default_epsilon": np.asarray(y_default)[:, 0],
        "max_abs_diff.layer_vs_hand": float(np.max(np.abs(y - steps["output"]))),
        # against the lecture's four outputs; null for a minibatch of another length (--minibatch "(1, 2, 3)")
        "max_abs_diff.layer_vs_lecture": (float(np.max(np.abs(y - np.asarray(LECTURE["output"]))))
                                          if y.shape == np.shape(LECTURE["output"]) else float("nan")),
        "running.mean": float(np.asarray(stats["mean"])[0]),
        "running.var": float(np.asarray(stats["var"])[0]),
    })
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- claims ------------------------------------------------------------------------------------------

SRC = "000 lecture, Worked example: four values"


def _two_decimals(measured, lecture) -> bool:
    return bool(np.allclose(np.round(np.asarray(measured, np.float64), 2), lecture, rtol=0, atol=1e-9))


def _fmt(v):
    return "[" + ", ".join(f"{x:.2f}" for x in v) + "]"


CLAIMS = [
    common.Claim("worked example: [2, 4, 6, 8], gamma 2, delta 1, epsilon 0 through resjax's BatchNorm layer "
                 "gives the lecture's output to two decimals", SRC, _fmt(LECTURE["output"]),
                 lambda m: _fmt(m["output.layer"]),
                 lambda m: _two_decimals(m["output.layer"], LECTURE["output"])),
    common.Claim("worked example: the layer equals the four steps by hand (float32)", SRC, "same computation",
                 lambda m: f"max |layer - hand| = {m['max_abs_diff.layer_vs_hand']:.2g}",
                 lambda m: bool(m["max_abs_diff.layer_vs_hand"] <= 1e-5)),
    common.Claim("worked example: standardised values [-1.34, -0.45, 0.45, 1.34] to two decimals", SRC,
                 _fmt(LECTURE["standardised"]), lambda m: _fmt(m["stages.standardised"]),
                 lambda m: _two_decimals(m["stages.standardised"], LECTURE["standardised"])),
    common.Claim("worked example: population variance 5 (BatchNorm's) against the unbiased 6.67 (torch.var's)",
                 SRC, "5 vs 6.67",
                 lambda m: f"{m['variance.population']:.2f} vs {m['variance.unbiased']:.2f}",
                 lambda m: bool(round(m["variance.population"], 2) == 5.0 and round(m["variance.unbiased"], 2) == 6.67)),
]


def report_section(m: dict) -> str:
    rows = [("input", m["stages.input"]), ("centred", m["stages.centred"]),
            ("standardised", m["stages.standardised"]), ("output (hand)", m["stages.output"]),
            ("output (resjax layer)", m["output.layer"]),
            ("output (layer, epsilon 1e-5)", m["output.layer_default_epsilon"])]
    lines = ["| stage | values |", "|---|---|"] + [f"| {n} | {_fmt(v)} |" for n, v in rows]
    lines += ["", f"Running estimates stored after this one step (rho 0.1 from mean 0, var 1; flax stores the "
                  f"population variance): mean {m['running.mean']:.3f}, var {m['running.var']:.3f}."]
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    stages = ["input", "centred", "standardised", "output"]
    labels = ["input h_i", "centred\nh_i - m_h", "standardised\n(h_i - m_h) / s_h",
              f"scaled + shifted\n{config.gamma:g} * h_hat + {config.delta:g}"]
    vals = np.array([m[f"stages.{s}"] for s in stages])  # (4 stages, 4 examples)
    fig, ax = plt.subplots(figsize=(9.5, 5))
    colours = plt.cm.viridis(np.linspace(0.1, 0.85, vals.shape[1]))
    for i in range(vals.shape[1]):
        ax.plot(range(4), vals[:, i], "-", color=colours[i], lw=1, alpha=0.6)
        ax.scatter(range(4), vals[:, i], color=colours[i], s=50, zorder=3, label=f"example {i + 1}")
        for j in range(4):
            ax.annotate(f"{vals[j, i]:.2f}", (j, vals[j, i]), textcoords="offset points", xytext=(8, -3), fontsize=8)
    ax.scatter([3] * vals.shape[1], m["output.layer"], marker="x", color="k", s=60, zorder=4,
               label="resjax BatchNorm layer")
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xticks(range(4), labels, fontsize=8)
    ax.set_xlim(-0.3, 3.6)
    ax.set_ylabel("activation value (unitless)")
    ax.set_xlabel(f"stage of batch normalisation (one unit, minibatch of {vals.shape[1]}, epsilon {config.epsilon:g})")
    ax.set_title(f"{vals.shape[1]} values, stage by stage (lecture, seed 000, fig. 'Four values, stage by stage')\n"
                 f"mean {m['mean']:g}, population variance {m['variance.population']:g} "
                 f"(unbiased {m['variance.unbiased']:.2f}), gamma {config.gamma:g}, delta {config.delta:g}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
