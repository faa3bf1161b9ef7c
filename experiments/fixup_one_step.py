"""Fixup can blow up after a single gradient step; tau = 1/sqrt(L) does not (Zhang et al., seed 003,
Section 3.4, the Fixup paragraph, and Figure 2's Fixup curves).

The seed's argument: in the model h_l = relu(h_(l-1) + W_l h_(l-1)) with Fixup's W_l = 0 at
initialisation, every block is the identity, so every W_l receives the same gradient dh_(L-1) h_0^T;
after one step the blocks' product behaves like (D (I + eta dh h_0^T))^(L-1), which grows exponentially
in L. With tau = 1/sqrt(L) and Kaiming (He) initialisation the network stays stable at every depth.

What is run. Two models from ``resjax.nn.tau_resnet`` at each depth L in {10, 30, 100, 300, 1000}:
``'fixup'`` (W_l = 0, no tau: Fixup's branch multiplier starts at 1, "equivalent to set tau = 1"; A and B
drawn as in Allen-Zhu et al.) and ``'tau'`` with tau = 1/sqrt(L) (W_l ~ N(0, 2/m), Kaiming). Width 128.
One full-batch gradient-descent step of the mean cross-entropy over all 4,000 MNIST-1D training
examples, learning rate eta = 0.01 (the seed's training learning rate, Section 5.1) on every parameter
(A, every W_l, B and the head's bias); 3 seeds (initialisations), vmapped. The models are built with
``remat=True`` (``resjax.nn.residual.stack_blocks``): the gradient rematerialises the blocks in segments of
about sqrt(L), the same numbers as without it (bit for bit on CPU) in a fraction of the memory (4,000 examples
through 1,000 blocks with 3 seeds vmapped keep about 8 GB otherwise). Then the output norm |y_i|
(the logits) of every training input, before and after the step. After the step the network is still
positively homogeneous in h_0 (no biases but the head's), so |y| is computed in log space
(``resjax.analysis.stability.log_space_propagation``, exact, the head's bias included): an output
that overflows float32 still gets a finite log10.

Metrics: ``log10_output_norm_after_one_step.<init>.L<depth>`` (<init> in ``fixup``, ``tau``; median
over inputs and seeds of log10 |y_i|), ``log10_output_norm_at_init.<init>.L<depth>``, and the per-seed
values ``log10_output_norm_after_one_step_per_seed.<init>.L<depth>``.

Settings the seed leaves open, and what is used: the learning rate of the step (0.01, stated above;
``--learning_rate`` changes it: the growth rate per block is about eta times the top eigenvalue of the
shared gradient, so a smaller step needs a deeper network to show the same growth), full batch (the
seed says "one gradient update"), MNIST-1D, the depths (the experiment's three plus 30 and 300 for the
curve's shape).

``--quick`` (tests): width 16, depth 4, 2 seeds, 256 training examples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import common
from resjax.analysis.stability import log_space_propagation
from resjax.data import load_dataset
from resjax.nn.tau_mlp import tau_resnet

NAME = "fixup_one_step"
INITS = ("fixup", "tau")
COLOURS = {"fixup": "tab:red", "tau": "tab:green"}
LABELS = {"fixup": "Fixup (W_l = 0 at init, no tau)", "tau": "tau = 1/sqrt(L), Kaiming init"}
LN10 = float(np.log(10.0))


HELP = {
    "width": "width m of the networks (units per block)",
    "depths": "depths L (blocks), e.g. \"(10, 100, 1000)\"",
    "learning_rate": "learning rate eta of the one full-batch gradient step",
    "num_examples": "MNIST-1D training examples in the full batch (at most 4,000)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.width = 128
    c.depths = (10, 30, 100, 300, 1000)
    c.learning_rate = 0.01
    c.num_seeds = 3
    c.num_examples = 4000  # the full MNIST-1D training set: one full-batch step
    c.seed = 0
    if size == "quick":
        c.width, c.depths, c.num_seeds, c.num_examples = 16, (4,), 2, 256
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    if not config.learning_rate > 0:
        raise ValueError(f"learning_rate: must be > 0, got {config.learning_rate!r}")
    for d in config.depths:
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"depths: every depth must be an integer >= 1, got {d!r}")
    for name in ("width", "num_seeds", "num_examples"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {config[name]!r}")


def one_step(model, x, y, learning_rate: float):
    """``key -> (log |y_i| at init, log |y_i| after one full-batch GD step)``, both ``(N,)``. Build ``model`` with
    ``remat=True`` (as ``run`` does) for the step's gradient to rematerialise the blocks in segments: the same
    logits and gradient in a fraction of the memory."""

    def loss(params):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def run(key):
        params = model.init(key, x[:2])["params"]
        before = log_space_propagation(model, {"params": params}, x, backward=False)["log_output_norm"]
        grads = jax.grad(loss)(params)
        params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
        after = log_space_propagation(model, {"params": params}, x, backward=False)["log_output_norm"]
        return before, after

    return run


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    n = min(config.num_examples, len(data.y_train))
    x, y = jnp.asarray(data.x_train[:n]), jnp.asarray(data.y_train[:n])
    keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)
    m: dict = {"num_examples": n}
    for depth in config.depths:
        for init in INITS:
            model = tau_resnet(init, config.width, depth, data.num_classes, tau="1/sqrt(L)", remat=True)
            before, after = jax.device_get(jax.jit(jax.vmap(one_step(model, x, y, config.learning_rate)))(keys))
            before, after = np.asarray(before, np.float64) / LN10, np.asarray(after, np.float64) / LN10
            m[f"log10_output_norm_at_init.{init}.L{depth}"] = float(np.median(before))
            m[f"log10_output_norm_after_one_step.{init}.L{depth}"] = float(np.median(after))
            m[f"log10_output_norm_after_one_step_per_seed.{init}.L{depth}"] = np.median(after, axis=1)
    plot(m, config, out_dir / f"{NAME}.png")
    return m


# ---- claims ----------------------------------------------------------------------------------------


def _depths(m: dict) -> list[int]:
    return sorted(int(k.rsplit(".L", 1)[1]) for k in m if k.startswith("log10_output_norm_after_one_step.fixup."))


def _after(m: dict, init: str) -> dict[int, float]:
    return {d: m[f"log10_output_norm_after_one_step.{init}.L{d}"] for d in _depths(m)}


def _fmt(values: dict) -> str:
    return ", ".join(f"L={d}: {v:.2f}" for d, v in values.items())


def _fixup_grows(after: dict) -> bool | None:
    """The claim on the issue's depths 10, 100, 1000 (the extra depths 30 and 300 only shape the curve)."""
    main = [d for d in (10, 100, 1000) if d in after]
    if len(main) < 2:
        return None
    values = [after[d] for d in main]
    return all(a < b for a, b in zip(values, values[1:])) and values[-1] - values[0] > 1


