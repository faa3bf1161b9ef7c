"""The MNIST-1D paper's model table (Greydanus 2020; the ``mnist1d`` package's README, "benchmarks"): test accuracy
of logistic regression, an MLP, a CNN and a GRU on MNIST-1D, and on MNIST-1D with its positions shuffled, plus
resjax's residual MLP and 1-D ResNet at the reference models' sizes.

Published test accuracies (%), normal / shuffled: logistic 32 / 32, MLP 68 / 68, CNN 94 / 56, GRU 91 / 57.

Settings the paper states (its reference recipe, the repository's ``notebooks/train.py`` and models): Adam at
learning rate 1e-2, no weight decay, batch 100, 6,000 steps, evaluation every 250 steps, batches in a fixed order
(step ``s`` takes examples ``(100 s) mod 4000 ...``: ``train.shuffle=False``, ``resjax.train.config``'s step runs);
the reference models (``resjax.nn.reference``: ``logistic``, ``reference_mlp`` of width 100, ``reference_cnn`` of 25
channels, ``reference_gru`` bidirectional of hidden size 6), PyTorch's default initialisation; the shuffled rows
permute the 40 positions of every example, train and test, by one fixed permutation
(``load_mnist1d(shuffle_length=True)``, seed 0: see ``resjax.data.mnist1d``).

Settings the paper leaves open, and what is used:

- the data: the ``mnist1d`` package's generator with its default arguments (``load_mnist1d()``), 4,000 / 1,000
  examples; the published numbers came from the repository's data file of the same arguments;
- which accuracy: the test accuracy after the last step (6,000), not the best over the evaluations (the curves are
  in the results, ``curves.<row>.<data>.test_accuracy``);
- seeds: 3 per row (initialisation only: the batch order is fixed), one vmapped program per row and data set;
  seeds ``split(key(0), 3)``;
- the GRU: PyTorch's cell (``resjax.nn.TorchGRUCell``: two biases per gate, torch's initialisation, 5,134
  parameters as the reference has; ``resjax.nn.reference``). Until 2026-12-08 it was flax's ``GRUCell`` (no
  hidden-side bias on the reset and update gates, 5,110 parameters), which ``dict(kind='reference_gru',
  cell='flax')`` still builds;
- the CNN's flattening is channels-last (its head's weights a permutation of PyTorch's);
- resjax's own rows, beyond the paper, at the reference models' sizes: ``residual_mlp`` (pre-activation, BatchNorm,
  2 blocks of 2 linear layers at width 54: 14,968 parameters, the reference MLP's 15,210 within 2%) and
  ``resnet1d`` (``small_resnet1d(width=7)``: three stages of one basic block, BatchNorm, post order: 5,225
  parameters, the reference CNN's 5,210 within 0.3%), trained by the same recipe.

Tolerance rule, written before any run at this size: a published accuracy P of a row (model, data) holds when the
mean m of the 3 seeds' final test accuracies satisfies ``|m - P| <= max(2.5 s, 2)`` percentage points, s the
seeds' sample standard deviation (ddof 1). The published value is one run of other code (its own seed noise about
s; the mean of 3 adds s / sqrt(3): 2.5 s is about two standard deviations of the difference), and the floor of 2
points covers what the seed spread cannot show: the 1,000 test examples are shared by every seed (binomial standard
deviation about 1.4 points at 70%) and the repository's data file need not equal the regenerated set bit for bit.
The rule is not adjusted after the run; a row outside it is reported as it came out.

The other claims: CNN > MLP > logistic on normal data (means), and the CNN's advantage gone on shuffled data
(the shuffled CNN's mean no higher than the shuffled MLP's, where on normal data it is above it).

Measured at the default size (2026-12-08, PyTorch's GRU cell, a shared 2-core CPU, 1,028 s, the cells two side by
side): all 10 claims hold. Test accuracy, mean +- std of 3 seeds, normal / shuffled: logistic 31.3 +- 0.1 / 31.3 +-
0.0, MLP 63.8 +- 2.3 / 65.0 +- 2.3, CNN 93.1 +- 0.9 / 59.8 +- 1.8, GRU 91.3 +- 1.0 / 53.7 +- 3.4; residual MLP 64.5
+- 1.8 / 67.9 +- 1.7, 1-D ResNet 97.7 +- 0.2 / 54.7 +- 1.1 (every row but the GRU's the same as the run of
2026-12-06). The shuffled GRU holds by its seeds' spread: its mean is 3.3 points under the published 57, its seeds
57.6, 52.1 and 51.5, and the tolerance 2.5 x 3.4 = 8.4 points. With flax's cell (2026-12-06) it was 49.2 +- 0.7,
outside its tolerance of 2.0; on two other permutations of the positions (``default_rng(1)``, ``default_rng(2)``)
flax's cell gave 49.3 and 52.0. A shuffled row depends on which permutation of the positions it is (the paper's
came from numpy's global state, resjax's is seed 0), which the seeds' spread does not show. Nothing was changed
after the run.

``--quick``: 100 steps evaluated every 50, 2 seeds, logistic, MLP and CNN only (a pipeline check, not a
reproduction).

Metrics: ``test_accuracy.<row>.<data>`` (per seed, %, after the last step; ``<data>``: ``normal``, ``shuffled``),
``tolerance.<row>.<data>`` (points), ``params.<row>``, ``seconds.<row>.<data>`` (the cell's wall time, side by
side with the others), ``curves.<row>.<data>.test_accuracy`` (per seed, per evaluation) and ``eval_steps``.
"""

