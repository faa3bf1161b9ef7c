"""The experiments' command line (#26): networks as settings (degradation's ``--cells``, tau_training's
``--models``), a help line for every flag, ``--quick``/``--full`` described, abbreviations refused, unknown flags
answered with the closest names, and figures built from the run's own settings."""

import importlib
import json

import numpy as np
import pytest

from experiments import common, degradation, reproduce, shattered_gradients, tau_stability, tau_training

MODULES = [importlib.import_module(f"experiments.{name}") for name in reproduce.REGISTRY]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_help_explains_every_flag_and_the_sizes(module, capsys):
    assert common.flags_without_help(module) == []
    for size in ([], ["--quick"], ["--full"]):
        parser, config, _ = common.build_parser(module, size)
        for action in parser._actions:
            assert action.help and "no help yet" not in action.help, action.option_strings
        with pytest.raises(SystemExit) as exit:
            common.parse_args(module, [*size, "--help"])
        assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    quick = common.size_changes(module, "quick")
    if quick:  # what --quick changes, derived from the configs, and that it is not a reproduction
        assert "NOT expected to reproduce the seed documents" in text
        assert all(change in text for change in quick)
    else:
        assert "the same settings as the default size" in text
    for name in common.flatten(module.get_config("default")):
        assert f"--{name} VALUE" in text
    if "seed" in config and "train" in config:  # both seed flags exist: each says which one the run reads
        assert "--train.seed is not read" in text and "derive from --seed" in text


def test_abbreviated_and_unknown_flags_are_refused_with_the_closest_names(capsys):
    for argv, expected in ((["--train.learn", "0.01"], "--train.learning_rate"),
                           (["--qu"], "--quick"),
                           (["--model.depth", "16"], "--cells")):
        with pytest.raises(SystemExit) as exit:
            common.parse_args(degradation, argv)
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert f"unrecognized argument {argv[0]}" in err and expected in err, err
    # common abbreviations and typos name the one flag meant, not the names that merely look alike (--train.lr once
    # suggested --train.loss, --train.seed and --train.shuffle)
    for argv_flag, meant in (("--train.lr", "--train.learning_rate"), ("--train.wd", "--train.weight_decay"),
                             ("--train.bs", "--train.batch_size"), ("--lr", "--train.learning_rate"),
                             ("--seeds", "--num_seeds"), ("--train.learnign_rate", "--train.learning_rate"),
                             ("--train.mom", "--train.momentum")):
        with pytest.raises(SystemExit):
            common.parse_args(degradation, [argv_flag, "1"])
        assert f"unrecognized argument {argv_flag}; did you mean {meant}?" in capsys.readouterr().err, argv_flag
    with pytest.raises(SystemExit) as exit:
        reproduce.main(["--qu"])
    assert exit.value.code == 2 and "--quick" in capsys.readouterr().err


def test_cells_are_settings_checked_by_the_preflight(tmp_path, capsys):
    config, _ = common.parse_args(degradation, ["--quick", "--cells", "+residual_bn:16", "--out", str(tmp_path)])
    assert tuple(config.cells) == (*degradation.DEFAULT_CELLS, "residual_bn:16")
    names = [c.name for c in degradation.cells(config)]
    assert names == [*degradation.CONFIGS, "residual_bn_d16"]
    # the defaults are the seed's networks, field for field
    default = degradation.get_config("default")
    assert {c.name: c.model for c in degradation.cells(default)} == degradation.CONFIGS
    assert {c.name: c.model for c in degradation.ablation_cells(default)} == degradation.ABLATIONS
    for bad, words in (("plain:8,bogus:16", "unknown cell kind 'bogus'"), ("plain:8,plain:8", "given twice"),
                       ("plain:0", "integer >= 1"), ("residual_bn", "KIND:DEPTH")):
        with pytest.raises(SystemExit) as exit:
            common.parse_args(degradation, ["--quick", "--cells", bad, "--out", str(tmp_path)], check=True)
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert "argument --cells:" in err and words in err, err
    with pytest.raises(SystemExit) as exit:
        common.parse_args(tau_training, ["--quick", "--models", "plain,tau=foo", "--out", str(tmp_path)], check=True)
    assert exit.value.code == 2 and "argument --models: unknown model 'tau=foo'" in capsys.readouterr().err