SRC = "003 Zhang et al., Section 3.4 (Fixup) / Figure 2"
CLAIMS = [
    common.Claim("Fixup (W_l = 0 at init): after one gradient step the output norm grows with depth "
                 "(log10 |y| increases over the issue's depths 10 < 100 < 1000 and gains more than 1 from 10 to "
                 "1000; every measured depth is shown)", SRC,
                 "grows exponentially with depth",
                 lambda m: _fmt(_after(m, "fixup")),
                 lambda m: _fixup_grows(_after(m, "fixup"))),
    common.Claim("tau = 1/sqrt(L) with Kaiming init: after one gradient step the output norm stays stable across "
                 "depth (log10 |y| within 0.5 of its value at the shallowest depth)", SRC, "stable for varying depths",
                 lambda m: _fmt(_after(m, "tau")),
                 lambda m: all(abs(v - _after(m, "tau")[_depths(m)[0]]) <= 0.5 for v in _after(m, "tau").values())),
]


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    depths = _depths(m)
    fig, ax = plt.subplots(figsize=(7.5, 5.8))
    for init in INITS:
        ax.plot(depths, [m[f"log10_output_norm_after_one_step.{init}.L{d}"] for d in depths], "o-",
                color=COLOURS[init], lw=2, label=f"{LABELS[init]}: after one step")
        ax.plot(depths, [m[f"log10_output_norm_at_init.{init}.L{d}"] for d in depths], "s:",
                color=COLOURS[init], alpha=0.6, label=f"{LABELS[init]}: at initialisation")
        for d in depths:
            per_seed = m[f"log10_output_norm_after_one_step_per_seed.{init}.L{d}"]
            ax.scatter([d] * len(per_seed), per_seed, color=COLOURS[init], s=8, alpha=0.5)
    top = max(max(m[f"log10_output_norm_after_one_step_per_seed.{i}.L{d}"]) for i in INITS for d in depths)
    if top > 30:  # only where it is near: the log-space pass goes beyond it
        ax.axhline(np.log10(np.finfo(np.float32).max), color="gray", ls="--", lw=1, label="float32 overflow")
    if len(depths) > 1:
        ax.set_xscale("log")
    else:  # one depth: a linear axis around it, not a log decade with no tick at the depth
        ax.set_xlim(depths[0] - 1, depths[0] + 1)
    ax.set_xticks(depths, [str(d) for d in depths])  # the depths that ran, as integers
    ax.minorticks_off()
    ax.set_xlabel("depth L (residual blocks)")
    ax.set_ylabel("log10 |y| (output norm of the logits, median over\ninputs and seeds; dots: median of each seed)")
    ax.set_title(f"Zhang et al. (seed 003) Sec. 3.4 / Fig. 2: output norm after one full-batch GD step\n"
                 f"(cross-entropy, MNIST-1D, {m['num_examples']} examples, lr {config.learning_rate:g}, width "
                 f"{config.width}, {common.plural(config.num_seeds, 'seed')})", fontsize=10)
    ax.grid(alpha=0.3)
    common.legend_outside(ax)
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