from __future__ import annotations

import time

import jax
import ml_collections
import numpy as np

from experiments import checkpoints, common
from resjax.data import load_mnist1d
from resjax.nn import build_model
from resjax.train import make_train, run_config, train_config

NAME = "mnist1d_models"

#: Each row's model (``build_model`` fields); the first four are the paper's.
MODELS = {
    "logistic": dict(kind="logistic"),
    "mlp": dict(kind="reference_mlp"),
    "cnn": dict(kind="reference_cnn"),
    "gru": dict(kind="reference_gru"),
    "residual_mlp": dict(kind="residual_mlp", width=54, num_blocks=2, num_layers=2, order="pre", norm="batch"),
    "resnet1d": dict(kind="small_resnet1d", width=7),
}
#: The published test accuracies (%), (normal, shuffled).
PUBLISHED = {"logistic": (32.0, 32.0), "mlp": (68.0, 68.0), "cnn": (94.0, 56.0), "gru": (91.0, 57.0)}
DATA = ("normal", "shuffled")
DATA_NAMES = {"normal": "mnist1d", "shuffled": "mnist1d_shuffled"}  # resjax.data.load_dataset's names
TOLERANCE_FACTOR, TOLERANCE_FLOOR = 2.5, 2.0

HELP = {
    "models": f"the rows trained, each on normal and shuffled data, from {tuple(MODELS)}; the claims need the "
              "paper's four",
    "num_seeds": "seeds per row (initialisation; the batch order is fixed)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.train = train_config(optimizer="adam", learning_rate=1e-2, weight_decay=0.0, batch_size=100, steps=6000,
                           eval_every_steps=250, shuffle=False, checkpoint_every=4)  # a checkpoint every 1,000 steps
    c.num_seeds = 3
    c.seed = 0
    c.models = tuple(MODELS)
    if size == "quick":
        c.train.steps, c.train.eval_every_steps, c.num_seeds = 100, 50, 2
        c.models = ("logistic", "mlp", "cnn")
    return c


# ---- claims ------------------------------------------------------------------------------------------


def accuracies(m: dict, row: str, data: str) -> np.ndarray:
    return np.asarray(m[f"test_accuracy.{row}.{data}"], float)


def tolerance(values: np.ndarray) -> float:
    """The docstring's rule: ``max(2.5 s, 2)`` points, s the sample standard deviation of the seeds."""
    spread = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return max(TOLERANCE_FACTOR * spread, TOLERANCE_FLOOR)


def within(m: dict, row: str, data: str) -> bool:
    published = PUBLISHED[row][DATA.index(data)]
    return bool(abs(np.mean(accuracies(m, row, data)) - published) <= m[f"tolerance.{row}.{data}"])


def _measured(m: dict, row: str, data: str) -> str:
    a = accuracies(m, row, data)
    return f"{np.mean(a):.1f} +- {np.std(a, ddof=1) if len(a) > 1 else 0.0:.1f} (tol. {m[f'tolerance.{row}.{data}']:.1f})"


def _means(m: dict, data: str, rows) -> list[float]:
    return [float(np.mean(accuracies(m, r, data))) for r in rows]


SRC = "MNIST-1D (Greydanus 2020), README benchmarks table"


