"""Taki's plain ResNets at initialisation: gradient variance through 100 blocks with He's draw, with
Taki's c/(nL) and with BatchNorm at the branch input, against the library's analytic curves (seed 004,
the initialisation section with eq. (28) and the BatchNorm section, eqs. (38)-(40) and footnote 9).

What is measured (``resjax.analysis.taki``): the network is a ``resjax.nn.ResidualStack`` of Taki's
blocks ``x_{l+1} = x_l + f(N(x_l)) W_{l+1}`` (one bias-free layer per block, no activation after the
sum, N = BatchNorm with the batch's statistics, i.e. training mode, or nothing); the input batch is the
stream x_0. The loss is ``E = sum(g * x_L)`` with g ~ N(0, 1), so the top delta has zero mean and unit
variance, as the seed's analysis assumes; ``delta_l = dE/dx_l`` (the seed's delta_z^l) comes from one
``jax.vjp`` through the blocks, and its variance is mean(delta_l^2) over the batch and the width,
averaged (arithmetically, in log space) over draws of weights, inputs and g, vmapped. The kernel
gradients of every block are measured too (per example, mean(G^2)/B) against their curves.

Cases, each for the identity activation (the seed's assumption, metric suffix ``linear``) and ReLU:

- ``he``: no normalisation, He's draw N(0, 2/n): analytic (1 + 2a)^(L-l), a = E[f'^2] (3^(L-l)
  identity, 2^(L-l) ReLU);
- ``taki``: no normalisation, Taki's eq. (28) N(0, c/(nL)), c = 1: (1 + c a/L)^(L-l) <= e^(c a);
- ``bn``: BatchNorm at the branch input, n Var[w] = 1 (the issue's "seed's assumptions"), unit-variance
  inputs: prod_{j>=l} (1 + q a / (Var[x] + j q v)); identity: exactly (L+1)/(l+1); the seed's L/l
  drops Var[x] (its footnote 9). ReLU: about (L/l)^(pi/(pi-1)) (derivation in the analysis module);
- ``bn_nvar_<q>`` and ``plain_nvar_<q>``: n Var[w] in {1/4, 1, 4} (names ``0p25``, ``1``, ``4``),
  with and without BatchNorm: the seed's remark that BatchNorm's growth does not depend on Var[w],
  beside the plain ResNet, whose growth (1 + q a)^(L-l) depends on it exponentially.

Choices where the seed is silent, and why:

- width 128 (the issue's width for the fully connected models; the measured curves matched the
  mean-field ones within a few per cent at width 256 and 128 in probes, and 128 is 4x cheaper), a
  batch of 256 random inputs x ~ N(0, 1) (BatchNorm's O(1/B) projection terms, dropped by the
  analysis, stay below 1% per block), 16 draws, L = 100 blocks (the seed's CIFAR ResNets have a
  hundred blocks), c = 1 (the seed's CIFAR runs: variance 1/(8*8*16*100)).
- the model is fully connected (the seed's experiment uses 8x8 convolutions; its analysis, which
  this reproduces, is layer-generic with n the fan-in). No biases (the seed's u = W z).
- "He" is He's actual draw, N(0, 2/n), for both activations; for the identity activation that is
  q = 2 (3^(L-l), 10^47.7 at L = 100: variances are handled as log10 of second moments, so nothing
  overflows float32).
- one compiled program per (activation, normalisation): every network is drawn with ``fan_in``
  (N(0, 1/n)) and its kernels multiplied by sqrt(q) inside the program (``kernel_gains``), so the
  n Var[w] values run vmapped on the same draws. N(0, 1/n) times sqrt(2) is He's ``he_normal`` and
  times sqrt(c/L) is ``get_initializer('taki(c=1, L=100)')`` draw for draw (the run checks both on one
  kernel: ``init_check.max_abs_diff.{he,taki}``).
- agreement: ``max_rel_dev.<case>.<act>`` = max over l of |measured/analytic - 1|, the curves relative
  to the measured Var[delta_L] (g has unit variance); the seed's closed form is compared for
  l >= L/10 (``bn_seed_form_max_rel_dev``), where the Var[x] term it drops is below 10%.
  ``bn_growth_exponent``: the power p of a least-squares fit Var[delta_l] ~ l^(-p) over l in [L/10, L]
  (the seed's L/l: p = 1). Var[w] independence: ``bn_growth.mid_to_last`` = Var[delta_{L/2}] /
  Var[delta_L] (seed: 2) for each n Var[w], and its spread max/min over n Var[w]
  (``bn_growth_spread.mid_to_last``), beside the same for the plain ResNet; first-to-last too, where
  the Var[x] term (footnote 9) makes BatchNorm's growth depend on Var[x]/(n Var[w]).
- seeds: ``jax.random.key(seed)``, seed 0; every program uses the same draws (common random numbers).

Claims and tolerances (set from the mean-field curves before running at L = 100, after probes at
L = 10 and one L = 100 probe had matched within 5%): He: measured Var[delta_0]/Var[delta_L] within a
factor 2 (0.3 in log10) of (1 + 2a)^L, both activations; Taki: within 10% of (1 + a/L)^L and below the
bound e^(c a) x 1.1; BN identity: max relative deviation from the library curve <= 0.15 and from the
seed's L/l <= 0.15 for l >= L/10; BN ReLU: fitted power within 0.1 of the analytic fit's; Var[w]
independence: mid-to-last spread over n Var[w] <= 1.25 (analytic 1.04 identity, 1.15 ReLU) while
the plain ResNet's exceeds 10^10.

``--quick`` (tests): 10 blocks, width 32, batch 64, 8 draws; same cases.
"""

