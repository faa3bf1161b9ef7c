"""BatchNorm after the branch lets the block output norm grow like sqrt(l) (Zhang et al., seed 003,
Section 3.4, Proposition 1 and Figure 2's "epoch 0" curves).

The seed's Section 3.4 model (``resjax.nn.tau_resnet``, kind ``'bn'``): h_0 = relu(A x),
h_l = relu(h_(l-1) + BN(W_l h_(l-1))), l = 1..L, BatchNorm over the minibatch (training-mode statistics,
as at the first training step: at initialisation the running estimates are 0 and 1 and would not
normalise at all), W_l at variance 2/m, no tau. Width 128, L = 1000 blocks, one minibatch of 256
MNIST-1D training inputs, 5 weight draws (vmapped). The stream at every depth is read from the
module's sown ``'block_out'`` intermediates (``resjax.analysis.propagation.stream_activations``).

Measured: the norm |h_(i,l)| of every block output per input, averaged over the 256 inputs and the draws;
``bn_norm_growth_exponent`` is the least-squares slope of log(mean |h_l|) against log l over every block
l = 1..L (uniform in l, so it weighs the later blocks, where Proposition 1's sqrt(l) applies once the
stream is large compared with h_0). Also reported: the slope over log-spaced blocks (each decade weighs
the same; more sensitive to the first blocks, where |h_0| still matters), the slope over the second half
of the blocks, and each draw's slope. The figure shows a sqrt(l) guide (exponent 0.5, scale fitted to
the curve) and, for reference, the same network without BatchNorm at tau = 1/sqrt(L) (kind ``'tau'``,
same draws of A and W_l): its norm stays within a small constant factor of |h_0| at every depth.

Settings the seed leaves open, and what is used: the data (MNIST-1D; the seed's Figure 2 is
ResNet1202 on CIFAR-10 and its Proposition is for this fully connected model), the batch (256, the
seed's training batch size), the width (128, as in its Section 5.1), 5 draws, and the fit ranges above
(fixed before any run).

Metrics: ``bn_norm_growth_exponent``, ``bn_norm_growth_exponent_logspaced``,
``bn_norm_growth_exponent_second_half``, ``bn_norm_growth_exponent_per_draw`` (list),
``curves.bn_mean_norm`` (l = 0..L), ``curves.tau_mean_norm`` (l = 0..L), ``h0_mean_norm``.

``--quick`` (tests): width 16, 32 blocks, batch 32, 2 draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis.propagation import stream_activations
from resjax.analysis.stability import direct_norms, log_log_slope
from resjax.data import load_dataset
from resjax.nn.tau_mlp import tau_resnet

NAME = "tau_batchnorm_growth"


HELP = {
    "width": "width m of the network (units per block)",
    "depth": "blocks L (the seed's 1000)",
    "batch_size": "MNIST-1D training inputs in the one minibatch whose statistics BatchNorm uses",
    "num_draws": "random weight draws (vmapped); norms are averaged over them",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.width = 128
    c.depth = 1000
    c.batch_size = 256
    c.num_draws = 5
    c.seed = 0
    if size == "quick":
        c.width, c.depth, c.batch_size, c.num_draws = 16, 32, 32, 2
    elif size == "full":
        c.num_draws = 20
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    for name in ("width", "depth", "num_draws"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {config[name]!r}")
    if config.depth < 3:
        raise ValueError(f"depth: the growth exponent needs at least 3 blocks, got {config.depth}")
    if not isinstance(config.batch_size, int) or config.batch_size < 2:
        raise ValueError(f"batch_size: BatchNorm needs a batch of at least 2, got {config.batch_size!r}")
    common.check_batch_sizes("batch_size", config.batch_size, len(common.load_data(config).y_train), minimum=2)


def logspaced_slope(curve: np.ndarray, num: int = 30) -> float:
    """Slope of log curve[l] against log l on ``num`` log-spaced blocks l in [1, L] (duplicates dropped)."""
    L = len(curve) - 1
    ls = np.unique(np.round(np.logspace(0, np.log10(L), num)).astype(int))
    return float(np.polyfit(np.log(ls), np.log(curve[ls]), 1)[0])


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    x = jnp.asarray(data.x_train[: config.batch_size])
    bn = tau_resnet("bn", config.width, config.depth, data.num_classes)
    ref = tau_resnet("tau", config.width, config.depth, data.num_classes, tau="1/sqrt(L)")

    def one(key):
        variables = bn.init(key, x)
        stream = stream_activations(bn, variables, x, train=True)  # (L + 1, B, m), batch statistics
        bn_norm = jnp.mean(jnp.linalg.norm(stream, axis=-1), axis=-1)
        # the same A and W_l without BatchNorm, tau = 1/sqrt(L)
        p = variables["params"]
        ref_params = {"stem": p["stem"], "head": p["head"],
                      "blocks": {"block": {"linear_0": p["blocks"]["block"]["linear_0"]}}}
        tau_norm = jnp.mean(direct_norms(ref, {"params": ref_params}, x), axis=-1)
        return bn_norm, tau_norm

    keys = jax.random.split(jax.random.key(config.seed), config.num_draws)
    bn_norm, tau_norm = jax.device_get(jax.jit(jax.vmap(one))(keys))
    bn_norm, tau_norm = np.asarray(bn_norm, np.float64), np.asarray(tau_norm, np.float64)
    curve = bn_norm.mean(axis=0)
    L = config.depth
    m = {
        "bn_norm_growth_exponent": log_log_slope(curve, start=1),
        "bn_norm_growth_exponent_logspaced": logspaced_slope(curve),
        "bn_norm_growth_exponent_second_half": log_log_slope(curve, start=max(1, L // 2)),
        "bn_norm_growth_exponent_per_draw": [log_log_slope(c, start=1) for c in bn_norm],
        "h0_mean_norm": float(curve[0]),
        "curves.bn_mean_norm": curve,
        "curves.tau_mean_norm": tau_norm.mean(axis=0),
    }
    plot(m, config, out_dir / f"{NAME}.png")
    return m


SRC = "003 Zhang et al., Section 3.4, Proposition 1 / Figure 2"
CLAIMS = [
    common.Claim("with BatchNorm after the branch, the block output norm at initialisation grows like sqrt(l): "
                 "slope of log|h_l| against log l within 0.1 of 0.5", SRC, "about 0.5 (sqrt(l))",
                 lambda m: (f"{m['bn_norm_growth_exponent']:.3f} (log-spaced {m['bn_norm_growth_exponent_logspaced']:.3f}, "
                            f"second half {m['bn_norm_growth_exponent_second_half']:.3f})"),
                 lambda m: abs(m["bn_norm_growth_exponent"] - 0.5) <= 0.1),
]


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    curve = np.asarray(m["curves.bn_mean_norm"])
    tau = np.asarray(m["curves.tau_mean_norm"])
    ls = np.arange(1, len(curve))
    scale = np.exp(np.mean(np.log(curve[1:]) - 0.5 * np.log(ls)))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, log in zip(axes, (False, True)):
        ax.plot(ls, curve[1:], color="tab:purple", lw=2,
                label=f"BN after the branch (fitted exponent {m['bn_norm_growth_exponent']:.3f})")
        ax.plot(ls, scale * np.sqrt(ls), "k--", lw=1, label=f"sqrt(l) guide ({scale:.3g} sqrt(l))")
        ax.plot(ls, tau[1:], color="tab:green", lw=1.5, label="no BN, tau = 1/sqrt(L) (same draws)")
        ax.axhline(curve[0], color="gray", ls=":", lw=1, label=f"|h_0| = {curve[0]:.3g}")
        ax.set_xlabel("block l")
        ax.set_ylabel("|h_l| (mean over inputs and draws)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        if log:
            from matplotlib.ticker import StrMethodFormatter

            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))  # blocks 1, 10, 100 (not 10^0)
            ax.set_title("log-log axes: slope = growth exponent")
        else:
            ax.set_title("linear axes")
    fig.suptitle(f"Zhang et al. (seed 003) Section 3.4, Proposition 1 / Fig. 2 (epoch 0): block output norm at "
                 f"initialisation, h_l = relu(h_(l-1) + BN(W_l h_(l-1))),\nwidth {config.width}, L = {config.depth}, "
                 f"batch {config.batch_size} MNIST-1D inputs (batch statistics), {common.plural(config.num_draws, 'draw')}")
    common.save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    common.main(__name__)