def _row_claim(row: str, data: str) -> common.Claim:
    published = PUBLISHED[row][DATA.index(data)]
    return common.Claim(f"{row.upper() if row != 'logistic' else 'logistic regression'} test accuracy (%), {data} "
                        "data, mean +- std of 3 seeds, within max(2.5 std, 2) points of the published value", SRC,
                        f"{published:.0f}", lambda m: _measured(m, row, data), lambda m: within(m, row, data))


CLAIMS = [_row_claim(row, data) for data in DATA for row in PUBLISHED] + [
    common.Claim("CNN > MLP > logistic regression on normal data (mean test accuracy)", SRC, "94 > 68 > 32",
                 lambda m: " > ".join(f"{v:.1f}" for v in _means(m, "normal", ("cnn", "mlp", "logistic"))),
                 lambda m: bool(np.all(np.diff(_means(m, "normal", ("cnn", "mlp", "logistic"))) < 0))),
    common.Claim("the CNN's advantage over the MLP is gone on shuffled data (points, normal -> shuffled)", SRC,
                 "+26 -> -12",
                 lambda m: " -> ".join(f"{a - b:+.1f}" for a, b in (_means(m, d, ("cnn", "mlp")) for d in DATA)),
                 lambda m: bool(_means(m, "normal", ("cnn", "mlp"))[0] > _means(m, "normal", ("cnn", "mlp"))[1]
                                and _means(m, "shuffled", ("cnn", "mlp"))[0] <= _means(m, "shuffled", ("cnn", "mlp"))[1])),
]
#: The settings the claims' texts state.
CLAIM_SETTINGS = ("num_seeds", "train.steps", "train.batch_size", "train.learning_rate")


