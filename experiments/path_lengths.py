"""Path lengths: the exact path expansion of residual Jacobians, path counts, and how much gradient each
path length carries (lecture 000, "Gradients through the identity", "Expanding the product", "Paths
through two blocks", "Unravelled paths", "Path lengths", "Reading the path lengths").

What the lecture states, reproduced from ``resjax.analysis.paths``:

- the product ``(I + J_K) ... (I + J_1)`` expands into 2^K terms, C(K, m) of them through exactly m
  branches; the three-block TRY has 3 terms through one branch and 3 through two;
- for 54 blocks, the central band holding half of all paths is 25 to 29 branches, and the lengths Veit
  et al. found carry most of the gradient (5 to 17) hold 0.45% of the paths;
- in the gradient the decomposition is exact: the sum over lengths m of ``E_m`` (the sum of the C(K, m)
  path terms, by the recursion ``E_m(k) = E_m(k-1) + J_k E_{m-1}(k-1)``) equals the full Jacobian
  (``expansion_rel_error``: ``|sum_m E_m - d x_K/d x_0| / sum_m |E_m|``, Frobenius; relative to the
  terms because unscaled 54-block products are large).

Beyond the lecture: how much gradient each length carries, measured two ways in pre-activation residual
MLPs (stem 40 -> 64, K one-layer branches BN -> ReLU -> linear, head 64 -> 10, the degradation
experiment's ``residual_bn_d32`` family), at ``num_examples`` MNIST-1D test inputs:

- exact: ``|E_m^T u|`` with ``u = dL/dx_K`` the cross-entropy gradient at the stream's end, i.e. the part of
  the backpropagated gradient at ``x_0`` carried by all paths of length m together. Signed terms: paths
  of one length can cancel. Shares are ``|E_m^T u| / sum_m' |E_m'^T u|`` per example, then averaged over
  examples (``gradient_share_by_length.<case>``; an example whose loss gradient is exactly zero, a
  saturated softmax, is left out: ``examples_used.<case>``); ``cancellation.<case>`` is ``|sum_m E_m^T u| / sum_m
  |E_m^T u|`` (1: no cancellation between lengths). The forward form ``|E_m v|`` for a random unit
  ``v`` is ``gradient_share_by_length_forward.<case>``;
- Veit et al. (2016): the mean magnitude ``|P^T u|`` of a single path P of length m (``veit_samples``
  random subsets of m blocks per length, their Jacobians multiplied, identity elsewhere) times C(K, m),
  normalised the same way (``gradient_share_by_length_veit.<case>``). Magnitudes, so no cancellation.

Cases: ``init_bn`` (``num_blocks`` = 54 blocks with BatchNorm, at initialisation), ``init_nonorm`` (the
same without normalisation), ``before_training`` and ``after_training`` (the depth-32 residual +
BatchNorm network of the degradation experiment, ``residual_bn_d32``, at its initialisation and after
``train.epochs`` epochs of SGD at learning rate 0.005, batch 100, one seed, trained with
``resjax.train.make_train``; ``model.num_blocks`` = 32).

Choices the lecture leaves open:

- BatchNorm is evaluated in evaluation mode, so each example has its own Jacobian (in training mode the
  batch statistics couple the examples). At initialisation the running estimates are still mean 0,
  variance 1, which would make BatchNorm the identity and the network the un-normalised one; so for the
  ``init_bn*`` cases the running estimates are set to the statistics of the whole training set under
  the initial parameters (what training mode normalises by at step 0, per layer). The trained network
  uses its own running estimates.
- ``train.epochs`` = 300, the lecture's "Training at depth 32" length, so the trained network is the one
  whose 1.2% training error the lecture reports (about 30 s on a 2-core CPU). ``--quick`` trains 1 epoch. The
  network is evaluated after the last epoch only (``train.eval_every`` = epochs): only its final errors are
  reported, and evaluating the 5,000 examples after every epoch was about a third of the training time (31.8 s
  of training before, 21.6 s after, on a loaded 2-core CPU).
- Scalar summaries per case: ``effective_path_length[_veit].<case>`` (the mean length under the share
  distribution), ``gradient_share_5_to_17[_veit].<case>`` (the share carried by Veit et al.'s 5 to 17
  band) and ``gradient_half_band[_veit].<case>`` (the shortest run of lengths holding half the share).
- ``expansion_seconds``: one ``num_blocks``-block (54), ``width`` (64) example, dense block Jacobians by ``jax.jacfwd`` plus the
  expansion by length, jitted, after compilation (``expansion_compile_seconds``: the first call);
  ``expansion_jvp_seconds``: the matrix-free form on one vector.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import checkpoints, common
from experiments.degradation import CONFIGS
from resjax.analysis import paths
from resjax.data import load_dataset
from resjax.nn import build_model
from resjax.nn.norms import BATCHNORM_DEFAULTS
from resjax.train import make_train, run_config, train_config

NAME = "path_lengths"
LECTURE_K = 54
VEIT_BAND = (5, 17)
CASES = ("init_bn", "init_nonorm", "before_training", "after_training")


HELP = {
    "num_blocks": "blocks K of the at-initialisation networks and of the path counts (the lecture's 54)",
    "width": "width of the at-initialisation networks (units per layer)",
    "num_examples": "MNIST-1D test inputs at which each length's share of the gradient is measured",
    "veit_samples": "random paths per length for Veit et al.'s single-path estimate",
    "model.kind": "the trained network's kind ('residual_mlp'; the degradation experiment's residual_bn_d32)",
    "model.width": "the trained network's width (units per layer)",
    "model.num_blocks": "the trained network's residual blocks (the lecture's 32)",
    "model.order": "the trained network's block form: 'pre' (BN -> ReLU -> linear, added) or 'post'",
    "model.norm": "the trained network's normalisation: 'batch', 'layer', 'group' or 'none'",
    "train.eval_every": "evaluate the trained network after every k-th epoch and after the last (default: "
                        "train.epochs, the last only: only its final errors are reported)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.num_blocks = LECTURE_K
    c.width = 64
    c.num_examples = 16
    c.veit_samples = 128
    # the trained network: the degradation experiment's depth-32 residual + BatchNorm network and its training
    c.model = ml_collections.ConfigDict({**CONFIGS["residual_bn_d32"], "width": 64})
    c.train = train_config(epochs=300, learning_rate=0.005, batch_size=100, checkpoint_every=100)  # a save per chunk
    c.seed = 0
    if size == "quick":
        c.num_blocks, c.width, c.num_examples, c.veit_samples = 10, 8, 2, 8
        c.model.num_blocks, c.model.width, c.train.epochs = 4, 8, 1
    elif size == "full":
        c.num_examples, c.veit_samples = 64, 512
    # only the trained network's final errors are reported: evaluate after the last epoch (the training is the same)
    c.train.eval_every = c.train.epochs
    return c


# ---- claims ------------------------------------------------------------------------------------------

SRC = "000 lecture, Expanding the product / Path lengths"


def _band(m: dict, key: str) -> str:
    lo, hi = m[key]
    return f"{lo} to {hi}"


CLAIMS = [
    common.Claim("three-block TRY: terms through exactly one branch, exactly two", SRC, "3, 3",
                 lambda m: f"{m['try_three_blocks.one_branch']}, {m['try_three_blocks.two_branches']}",
                 lambda m: (m["try_three_blocks.one_branch"], m["try_three_blocks.two_branches"]) == (3, 3)),
    common.Claim("54 blocks: central band of path lengths holding half of all paths", SRC, "25 to 29",
                 lambda m: f"{_band(m, 'central_half_band')} ({100 * m['central_half_band_share']:.1f}% of paths)",
                 lambda m: list(m["central_half_band"]) == [25, 29]),
    common.Claim("54 blocks: share of paths through 5 to 17 branches (Veit et al.'s band)", SRC, "0.45%",
                 lambda m: f"{100 * m['share_of_paths_5_to_17']:.2f}%",
                 lambda m: round(100 * m["share_of_paths_5_to_17"], 2) == 0.45),
    common.Claim("the path decomposition of the gradient is exact: |sum_m E_m - full Jacobian| / sum_m |E_m|, "
                 "K blocks, every case, float32", "000 lecture, Unravelled paths", "exact (float32 rounding, < 1e-4)",
                 lambda m: f"{m['expansion_rel_error']:.1e}", lambda m: m["expansion_rel_error"] < 1e-4),
    common.Claim("gradient travels through paths much shorter than the network: mean path length carrying the "
                 "gradient (Veit et al.'s measure) in the K-block BN network at init, against the paths' mean K/2",
                 "000 lecture, Reading the path lengths", "shorter (Veit: 5 to 17 of 54)",
                 lambda m: f"{m['effective_path_length_veit.init_bn']:.1f} of K = {m['num_blocks']} "
                           f"(exact sum: {m['effective_path_length.init_bn']:.1f})",
                 lambda m: m["effective_path_length_veit.init_bn"] < m["num_blocks"] / 2),
    common.Claim("same, trained depth-32 residual + BN network (degradation's residual_bn_d32)",
                 "000 lecture, Reading the path lengths", "shorter",
                 lambda m: f"{m['effective_path_length_veit.after_training']:.1f} of K = {m['trained_num_blocks']} "
                           f"(exact sum: {m['effective_path_length.after_training']:.1f})",
                 lambda m: m["effective_path_length_veit.after_training"] < m["trained_num_blocks"] / 2),
]


def report_section(m: dict) -> str:
    lines = ["How much gradient each path length carries (beyond the lecture; shares sum to 1 over lengths).",
             "", "| case | K | exact: mean length | exact: half band | exact: share in 5-17 | Veit: mean length "
             "| Veit: half band | Veit: share in 5-17 | cancellation |", "|---" * 9 + "|"]
    for case in CASES:
        if f"effective_path_length.{case}" not in m:
            continue
        k = len(m[f"gradient_share_by_length.{case}"]) - 1
        lines.append(
            f"| {case} | {k} | {m[f'effective_path_length.{case}']:.1f} | {_band(m, f'gradient_half_band.{case}')} "
            f"| {100 * m[f'gradient_share_5_to_17.{case}']:.1f}% | {m[f'effective_path_length_veit.{case}']:.1f} "
            f"| {_band(m, f'gradient_half_band_veit.{case}')} | {100 * m[f'gradient_share_5_to_17_veit.{case}']:.1f}% "
            f"| {m[f'cancellation.{case}']:.3f} |")
    lines += ["", f"Expansion of one {m['num_blocks']}-block, width-{m['width']} example (dense Jacobians + recursion): "
              f"{1e3 * m['expansion_seconds']:.1f} ms after a {m['expansion_compile_seconds']:.1f} s compile; "
              f"matrix-free JVP form on one vector: {1e3 * m['expansion_jvp_seconds']:.2f} ms. Trained network: "
              f"{m['train_epochs']} epochs, training error {m['trained_train_error_pct']:.2f}%. Examples used per "
              "case (a zero loss gradient, a saturated softmax, is left out): "
              + ", ".join(f"{c} {m[f'examples_used.{c}']}" for c in CASES if f"examples_used.{c}" in m) + "."]
    return "\n".join(lines)


# ---- measurements ------------------------------------------------------------------------------------


def _model(config, num_blocks: int, norm: str):
    return build_model(kind="residual_mlp", width=config.width, num_blocks=num_blocks, order="pre", norm=norm,
                       num_classes=10)


def calibrate_batch_stats(model, variables: dict, x) -> dict:
    """Running estimates set to the batch statistics of ``x`` under the current parameters (per layer).

    One training-mode pass from zeroed estimates leaves ``(1 - momentum) * batch statistic``; dividing by
    ``1 - momentum`` recovers the statistic itself.
    """
    if not variables.get("batch_stats"):
        return variables
    zeroed = jax.tree_util.tree_map(jnp.zeros_like, variables["batch_stats"])
    _, upd = model.apply({**variables, "batch_stats": zeroed}, x, train=True, mutable=["batch_stats"])
    rate = 1.0 - BATCHNORM_DEFAULTS["momentum"]
    return {**variables, "batch_stats": jax.tree_util.tree_map(lambda a: a / rate, upd["batch_stats"])}


def _normalise(a):
    return a / jnp.sum(a, axis=-1, keepdims=True)


_PROGRAMS: dict = {}


def _program(model, variables):
    """One jitted, example-vmapped measurement per network structure (so before/after training share it)."""
    key = (model.num_blocks, model.width, model.norm, jax.tree_util.tree_structure(variables))
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    branch = paths.residual_stack_of(model, variables).branch  # the module's own blocks; values come as arguments
    num = model.num_blocks
    counts = np.array(paths.path_counts(num), dtype=np.float64)
    rel_counts = jnp.asarray(counts / counts.max(), jnp.float32)  # C(54, 27) = 2e15: scale before multiplying

    def one(thetas, head, masks, x0, y, v):
        stack = paths.BranchStack(branch, thetas, num)
        jac, xs = paths.block_jacobians(stack, x0)
        terms = paths.expand_by_length(jac)
        loss = lambda h: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            nn.Dense(head["kernel"].shape[-1]).apply({"params": head}, h), y)
        u = jax.grad(loss)(xs[-1])
        back = paths.contributions_by_length(terms, u, transpose=True)
        fwd = paths.contributions_by_length(terms, v)
        mags = paths.path_magnitudes(jac, u, masks, transpose=True)
        full = jax.jacfwd(lambda z: paths.trajectory(stack, z)[-1])(x0)
        return {
            "exact": _normalise(back), "forward": _normalise(fwd), "veit": _normalise(mags * rel_counts),
            "cancellation": jnp.linalg.norm(jnp.einsum("mji,j->i", terms, u)) / jnp.sum(back),
            "rel_error": paths.expansion_rel_error(terms, full),
        }

    _PROGRAMS[key] = jax.jit(jax.vmap(one, in_axes=(None, None, None, 0, 0, 0)))
    return _PROGRAMS[key]


def measure_case(model, variables, x, y, rng: np.random.Generator, veit_samples: int) -> dict:
    """Per-length gradient shares (exact and Veit), cancellation and exactness at each example.

    The random paths (``veit_samples`` per length, shared by the examples) and the random unit vectors of
    the forward form come from ``rng``.
    """
    num = model.num_blocks
    stack = paths.residual_stack_of(model, variables)
    x0 = paths.stream_input(model, variables, x)
    ranks = np.argsort(np.argsort(rng.random((num + 1, veit_samples, num)), -1), -1)
    masks = ranks < np.arange(num + 1)[:, None, None]
    v = rng.standard_normal(x0.shape).astype(np.float32)
    v /= np.linalg.norm(v, axis=-1, keepdims=True)
    out = _program(model, variables)(stack.thetas, variables["params"]["head"], masks, x0, jnp.asarray(y), v)
    return {k: np.asarray(val) for k, val in out.items()}


def _band_of(shares) -> list[int]:
    """The shortest run of lengths holding half of a share distribution."""
    s = np.asarray(shares, float)
    best = None
    for lo in range(len(s)):
        c = np.cumsum(s[lo:])
        hit = np.nonzero(c >= 0.5 - 1e-12)[0]
        if hit.size and (best is None or hit[0] < best[1] - best[0] or
                         (hit[0] == best[1] - best[0] and c[hit[0]] > s[best[0]:best[1] + 1].sum())):
            best = (lo, lo + int(hit[0]))
    return list(best)


def _summaries(out: dict, case: str, res: dict) -> None:
    m = np.arange(res["exact"].shape[1])
    # An example whose loss gradient is exactly zero (a saturated softmax, e.g. the un-normalised network's
    # logits of order 1e8) has no shares (0/0): it is left out, and the count of examples used is recorded.
    used = np.all(np.isfinite(res["exact"]), axis=1)
    out[f"examples_used.{case}"] = int(used.sum())
    for suffix, key in (("", "exact"), ("_veit", "veit"), ("_forward", "forward")):
        share = res[key][used].mean(0)
        out[f"gradient_share_by_length{suffix}.{case}"] = share
        if key == "forward":
            continue
        out[f"effective_path_length{suffix}.{case}"] = float(np.sum(m * share))
        out[f"gradient_half_band{suffix}.{case}"] = _band_of(share)
        lo, hi = VEIT_BAND
        out[f"gradient_share_5_to_17{suffix}.{case}"] = float(share[lo:hi + 1].sum())
    out[f"cancellation.{case}"] = float(res["cancellation"][used].mean())
    out[f"expansion_rel_error.{case}"] = float(res["rel_error"].max())


def time_expansion(width: int, num_blocks: int = LECTURE_K, seed: int = 0) -> dict:
    """Wall time of the dense expansion by length (and of the JVP form) for one example."""
    model = build_model(kind="residual_mlp", width=width, num_blocks=num_blocks, order="pre", norm="batch")
    batch = jax.random.normal(jax.random.key(seed), (256, 40))
    x = batch[:1]
    variables = calibrate_batch_stats(model, model.init(jax.random.key(seed), x), batch)
    stack = paths.residual_stack_of(model, variables)
    x0 = paths.stream_input(model, variables, x)[0]
    dense = jax.jit(lambda z: paths.expand_by_length(paths.block_jacobians(stack, z)[0]))
    jvp = jax.jit(lambda z, v: paths.expand_jvp(stack, z, v))
    t = time.perf_counter()
    jax.block_until_ready(dense(x0))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(dense(x0))
    dense_s = (time.perf_counter() - t) / 3
    jax.block_until_ready(jvp(x0, x0))
    t = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(jvp(x0, x0))
    return {"expansion_seconds": dense_s, "expansion_compile_seconds": compile_s,
            "expansion_jvp_seconds": (time.perf_counter() - t) / 3}


def train_network(config, data):
    """The depth-32 residual + BatchNorm network of the degradation experiment: (init vars, trained vars, metrics)."""
    trainer = make_train(run_config(config.model, config.train, config.data), data)
    key = jax.random.key(config.seed)
    init_state = trainer.init(key).state
    run, metrics = checkpoints.sweep(trainer, key[None], cell="path_lengths", chunk_epochs=min(config.train.epochs, 100),
                                     progress="path_lengths")
    trained = run.select(0).state  # one program for every leaf (RunState.select)
    return trainer.model, init_state.variables(), trained.variables(), metrics


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): integer sizes, the trained network's model and train config, its batch size within the training examples."""
    for name in ("num_blocks", "width", "num_examples", "veit_samples"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {config[name]!r}")
    data = common.load_data(config)
    common.check_train(config.train, len(data.y_train))
    common.build_models([config.model], data.num_classes)


def run(config, out_dir) -> dict:
    check(config)
    out: dict = {"num_blocks": config.num_blocks, "trained_num_blocks": config.model.num_blocks,
                 "width": config.width, "train_epochs": config.train.epochs}
    k = config.num_blocks
    # Counting (exact integers).
    counts3 = paths.path_counts(3)
    out["try_three_blocks.path_counts"] = counts3
    out["try_three_blocks.one_branch"], out["try_three_blocks.two_branches"] = counts3[1], counts3[2]
    out["central_half_band"] = list(paths.central_band(LECTURE_K))
    out["central_half_band_share"] = paths.share_of_paths(LECTURE_K, *out["central_half_band"])
    out["share_of_paths_5_to_17"] = paths.share_of_paths(LECTURE_K, *VEIT_BAND)
    out["path_share_by_length"] = paths.path_length_shares(k)

    start = time.time()
    out.update(time_expansion(config.width, k, config.seed))
    print(f"path_lengths: {k}-block width-{config.width} expansion {1e3 * out['expansion_seconds']:.1f} ms "
          f"(compile {out['expansion_compile_seconds']:.1f} s, JVP form {1e3 * out['expansion_jvp_seconds']:.2f} ms)",
          flush=True)

    data = load_dataset(config.data)
    x_cal = jnp.asarray(data.x_train)
    x, y = jnp.asarray(data.x_test[:config.num_examples]), np.asarray(data.y_test[:config.num_examples])
    key = jax.random.key(config.seed)
    rng = np.random.default_rng(config.seed)
    for case, norm in (("init_bn", "batch"), ("init_nonorm", "none")):
        model = _model(config, k, norm)
        variables = calibrate_batch_stats(model, model.init(jax.random.fold_in(key, 54), x), x_cal)
        _summaries(out, case, measure_case(model, variables, x, y, rng, config.veit_samples))

    t = time.time()
    model, init_vars, trained_vars, metrics = train_network(config, data)
    out["train_seconds"] = time.time() - t
    out["trained_train_error_pct"] = float(100 * metrics["train_error"][0, -1])
    out["trained_test_error_pct"] = float(100 * metrics["test_error"][0, -1])
    for case, variables in (("before_training", calibrate_batch_stats(model, init_vars, x_cal)),
                            ("after_training", trained_vars)):
        _summaries(out, case, measure_case(model, variables, x, y, rng, config.veit_samples))
    out["expansion_rel_error"] = max(v for n, v in out.items() if n.startswith("expansion_rel_error."))
    out["measure_seconds"] = time.time() - start - out["train_seconds"]
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(17, 6.6), gridspec_kw={"width_ratios": [0.55, 1.4, 1.2]})
    # (a) the eight paths through three blocks.
    ax = axes[0]
    rows = sorted(range(8), key=lambda s: (bin(s).count("1"), s))
    for r, s in enumerate(rows):
        for b in range(3):
            on = bool(s >> b & 1)
            ax.plot(b + 1, -r, "o", ms=11, color="tab:blue" if on else "white", mec="tab:blue")
        ax.text(3.6, -r, f"m = {bin(s).count('1')}", va="center", fontsize=8)
    ax.set_xlim(0.5, 4.4)
    ax.set_xticks([1, 2, 3])
    ax.set_yticks([])
    ax.set_xlabel("block")
    ax.set_title("Paths through 3 blocks\n(lecture, seed 000, fig.\n'Path lengths', left;\nfilled: branch)", fontsize=9)
    for sp in ("top", "right", "left"):
        ax.spines[sp].set_visible(False)

    def panel(ax, k, cases, title, names):
        lengths = np.arange(k + 1)
        share = np.asarray(paths.path_length_shares(k))
        lo, hi = paths.central_band(k)
        ax.bar(lengths, share, color=["tab:orange" if lo <= i <= hi else "lightgray" for i in lengths], width=0.85,
               label=f"paths C({k}, m)/2^{k}; orange: central band {lo}-{hi} (half of all paths)")
        if k == LECTURE_K:
            ax.axvspan(VEIT_BAND[0] - 0.5, VEIT_BAND[1] + 0.5, color="tab:green", alpha=0.12,
                       label=f"Veit et al.'s 5-17 ({100 * paths.share_of_paths(k, *VEIT_BAND):.2f}% of paths)")
        styles = {"exact": ("-", "exact |E_m^T dL/dx_K|"), "veit": ("--", "Veit: path magnitude x C(K, m)")}
        for case, colour in cases:
            for key, suffix in (("exact", ""), ("veit", "_veit")):
                name = f"gradient_share_by_length{suffix}.{case}"
                if name in m:
                    ls, what = styles[key]
                    ax.plot(lengths, m[name], ls, color=colour, lw=1.6, marker=".", ms=4, label=f"{names[case]}: {what}")
        ax.set_xlabel("path length m (branches passed through)")
        ax.set_ylabel("share of paths (bars) / share of gradient (lines)")
        ax.set_xlim(-0.5, k + 0.5)
        common.integer_ticks(ax)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        common.legend_outside(ax, ncol=1)

    k = config.num_blocks
    panel(axes[1], k, [("init_bn", "tab:blue"), ("init_nonorm", "tab:red")],
          f"Path lengths, {k} blocks (lecture, seed 000, fig. 'Path lengths', right)\n"
          f"+ gradient share per length at init: residual MLP width {config.width},\n"
          f"{common.plural(config.num_examples, 'MNIST-1D test input')}, Veit's estimate from "
          f"{common.plural(config.veit_samples, 'random path')} per length",
          {"init_bn": "at init, BatchNorm", "init_nonorm": "at init, no normalisation"})
    kt, epochs = config.model.num_blocks, common.plural(config.train.epochs, "epoch")
    norm = {"batch": "BatchNorm", "none": "no normalisation", "layer": "LayerNorm"}.get(config.model.norm,
                                                                                      f"norm {config.model.norm}")
    panel(axes[2], kt, [("before_training", "tab:blue"), ("after_training", "tab:purple")],
          f"Beyond the lecture: {kt}-block residual MLP ({norm}, width {config.model.width}),\n"
          f"at init and after {epochs} of {common.describe_optimizer(config.train)}, batch {config.train.batch_size}\n"
          f"(final training error {m['trained_train_error_pct']:.1f}%)",
          {"before_training": "at init", "after_training": f"after {epochs}"})
    fig.suptitle("Unravelled paths: how many paths have each length, and how much gradient each length carries")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