def test_degradation_trains_an_added_cell_from_flags_in_the_units_of_the_others(tmp_path):
    """A default cell (plain:2) beside an added one (residual_bn:4), both shallow: the units do not depend on the
    depth, which only costs compile time (plain:8 beside residual_bn:16 took seconds more)."""
    out = tmp_path / "run"
    common.main(degradation, ["--quick", "--cells", "plain:2,residual_bn:4", "--train.epochs", "1", "--num_seeds", "2",
                              "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    m = results["metrics"]
    assert results["config"]["cells"] == ["plain:2", "residual_bn:4"]
    for name in ("plain_d2", "residual_bn_d4"):
        final = m[f"final_train_error_pct.{name}"]
        curves = np.array(m[f"curves.{name}.train_error_pct"], float)
        assert len(final) == 2 and curves.shape == (2, 1)
        assert all(1.0 < v <= 100.0 for v in final)  # percentages (an untrained network errs on most examples)
        np.testing.assert_allclose(curves[:, -1], final)
        assert m[f"diverged_epoch.{name}"] == [None, None]  # None, not -1, for "never diverged"
    assert "batch_sweep.selected_batch_size" not in m  # the rule needs the five default cells
    assert (out / "degradation.png").stat().st_size > 10_000


def _figure(monkeypatch):
    figures = []
    monkeypatch.setattr(common, "save_figure", lambda fig, path, **kw: figures.append(fig))
    return figures


def test_degradation_figure_is_drawn_from_the_run(monkeypatch, tmp_path):
    figures = _figure(monkeypatch)
    config = degradation.get_config("quick")
    config.train.momentum, config.train.epochs = 0.9, 3
    rng = np.random.default_rng(0)
    m = {}
    for name in degradation.CONFIGS:
        runs = 50 + 10 * rng.random((2, 3))
        if name == "residual_d32":
            runs[:] = np.nan
        m[f"curves.{name}.train_error_pct"] = runs
        m[f"curves.{name}.test_error_pct"] = runs + 1
        m[f"diverged_epoch.{name}"] = [1, 1] if name == "residual_d32" else [None, None]
    degradation.plot(m, config, tmp_path / "x.png")
    (fig,) = figures
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == 3 and len(fig.axes) == 3  # no ablations at this size: no empty fourth panel
    title = fig._suptitle.get_text()
    assert "SGD momentum 0.9 lr 0.005" in title and "3 epochs" in title and "2 seeds" in title
    depth_32 = drawn[1]
    marks = [line for line in depth_32.lines if line.get_marker() == "x"]
    assert len(marks) == 2 and all(line.get_xdata()[0] == 1 for line in marks)  # each diverged seed, at epoch 1
    assert depth_32.get_ylim()[1] >= max(line.get_ydata()[0] for line in marks)  # inside the panel
    assert all(float(t).is_integer() for t in depth_32.get_xticks())
    assert depth_32.get_legend() is not None and depth_32.get_legend().get_bbox_to_anchor().y0 < \
        depth_32.get_window_extent().y0  # below the data


def _fake_curves(names, epochs=3, seeds=2):
    rng = np.random.default_rng(0)
    m = {}
    for name in names:
        runs = 50 + 10 * rng.random((seeds, epochs))
        m[f"curves.{name}.train_error_pct"], m[f"curves.{name}.test_error_pct"] = runs, runs + 1
        m[f"diverged_epoch.{name}"] = [None] * seeds
    return m


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_degradation_figure_of_custom_cells_titles_the_cells_that_ran_and_colours_each_kind_by_depth(monkeypatch):
    """#53: with --cells "plain:8,residual_bn:16,plain:4" no panel says 'depth 32', the plain cells are two shades of
    the plain colour (light: shallow), the other kind another colour, every legend in depth order; with part of the
    lecture's depth-32 cells the title names the lecture's figure and what is missing."""
    from matplotlib.colors import rgb_to_hsv, to_rgb

    figures = _figure(monkeypatch)
    config = degradation.get_config("quick")
    config.cells = ("plain:8", "residual_bn:16", "plain:4")
    degradation.plot(_fake_curves(["plain_d8", "residual_bn_d16", "plain_d4"]), config, "x.png")
    depth, every, gap = figures.pop().axes
    titles = [ax.get_title() for ax in (depth, every, gap)]
    assert not any("32" in t.replace("2, 8 and 32", "") for t in titles), titles  # only the lecture's depths, named
    assert depth.get_title().startswith("Training error against depth: plain MLPs of depth 4 and 8\n(the lecture's "
                                        "fig. 'Training error against depth' has depths 2, 8 and 32)")
    assert every.get_title() == "Training error of every cell of this run (--cells), means over seeds"
    assert _legend(depth) == ["plain_d4", "plain_d8"]
    assert _legend(every) == _legend(gap) == ["plain_d4", "plain_d8", "residual_bn_d16"]
    colour = {line.get_label(): np.asarray(to_rgb(line.get_color())) for line in every.lines}
    hsv = {name: rgb_to_hsv(c) for name, c in colour.items()}
    assert abs(hsv["plain_d4"][0] - hsv["plain_d8"][0]) < 0.01  # one family: one hue ...
    assert np.abs(colour["plain_d4"] - colour["plain_d8"]).max() > 0.3  # ... two shades, apart
    assert hsv["plain_d4"][2] > hsv["plain_d8"][2] or hsv["plain_d4"][1] < hsv["plain_d8"][1]  # the shallower lighter
    assert abs(hsv["residual_bn_d16"][0] - hsv["plain_d8"][0]) > 0.1  # another kind, another hue
    assert all(line.get_color() == every.lines[i].get_color() for i, line in enumerate(gap.lines))  # every panel alike

    config.cells = ("plain:8", "residual_bn:32", "plain_ln:32")  # part of the lecture's depth-32 figure, one added
    degradation.plot(_fake_curves(["plain_d8", "residual_bn_d32", "plain_ln_d32"]), config, "x.png")
    depth, depth_32, _ = figures.pop().axes
    assert depth_32.get_title() == ("Training at depth 32 (lecture fig. 'Training at depth 32'; without plain_d32 and "
                                    "residual_d32)\nand the cells added by --cells, means over seeds")
    assert _legend(depth_32) == ["plain_d8", "residual_bn_d32", "plain_ln_d32"]

    config = degradation.get_config("default")  # the lecture's cells and the ablations: the lecture's figures named
    names = [*degradation.CONFIGS, *degradation.ABLATIONS, *degradation.ABLATION_LEARNING_RATES]
    degradation.plot(_fake_curves(names), config, "x.png")
    depth, depth_32, gap, ablations = figures.pop().axes
    assert depth.get_title().startswith("Training error against depth (lecture fig. 'Training error against depth')\n"
                                        "plain MLPs of depth 2, 8 and 32")
    assert depth_32.get_title() == "Training at depth 32 (lecture fig. 'Training at depth 32'), means over seeds"
    assert _legend(depth_32) == list(degradation.LECTURE_DEPTH_32)
    assert ablations.get_title() == "Beyond the lecture: ablations at depth 32, means over seeds"
    assert _legend(ablations) == [*degradation.ABLATIONS, *degradation.ABLATION_LEARNING_RATES, "residual_bn_d32"]
    styles = {line.get_label(): line.get_linestyle() for line in ablations.lines}
    assert styles["residual_d32_lr5e-4"] != styles["residual_d32_lr1e-3"] != styles["plain_bn_d32"]


def test_shattered_and_tau_stability_figures_name_the_settings_that_ran(monkeypatch, tmp_path):
    config = shattered_gradients.get_config("quick")
    config.plain_hidden_layers, config.residual_blocks = 4, 4
    labels = shattered_gradients.labels(config)
    assert labels["deep_plain"] == "plain, 4 hidden layers"
    assert labels["residual_scaled"] == "residual, 4 blocks, branches x 1/sqrt(4)"
    assert not shattered_gradients.at_lecture_settings(config, "deep_plain")
    assert shattered_gradients.at_lecture_settings(shattered_gradients.get_config("default"), "deep_plain")

    figures = _figure(monkeypatch)
    config = tau_stability.get_config("quick")  # one depth
    m = {}
    for d in config.depths:
        for name in [*config.taus, "plain"]:
            m[f"curves.{name}.L{d}.log10_ratio"] = np.linspace(0, 0.3, d + 1)
            m[f"curves.{name}.L{d}.log10_grad"] = np.linspace(0.1, 0.2, d)
    tau_stability.plot(m, config, tmp_path / "x.png")
    (fig,) = figures
    assert len(fig.axes) == 2  # forward and backward of the one depth, no empty grid
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert "tau = 1" in labels and not any("= 1 = 1" in t for t in labels)
    assert fig.axes[0].get_ylim()[1] < 1.0  # fits the data (and the claim's band), not a fixed +-5


def test_figures_of_the_other_experiments_follow_the_run(monkeypatch, tmp_path):
    """#26 item 3 for the rest: one depth ticked as itself, no empty epoch panels, 'none trains' and diverged
    learning rates marked above the data, the run's epsilon (not the lecture's) and no lecture points off its
    settings, failed and diverged CIFAR runs counted and marked."""
    from experiments import batch_noise, batchnorm_loss_surface, cifar_tau, fixup_one_step

    figures = _figure(monkeypatch)
    config = fixup_one_step.get_config("quick")  # one depth, 2 seeds
    m = {"num_examples": 256}
    for init in fixup_one_step.INITS:
        for d in config.depths:
            m[f"log10_output_norm_after_one_step.{init}.L{d}"] = 1.0
            m[f"log10_output_norm_at_init.{init}.L{d}"] = 0.8
            m[f"log10_output_norm_after_one_step_per_seed.{init}.L{d}"] = [0.9, 1.1]
    fixup_one_step.plot(m, config, tmp_path / "x.png")
    ax = figures.pop().axes[0]
    assert list(ax.get_xticks()) == list(config.depths) and ax.get_xscale() == "linear"
    assert "2 seeds" in ax.get_title()

    config = batchnorm_loss_surface.get_config("quick")  # one epoch; learning rates 0.01 and 1
    s, e = config.num_seeds, config.train.epochs
    m = {"path.epochs": [0, 1], "lr_sweep.learning_rates": list(config.sweep_learning_rates)}
    for net in ("plain", "batchnorm", "noisy_bn"):
        m[f"curves.{net}.test_error_pct"] = np.full((s, e), 80.0)
        m[f"curves.{net}.train_error_pct"] = np.full((s, e), 75.0)
    for net in batchnorm_loss_surface.NETS:
        m[f"path.{net}.loss_range"] = m[f"path.{net}.grad_change"] = [[0.1, 0.05]] * s
        m[f"lr_sweep.{net}.final_train_loss"] = [[2.0] * s, [None] * s]
        m[f"lr_sweep.{net}.diverged_epoch"] = [[None] * s, [1] * s]
        m[f"lr_sweep.{net}.largest"] = None
    batchnorm_loss_surface.plot(m, config, tmp_path / "x.png")
    fig = figures.pop()
    assert "1 epoch" in fig._suptitle.get_text() and "SGD lr 0.05" in fig._suptitle.get_text()
    sweep, errors = fig.axes[2], fig.axes[3]
    legend = [t.get_text() for t in sweep.get_legend().get_texts()]
    assert "plain (none trains)" in legend and not any("nan" in t for t in legend)
    marks = [line for line in sweep.lines if line.get_marker() == "x"]
    assert {line.get_xdata()[0] for line in marks} == {1.0}  # the diverged learning rate, not a fixed height
    assert all(2.0 < line.get_ydata()[0] <= sweep.get_ylim()[1] for line in marks)
    assert all(line.get_marker() not in (None, "None", "") for line in errors.lines)  # one epoch: points drawn
    assert [float(t) for t in errors.get_xticks()] == [1.0]

    config = batch_noise.get_config("quick")
    config.epsilon, config.data_mean = 0.1, 0.0  # not the lecture's settings
    sizes = sorted({*config.batch_sizes, *config.sweep_batch_sizes})
    m = {"data_standardised": 1.25, "sweep.std": [0.5 / np.sqrt(b) for b in sizes], "sweep.loglog_slope": -0.5,
         "sweep.delta_method_std": [0.5 / np.sqrt(b) for b in sizes]}
    m.update({f"hist.b{b}": np.random.default_rng(0).normal(1.25, 2 / np.sqrt(b), 400) for b in config.batch_sizes})
    batch_noise.plot(m, config, sizes, tmp_path / "x.png")
    hist, sweep = figures.pop().axes
    assert "epsilon 0.1" in hist.get_xlabel()
    assert not [line for line in sweep.collections if "lecture" in str(line.get_label())]  # not its settings
    assert hist.get_xlim()[0] <= min(np.min(m[f"hist.b{b}"]) for b in config.batch_sizes)  # the data's range
    assert [int(t) for t in sweep.get_xticks()] == sizes

    config = cifar_tau.get_config("quick")
    rng = np.random.default_rng(0)
    m = {}
    for ds, v, d in cifar_tau.cells(config):
        k = cifar_tau.key(ds, v, d)
        m[f"final_test_error_pct.{k}"] = [float("nan"), 50.0] if v == "fixup" else list(40 + 10 * rng.random(2))
        m[f"failed.{k}"] = 1 if v == "fixup" else 0
    cifar_tau._plot(config, m, tmp_path)
    fig = figures.pop()
    nobn = fig.axes[0]
    assert "2 epochs" in fig._suptitle.get_text() and "SGD momentum 0.9" in fig._suptitle.get_text()
    assert any("Fixup (1 of 2 runs failed)" in t.get_text() for t in nobn.get_legend().get_texts())
    marks = [line for line in nobn.lines if line.get_marker() == "x"]
    assert len(marks) == 1 and marks[0].get_ydata()[0] <= nobn.get_ylim()[1]
    assert [int(t) for t in nobn.get_xticks()] == list(config.nobn_depths)