def report_section(m: dict) -> str:
    """Every row: parameters, published and measured accuracy (mean +- std, per seed), the tolerance, seconds."""
    rows = [r for r in MODELS if f"test_accuracy.{r}.normal" in m]
    lines = ["Test accuracy (%) after the last step, mean +- std over the seeds [per seed]; the tolerance is the "
             "docstring's rule, max(2.5 std, 2) points; seconds: each cell's wall time (cells side by side).", "",
             "| model | parameters | data | published | resjax | per seed | tolerance | within | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for d in DATA:
            if f"test_accuracy.{r}.{d}" not in m:
                continue
            a = accuracies(m, r, d)
            pub = f"{PUBLISHED[r][DATA.index(d)]:.0f}" if r in PUBLISHED else "-"
            ok = ("yes" if within(m, r, d) else "**no**") if r in PUBLISHED else "-"
            lines.append(f"| {r} | {m[f'params.{r}']:,} | {d} | {pub} | {np.mean(a):.1f} +- "
                         f"{np.std(a, ddof=1) if len(a) > 1 else 0.0:.1f} | {', '.join(f'{v:.1f}' for v in a)} | "
                         f"{m[f'tolerance.{r}.{d}']:.1f} | {ok} | {m[f'seconds.{r}.{d}']:.0f} |")
    return "\n".join(lines)


# ---- running -----------------------------------------------------------------------------------------


def rows(config) -> list[str]:
    """``config.models``, checked (``ValueError`` naming ``models``)."""
    chosen = list(config.models)
    if not chosen:
        raise ValueError(f"models: needs at least one of {tuple(MODELS)}")
    for r in chosen:
        if r not in MODELS:
            raise ValueError(f"models: unknown row {r!r}; choose from {tuple(MODELS)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"models: a row named twice in {tuple(chosen)}")
    return chosen


def check(config) -> None:
    """The preflight hook: the rows, the train config (a step run: the library's checks), every model built."""
    common.check_train(config.train)
    data = load_mnist1d()
    if config.train.batch_size > len(data.y_train):
        raise ValueError(f"train.batch_size: {config.train.batch_size} exceeds the {len(data.y_train)} examples")
    common.build_models([MODELS[r] for r in rows(config)], data.num_classes, prefix="models")


def cell_job(config, row: str, data_name: str, data):
    """One row on one data set, every seed in one vmapped program, as a job of ``checkpoints.sweeps``; its wall
    time (from the job's start to its last chunk) is written into ``times[(row, data_name)]``."""
    label = f"{row} {data_name}"
    times = cell_job.times

    def job() -> dict:
        trainer = make_train(run_config(MODELS[row], config.train, DATA_NAMES[data_name]), data)
        keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)
        began = time.time()

        def clock(done, summary):
            times[(row, data_name)] = time.time() - began

        return dict(trainer=trainer, keys=keys, cell=label, progress=label, callback=clock)

    job.cost = {"resnet1d": 8, "cnn": 4, "gru": 4}.get(row, 1)  # the longest first (measured on a CPU)
    return job


cell_job.times = {}


def run(config, out_dir) -> dict:
    check(config)
    sets = {"normal": load_mnist1d(), "shuffled": load_mnist1d(shuffle_length=True)}
    chosen = rows(config)
    jobs = {(r, d): cell_job(config, r, d, sets[d]) for r in chosen for d in DATA}
    order = sorted(jobs, key=lambda k: -jobs[k].cost)
    start = time.time()
    done = dict(zip(order, (metrics for _, metrics in checkpoints.sweeps([jobs[k] for k in order]))))
    out: dict = {"seconds": time.time() - start}
    print(f"{NAME}: {len(jobs)} cells done in {out['seconds']:.0f} s", flush=True)
    period = config.train.eval_every_steps or config.train.steps
    out["eval_steps"] = [period * (i + 1) for i in range(config.train.steps // period)]
    x = np.zeros((2, 40), np.float32)
    for r in chosen:
        variables = jax.eval_shape(lambda: build_model(MODELS[r], num_classes=10).init(jax.random.key(0), x,
                                                                                       train=False))
        out[f"params.{r}"] = int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(variables["params"])))
        for d in DATA:
            m = done[(r, d)]
            acc = 100 * (1 - np.asarray(m["test_error"], float))
            out[f"test_accuracy.{r}.{d}"] = acc[:, -1]
            out[f"tolerance.{r}.{d}"] = tolerance(acc[:, -1])
            out[f"curves.{r}.{d}.test_accuracy"] = acc
            out[f"diverged_step.{r}.{d}"] = [None if s < 0 else int(s) for s in m["diverged_step"]]
            out[f"seconds.{r}.{d}"] = float(cell_job.times.get((r, d), float("nan")))
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()
    shown = [r for r in MODELS if f"test_accuracy.{r}.normal" in m]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(14, 5.2))
    width = 0.38
    colours = {"normal": "tab:blue", "shuffled": "tab:orange"}
    for j, d in enumerate(DATA):
        xs = np.arange(len(shown)) + (j - 0.5) * width
        means = [np.mean(accuracies(m, r, d)) for r in shown]
        spread = [np.std(accuracies(m, r, d), ddof=1) if config.num_seeds > 1 else 0.0 for r in shown]
        bars.bar(xs, means, width, yerr=spread, capsize=3, color=colours[d], alpha=0.8,
                 label=f"resjax, {d} (mean, error bar: std of {config.num_seeds} seeds)")
        for x, r in zip(xs, shown):
            bars.scatter([x] * len(accuracies(m, r, d)), accuracies(m, r, d), s=8, color="black", zorder=3)
            if r in PUBLISHED:
                bars.plot([x - width / 2, x + width / 2], [PUBLISHED[r][j]] * 2, color="red", lw=2.2, zorder=4,
                          label="published (Greydanus 2020)" if (j, r) == (0, shown[0]) else None)
    bars.set_xticks(np.arange(len(shown)))
    bars.set_xticklabels([f"{r}\n{m[f'params.{r}']:,} params" for r in shown], fontsize=8)
    bars.set_ylabel("test accuracy after the last step (%)")
    bars.set_ylim(0, 100)
    bars.set_title("The MNIST-1D paper's model table (README 'benchmarks'): normal and shuffled positions;\n"
                   "dots: single seeds; red: the published accuracy", fontsize=10)
    bars.grid(axis="y", alpha=0.3)
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: the bars stay clear
    steps = np.asarray(m["eval_steps"])
    for i, r in enumerate(shown):
        for d, style in (("normal", "-"), ("shuffled", "--")):
            curve = np.mean(np.asarray(m[f"curves.{r}.{d}.test_accuracy"], float), axis=0)
            curves.plot(steps, curve, style, color=f"C{i}", label=f"{r}, {d}")
    curves.set_xlabel("training step")
    curves.set_ylabel("test accuracy (%), mean over seeds")
    curves.set_title(f"Test accuracy during training (evaluated every {steps[0]} steps)", fontsize=10)
    curves.grid(alpha=0.3)
    common.legend_outside(curves)
    fig.suptitle(f"MNIST-1D models: {common.describe_optimizer(config.train)}, batch {config.train.batch_size}, "
                 f"{config.train.steps} steps in a fixed batch order, {common.plural(config.num_seeds, 'seed')}")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