from __future__ import annotations

import math

import jax
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis import taki as T
from resjax.nn import get_initializer

NAME = "taki_init"
ACTS = ("linear", "relu")
MAIN = ("he", "taki", "bn")
COLOURS = {"he": "tab:red", "taki": "tab:orange", "bn": "tab:blue"}


HELP = {
    "num_blocks": "residual blocks L (the seed's CIFAR ResNets: 100)",
    "width": "width n of every block (units)",
    "batch_size": "random inputs in the batch (BatchNorm's statistics are over it)",
    "num_draws": "random draws of weights, inputs and the top gradient g (averaged in log space)",
    "c": "Taki's c in the weight variance c/(nL)",
    "bn_n_var_w": "n Var[w] of the BatchNorm case (the seed's assumption: 1)",
    "n_var_w_values": "the n Var[w] values of the independence check, e.g. \"(0.25, 1.0, 4.0)\"",
    "input_variance": "variance of the random inputs x_0",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_blocks = 100
    c.width = 128
    c.batch_size = 256
    c.num_draws = 16
    c.c = 1.0
    c.bn_n_var_w = 1.0
    c.n_var_w_values = (0.25, 1.0, 4.0)
    c.input_variance = 1.0
    c.seed = 0
    if size == "quick":
        c.num_blocks, c.width, c.batch_size, c.num_draws = 10, 32, 64, 8
    elif size == "full":
        c.width, c.num_draws = 256, 64
    return c


def qname(q: float) -> str:
    """Metric-safe name of an n Var[w] value: 0.25 -> '0p25', 4.0 -> '4'."""
    return f"{q:g}".replace(".", "p")


def cases(config) -> dict:
    """{(act, norm): [(case name, n Var[w]), ...]}: one compiled program per key."""
    L = config.num_blocks
    out = {}
    for act in ACTS:
        out[(act, "none")] = ([("he", 2.0), ("taki", config.c / L)]
                              + [(f"plain_nvar_{qname(q)}", float(q)) for q in config.n_var_w_values])
        out[(act, "batch")] = ([("bn", float(config.bn_n_var_w))]
                               + [(f"bn_nvar_{qname(q)}", float(q)) for q in config.n_var_w_values])
    return out


# ---- claims ------------------------------------------------------------------------------------------

SRC_INIT = "004 Taki, ResNet and weight initialisation, eq. (28)"
SRC_BN = "004 Taki, batch normalisation section, eqs. (38)-(40)"


def _r(m, case, act, prefix="grad_var_ratio_first_to_last"):
    return m[f"{prefix}.{case}.{act}"]


def _he_holds(m):
    return all(abs(math.log10(_r(m, "he", a)) - math.log10(_r(m, "he", a, "analytic_ratio_first_to_last"))) <= 0.3
               for a in ACTS if _r(m, "he", a) is not None)


CLAIMS = [
    common.Claim("plain ResNet, He's initialisation: the gradient variance grows exponentially through depth, "
                 "Var[delta_0]/Var[delta_L] = (1 + n Var[w] a)^L; measured within a factor 2 of it",
                 SRC_INIT, "exponential in L (2^L ReLU, 3^L identity with Var[w] = 2/n)",
                 lambda m: "; ".join(f"{a}: {_r(m, 'he', a):.3g} vs {_r(m, 'he', a, 'analytic_ratio_first_to_last'):.3g}"
                                     for a in ACTS),
                 _he_holds,
                 probe_threshold=True),
    common.Claim("Taki's initialisation Var[w] = c/(nL) keeps the gradient variance bounded: "
                 "Var[delta_0]/Var[delta_L] = (1 + c a/L)^L <= e^(c a), measured within 10% and under 1.1 e^(c a)",
                 SRC_INIT, "O(1): e^(c a) = 2.72 identity, 1.65 ReLU (c = 1)",
                 lambda m: "; ".join(f"{a}: {_r(m, 'taki', a):.3f} (analytic {_r(m, 'taki', a, 'analytic_ratio_first_to_last'):.3f},"
                                     f" bound {m[f'taki_bound.{a}']:.3f})" for a in ACTS),
                 lambda m: all(abs(_r(m, "taki", a) / _r(m, "taki", a, "analytic_ratio_first_to_last") - 1) <= 0.1
                               and _r(m, "taki", a) <= 1.1 * m[f"taki_bound.{a}"] for a in ACTS),
                 probe_threshold=True),
    common.Claim("BatchNorm at the branch input (identity activation, n Var[w] = 1): Var[delta_l] = Var[delta_L] L/l, "
                 "linear instead of exponential; measured within 15% of the library curve and of L/l for l >= L/10",
                 SRC_BN, "L/l (Var[x] neglected)",
                 lambda m: f"first/last {_r(m, 'bn', 'linear'):.1f} (analytic {_r(m, 'bn', 'linear', 'analytic_ratio_first_to_last'):.1f}); "
                           f"max rel. dev. {m['max_rel_dev.bn.linear']:.3f} from the curve, "
                           f"{m['bn_seed_form_max_rel_dev.linear']:.3f} from L/l (l >= L/10); fitted power "
                           f"{m['bn_growth_exponent.bn.linear']:.3f}",
                 lambda m: bool(m["max_rel_dev.bn.linear"] <= 0.15 and m["bn_seed_form_max_rel_dev.linear"] <= 0.15),
                 probe_threshold=True),
    common.Claim("BatchNorm with ReLU (beyond the seed's identity case): a power law (L/l)^kappa, kappa = pi/(pi-1) "
                 "for this placement (derived in resjax.analysis.taki); fitted power within 0.1 of the analytic fit",
                 SRC_BN + " and footnote 7", "linear growth claimed for another placement (appendix, not in the seed text)",
                 lambda m: f"fitted power {m['bn_growth_exponent.bn.relu']:.3f} vs analytic "
                           f"{m['analytic_bn_growth_exponent.bn.relu']:.3f} (asymptotic {m['bn_growth_power.relu']:.3f}); "
                           f"max rel. dev. {m['max_rel_dev.bn.relu']:.3f}",
                 lambda m: bool(abs(m["bn_growth_exponent.bn.relu"] - m["analytic_bn_growth_exponent.bn.relu"]) <= 0.1),
                 probe_threshold=True),
    common.Claim("BatchNorm's growth does not depend on Var[w]: Var[delta_{L/2}]/Var[delta_L] over n Var[w] in "
                 "{1/4, 1, 4} spreads by <= 1.25x, while the plain ResNet's spreads by > 10^10",
                 SRC_BN + " and footnote 9", "no dependency on Var[w] (Var[x] neglected)",
                 lambda m: "; ".join(f"{a}: BN spread {m[f'bn_growth_spread.mid_to_last.{a}']:.3f}, plain "
                                     f"{m[f'plain_growth_spread.mid_to_last.{a}']:.3g}" for a in ACTS),
                 lambda m: all(m[f"bn_growth_spread.mid_to_last.{a}"] <= 1.25
                               and m[f"plain_growth_spread.mid_to_last.{a}"] > 1e10 for a in ACTS),
                 probe_threshold=True),
]


def report_section(m: dict) -> str:
    lines = ["Var[delta_0]/Var[delta_L], measured (mean of draws) vs the library's mean-field curve:", "",
             "| case | identity | ReLU | max rel. dev. (identity; ReLU) |", "|---|---|---|---|"]
    for case in MAIN:
        cells = [f"{_r(m, case, a):.4g} vs {_r(m, case, a, 'analytic_ratio_first_to_last'):.4g}" for a in ACTS]
        lines.append(f"| {case} | {cells[0]} | {cells[1]} | {m[f'max_rel_dev.{case}.linear']:.3f}; "
                     f"{m[f'max_rel_dev.{case}.relu']:.3f} |")
    lines += ["", "BatchNorm vs plain over n Var[w]: Var[delta_{L/2}]/Var[delta_L] (seed's L/l: 2):", "",
              "| n Var[w] | BN identity | BN ReLU | plain identity | plain ReLU |", "|---|---|---|---|---|"]
    for q in m["n_var_w_values"]:
        n = qname(q)
        lines.append(f"| {q:g} | " + " | ".join(f"{m[f'{k}_growth.mid_to_last.nvar_{n}.{a}']:.4g}"
                                             for k in ("bn", "plain") for a in ACTS) + " |")
    return "\n".join(lines)


# ---- running -----------------------------------------------------------------------------------------


def _init_check(config) -> dict:
    """He's and Taki's named initialisers equal N(0, 1/n) times sqrt(2) and sqrt(c/L), draw for draw."""
    key, shape = jax.random.key(config.seed + 1), (config.width, config.width)
    base = np.asarray(get_initializer("fan_in")(key, shape))
    taki = np.asarray(get_initializer(f"taki(c={config.c}, L={config.num_blocks})")(key, shape))
    he = np.asarray(get_initializer("he_normal")(key, shape))
    return {"init_check.max_abs_diff.he": float(np.max(np.abs(he - math.sqrt(2.0) * base))),
            "init_check.max_abs_diff.taki": float(np.max(np.abs(taki - math.sqrt(config.c / config.num_blocks) * base))),
            "init_check.taki_variance_times_nL": float(np.var(taki) * config.width * config.num_blocks)}


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): integer sizes, positive variances, >= 2 blocks."""
    for setting in ("num_blocks", "width", "num_draws"):
        T._check_int(setting, config[setting])
    T._check_int("batch_size", config.batch_size, 2)
    T._check_positive("c", config.c)
    T._check_positive("input_variance", config.input_variance)
    for q in tuple(config.n_var_w_values) + (config.bn_n_var_w,):
        T._check_positive("n_var_w_values", q)
    L = config.num_blocks
    if L < 2:
        raise ValueError(f"num_blocks: need >= 2 blocks for the mid-to-last ratio, got {L}")


def run(config, out_dir) -> dict:
    check(config)
    L = config.num_blocks
    l_fit = max(1, L // 10)
    key = jax.random.key(config.seed)
    out: dict = {"n_var_w_values": [float(q) for q in config.n_var_w_values]}
    out.update(_init_check(config))
    for (act, norm), items in cases(config).items():
        module = T.make_stack(config.width, L, kernel_init="fan_in", activation=act, norm=norm)
        qs = [q for _, q in items]
        res = T.gradient_variance(module, key, batch_size=config.batch_size, num_draws=config.num_draws,
                                  input_variance=config.input_variance, kernel_gains=[math.sqrt(q) for q in qs],
                                  train=True)
        for i, (case, q) in enumerate(items):
            log_d = T.mean_over_draws(res["log10_delta_sq"][i])
            rel = log_d - log_d[-1]  # log10 Var[delta_l]/Var[delta_L]
            ana = np.log10(T.delta_variance(L, q, act, norm, config.input_variance))
            log_k = T.mean_over_draws(res["log10_kernel_grad_sq"][i]) - log_d[-1]
            ana_k = np.log10(T.weight_grad_variance(L, q, act, norm, config.input_variance))
            per_draw = res["log10_delta_sq"][i] - res["log10_delta_sq"][i][:, -1:]
            out[f"n_var_w.{case}.{act}"] = q
            out[f"grad_var_ratio_first_to_last.{case}.{act}"] = float(10 ** rel[0])
            out[f"analytic_ratio_first_to_last.{case}.{act}"] = float(10 ** ana[0])
            out[f"grad_var_ratio_first_to_last_per_draw.{case}.{act}"] = 10 ** per_draw[:, 0]
            out[f"log10_grad_var_ratio_first_to_last.{case}.{act}"] = float(rel[0])
            out[f"max_rel_dev.{case}.{act}"] = float(np.max(np.abs(10 ** (rel - ana) - 1)))
            out[f"max_abs_log10_dev.{case}.{act}"] = float(np.max(np.abs(rel - ana)))
            out[f"kernel_grad_max_rel_dev.{case}.{act}"] = float(np.max(np.abs(10 ** (log_k - ana_k) - 1)))
            out[f"kernel_grad_ratio_first_to_last.{case}.{act}"] = float(10 ** (log_k[0] - log_k[-1]))
            out[f"analytic_kernel_grad_ratio_first_to_last.{case}.{act}"] = float(10 ** (ana_k[0] - ana_k[-1]))
            out[f"curves.log10_delta_var.{case}.{act}"] = rel
            out[f"curves.log10_delta_var_p10.{case}.{act}"] = np.percentile(per_draw, 10, axis=0)
            out[f"curves.log10_delta_var_p90.{case}.{act}"] = np.percentile(per_draw, 90, axis=0)
            out[f"curves.analytic_log10_delta_var.{case}.{act}"] = ana
            out[f"curves.log10_kernel_grad_var.{case}.{act}"] = log_k
            out[f"curves.analytic_log10_kernel_grad_var.{case}.{act}"] = ana_k
            kind = "bn" if norm == "batch" else "plain"
            if case.startswith(f"{kind}_nvar_"):
                n = case.split("_nvar_")[1]
                out[f"{kind}_growth.mid_to_last.nvar_{n}.{act}"] = float(10 ** (rel[L // 2]))
                out[f"analytic_{kind}_growth.mid_to_last.nvar_{n}.{act}"] = float(10 ** (ana[L // 2]))
                out[f"{kind}_growth.first_to_last.nvar_{n}.{act}"] = float(10 ** rel[0])
                out[f"analytic_{kind}_growth.first_to_last.nvar_{n}.{act}"] = float(10 ** ana[0])
            if norm == "batch":
                out[f"bn_growth_exponent.{case}.{act}"] = T.growth_exponent(10 ** rel, l_fit, L)
                out[f"analytic_bn_growth_exponent.{case}.{act}"] = T.growth_exponent(10 ** ana, l_fit, L)
    for act in ACTS:
        out[f"taki_bound.{act}"] = T.taki_bound(act, config.c)
        out[f"bn_growth_power.{act}"] = T.bn_growth_power(act)
        out[f"log10_growth_per_block.he.{act}"] = out[f"log10_grad_var_ratio_first_to_last.he.{act}"] / L
        out[f"analytic_log10_growth_per_block.he.{act}"] = math.log10(1 + 2 * T.MOMENTS[act]["a"])
        seed = T.seed_bn_curve(L)[l_fit:]
        bn = 10 ** out[f"curves.log10_delta_var.bn.{act}"][l_fit:]
        out[f"bn_seed_form_max_rel_dev.{act}"] = float(np.max(np.abs(bn / seed - 1)))
        for kind in ("bn", "plain"):
            for span in ("mid_to_last", "first_to_last"):
                vals = [out[f"{kind}_growth.{span}.nvar_{qname(q)}.{act}"] for q in config.n_var_w_values]
                ana = [out[f"analytic_{kind}_growth.{span}.nvar_{qname(q)}.{act}"] for q in config.n_var_w_values]
                out[f"{kind}_growth_spread.{span}.{act}"] = float(max(vals) / min(vals))
                out[f"analytic_{kind}_growth_spread.{span}.{act}"] = float(max(ana) / min(ana))
    out["curves.seed_bn"] = T.seed_bn_curve(L)
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    L = config.num_blocks
    l = np.arange(L + 1)
    qs = list(config.n_var_w_values)
    shades = plt.get_cmap("viridis")(np.linspace(0.1, 0.85, len(qs)))
    fig, axes = plt.subplots(2, 4, figsize=(23, 10))
    labels = {"he": "He N(0, 2/n)", "taki": f"Taki N(0, c/(nL)), c={config.c:g}",
              "bn": f"BatchNorm, n Var[w]={config.bn_n_var_w:g}"}
    step = max(1, L // 25)

    def curve(ax, case, act, colour, label, band=True, x0=0):
        if band:
            ax.fill_between(l[x0:], 10 ** m[f"curves.log10_delta_var_p10.{case}.{act}"][x0:],
                            10 ** m[f"curves.log10_delta_var_p90.{case}.{act}"][x0:], color=colour, alpha=0.15, lw=0)
        st = 1 if x0 else step  # every point on the log-x panels
        ax.plot(l[x0:][::st], 10 ** m[f"curves.log10_delta_var.{case}.{act}"][x0:][::st], "o", ms=4 if st > 1 else 2.5,
                color=colour, label=f"{label}: measured" + (" (band: p10-p90 of draws)" if band else ""))
        ax.plot(l[x0:], 10 ** m[f"curves.analytic_log10_delta_var.{case}.{act}"][x0:], "-", color=colour, lw=1.5,
                label=f"{label}: analytic")

    for row, act in enumerate(ACTS):
        actname = "identity activation (seed's assumption)" if act == "linear" else "ReLU"
        kappa = m[f"bn_growth_power.{act}"]
        ax = axes[row, 0]
        curve(ax, "he", act, COLOURS["he"], labels["he"])
        ax.set_title(f"{actname}: plain ResNet, He's draw, {L} blocks, width {config.width}\n"
                     "seed 004: exponential growth with He's variance, (1 + n Var[w] a)^(L - l)", fontsize=9)
        ax = axes[row, 1]
        for case in ("taki", "bn"):
            curve(ax, case, act, COLOURS[case], labels[case])
        ax.plot(l[1:], m["curves.seed_bn"][1:], "k--", lw=1, label="seed eq. (40): L/l")
        if act != "linear":
            ax.plot(l[1:], m["curves.seed_bn"][1:] ** kappa, "k:", lw=1, label=f"(L/l)^{kappa:.3f} (ReLU, derived)")
        ax.axhline(m[f"taki_bound.{act}"], color="tab:orange", ls=":", lw=1, label="e^(c a): bound under eq. (28)")
        ax.set_ylim(0.5, None)
        ax.set_title(f"{actname}: Taki's eq. (28) c/(nL) stays bounded;\n"
                     "BatchNorm at the branch input grows like L/l (seed eq. (40))", fontsize=9)
        for col, kind in ((2, "bn"), (3, "plain")):
            ax = axes[row, col]
            for q, colour in zip(qs, shades):
                curve(ax, f"{kind}_nvar_{qname(q)}", act, colour, f"n Var[w] = {q:g}", band=False,
                      x0=1 if kind == "bn" else 0)
            if kind == "bn":
                ax.plot(l[1:], m["curves.seed_bn"][1:], "k--", lw=1, label="seed: L/l")
                if act != "linear":
                    ax.plot(l[1:], m["curves.seed_bn"][1:] ** kappa, "k:", lw=1, label=f"(L/l)^{kappa:.3f}")
                ax.set_xscale("log")
                ax.set_title(f"{actname}: BatchNorm at the branch input over Var[w] (log-log)\n"
                             "seed 004 eq. (40): no Var[w] in the growth (Var[x] neglected, footnote 9)", fontsize=9)
            else:
                ax.set_title(f"{actname}: plain ResNet (no BatchNorm) over Var[w]\n"
                             "(1 + n Var[w] a)^(L - l): exponential, set by Var[w]", fontsize=9)
        for ax in axes[row]:
            if ax.get_xscale() != "log":
                common.integer_ticks(ax)
            else:  # blocks as integers: 1, 10, 100 (not 10^0)
                from matplotlib.ticker import StrMethodFormatter

                ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
            ax.set_yscale("log")
            ax.set_xlabel("stream index l (residual blocks passed)" + (", from 1" if ax.get_xscale() == "log" else ""))
            ax.set_ylabel("Var[delta_l] / Var[delta_L]   (delta_l = dE/dx_l)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6.5)
    fig.suptitle(f"Taki (seed 004): gradient variance of plain ResNets at initialisation, {L} blocks, width "
                 f"{config.width}, batch {config.batch_size} of N(0, {config.input_variance:g}) inputs, "
                 f"{common.plural(config.num_draws, 'draw')}\n(markers: measured, mean of draws) vs the library's "
                 "mean-field curves (lines)", fontsize=11)
    common.save_figure(fig, path, dpi=90)


if __name__ == "__main__":
    common.main(__name__)
