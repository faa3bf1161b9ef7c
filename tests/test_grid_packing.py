"""Grids that run as few programs as possible (``resjax.train.grid``, ``resjax.train.packing``): a depth axis of an
MLP packed into one program, each packed run equal to its network trained alone; axes that say what the researcher
means (zipped, conditional), values that have no effect refused naming the runs, model axes the config does not
name, frame columns named as ``select`` takes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.data import from_arrays
from resjax.train import make_image_train, make_train, run_config, train_config
from resjax.train.grid import fit_grid, grid, programs, zipped
from resjax.train.ondevice import Trainer
from tests.small_data import separable_arrays
from tests.test_grid_settings import no_training  # noqa: F401  (a fixture: training refused)


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


VECTORS = from_arrays(*separable_arrays(64, (10,)), *separable_arrays(32, (10,), seed=1))
# A packed run equals the network of its depth trained alone to float rounding (measured: at most 1e-7 absolute
# on losses of about 1, both layouts; XLA fuses the two programs differently): the stated tolerance.
RTOL, ATOL = 1e-5, 1e-6


def _config(model=None, **train):
    model = dict(kind="residual_mlp", width=8, num_blocks=1, norm="batch") if model is None else model
    return run_config(model, train_config(**{"batch_size": 16, "epochs": 2, "learning_rate": 0.05, "momentum": 0.9,
                                             "weight_decay": 1e-3, "weight_decay_on": "all", **train}))


@pytest.fixture
def chunk_programs(monkeypatch):
    """The distinct training (chunk) programs the trainers make, counted as they are asked for: each is compiled
    once (``Trainer.sweep``)."""
    made = {}
    original = Trainer._chunk_fn

    def counted(self, num_epochs=None):
        program = original(self, num_epochs)
        made[id(program)] = program
        return program
    monkeypatch.setattr(Trainer, "_chunk_fn", counted)
    return made


# ---- axes ---------------------------------------------------------------------------------------------------------


def test_a_zipped_axis_runs_exactly_the_listed_pairs(no_training):
    trainer = make_train(_config(), VECTORS)
    g = grid([0, 1], zipped(optimizer=["sgd", "adam"], learning_rate=[0.05, 0.01]), weight_decay=[0.0, 1e-3])
    assert g.num_runs == 8  # 2 pairs x 2 weight decays x 2 seeds, not 2 x 2 x 2 x 2
    assert {(label["optimizer"], label["learning_rate"]) for label in g.labels()} == {("sgd", 0.05), ("adam", 0.01)}
    progs = programs(trainer, g)
    assert [(p.name, p.trainer.config.train.optimizer) for p in progs] == [("train.optimizer=sgd", "sgd"),
                                                                          ("train.optimizer=adam", "adam")]
    np.testing.assert_array_equal(progs[0].hparams["learning_rate"], [0.05] * 4)
    np.testing.assert_array_equal(progs[1].hparams["learning_rate"], [0.01] * 4)
    np.testing.assert_array_equal(progs[1].hparams["weight_decay"], [0.0, 0.0, 1e-3, 1e-3])
    for bad, match in [(lambda: zipped(optimizer=["sgd", "adam"], learning_rate=[0.1]), "as many values each"),
                       (lambda: zipped(optimizer=["sgd", "sgd"], learning_rate=[0.1, 0.1]), "distinct settings"),
                       (lambda: grid(1, zipped(learning_rate=[0.1, 0.2]), learning_rate=[0.3]), "given twice")]:
        with pytest.raises(ValueError, match=match):
            bad()


def test_a_conditional_axis_gives_each_optimiser_its_own_learning_rates(no_training):
    trainer = make_train(_config(), VECTORS)
    g = grid(2, optimizer={"sgd": dict(learning_rate=[0.1, 0.05], momentum=[0.0, 0.9]),
                           "adam": dict(learning_rate=[0.01])})
    assert g.num_runs == 10
    progs = programs(trainer, g)
    assert [(p.name, len(p.runs), p.trainer.traced) for p in progs] == [("train.optimizer=sgd", 8, ("momentum",)),
                                                                        ("train.optimizer=adam", 2, ())]
    np.testing.assert_array_equal(progs[1].hparams["learning_rate"], [0.01, 0.01])
    assert g.labels()[-1] == {"run": 9, "seed": 1, "optimizer": "adam", "learning_rate": 0.01, "momentum": None}
    assert g.index(seed=1, optimizer="adam", learning_rate=0.01) == 9  # momentum does not apply: not named
    assert g.index(seed=0, optimizer="sgd", learning_rate=0.05, momentum=0.9) == 6


def test_values_that_have_no_effect_are_refused_naming_the_runs_before_training(no_training):
    trainer = make_train(_config(), VECTORS)
    with pytest.raises(ValueError, match=r"momentum: has no effect on runs \[4, 5, 6, 7\] of the grid "
                                         r"\(optimizer='adam'\): optimizer 'adam' has no momentum.*conditional axis"):
        fit_grid(trainer, grid(2, optimizer=["sgd", "adam"], momentum=[0.0, 0.9]))
    # tau where a model axis turns tau scaling off (a model.tau axis the config does not name)
    with pytest.raises(ValueError, match=r"tau: has no effect on runs \[0, 1, 2, 3\] of the grid \(scaling='none'\): "
                                         r"the model has no scaling='tau'"):
        fit_grid(trainer, grid(2, {"model.scaling": ["none", "tau"]}, tau=[0.5, 1.0]))
    with pytest.raises(ValueError, match=r"model\.widht: a .residual_mlp. model has no field .widht. "
                                         r"\(did you mean .model\.width.\?\)"):
        fit_grid(trainer, grid(1, {"model.widht": [4, 8]}))


def test_a_model_axis_works_whether_or_not_the_config_names_it(no_training):
    trainer = make_train(_config(), VECTORS)
    assert "use_bias" not in trainer.config.model and "order" not in trainer.config.model
    progs = programs(trainer, grid(1, {"model.use_bias": [True, False], "model.order": ["pre"]}))
    assert [p.trainer.model.use_bias for p in progs] == [True, False]
    assert all(p.trainer.model.order == "pre" for p in progs)
    # a conditional model axis: the runs it does not apply to keep the model's default (the base value)
    progs = programs(trainer, grid(1, {"model.norm": {"batch": {"model.use_bias": [False]}, "none": {}}}))
    assert [(p.trainer.model.norm, p.trainer.model.use_bias) for p in progs] == [("batch", False), ("none", True)]


# ---- depth packed into one program ----------------------------------------------------------------------------------


def _alone(model, seeds, make=make_train, **sizes):
    return make(_config({**model, **sizes}), VECTORS).fit(seeds)


def _assert_each_run_is_its_network_alone(result, g, model, sizes, make=make_train):
    for size in sizes:
        run, alone = _alone(model, [0, 1], make, **size)
        rows = [g.index(seed=s, **size) for s in (0, 1)]
        for name in ("train_loss", "train_error", "test_loss", "test_error"):
            np.testing.assert_allclose(result.history[name][rows], alone[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} {size}")
        # select gives the run as its own network holds it: the config's layout, its depth and width
        chosen, own = result.select(seed=1, **size), run.select(1)
        assert jax.tree_util.tree_structure(chosen) == jax.tree_util.tree_structure(own), size
        for a, b in zip(jax.tree_util.tree_leaves(chosen.state), jax.tree_util.tree_leaves(own.state)):
            assert np.shape(a) == np.shape(b), size
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=str(size))
        program = result.programs[0]  # in the program: the units past the run's width are zero
        packed = np.asarray(program.run.state.params["head"]["kernel"][program.runs.index(rows[1])])
        width = own.state.params["head"]["kernel"].shape[0]
        assert not np.any(packed[width:]) and np.any(packed[:width])


def test_a_depth_x_width_grid_is_one_program_and_each_run_is_its_network_trained_alone(chunk_programs, capsys):
    model = dict(kind="residual_mlp", width=8, num_blocks=1, norm="batch")
    g = grid([0, 1], {"model.num_blocks": [1, 3], "model.width": [4, 8]})
    result = fit_grid(make_train(_config(model), VECTORS), g, chunk_epochs=2, pack=True)
    said = capsys.readouterr().out  # before training: (3 x 64) x 8 runs against (1 + 3) x (16 + 64) x 2
    assert "grid: 8 runs in 1 program (depth packed: 1, 3; width packed: 4, 8; packed runs compute as their " \
           "program's largest network: 2.4x the block arithmetic of the runs alone)" in said, said
    assert len(result.programs) == 1 and len(chunk_programs) == 1  # one compiled training program
    frame = result.frame()
    assert sorted(set(zip(frame.num_blocks, frame.width))) == [(1, 4), (1, 8), (3, 4), (3, 8)]
    _assert_each_run_is_its_network_alone(result, g, model, [dict(num_blocks=d, width=w) for d in (1, 3)
                                                              for w in (4, 8)])
    assert len(chunk_programs) == 5  # the four networks alone: a program each


def test_a_packed_grid_on_the_host_feeder_is_one_program_of_the_networks_alone():
    """The host feeder (``ImageTrainer``) packs too: its step and evaluation take each run's ``active_depth``."""
    model = dict(kind="residual_mlp", width=4, num_blocks=1, norm="batch")
    g = grid([0, 1], {"model.num_blocks": [1, 3]})
    result = fit_grid(make_image_train(_config(model), VECTORS), g, pack=True, progress=False)
    assert len(result.programs) == 1
    _assert_each_run_is_its_network_alone(result, g, model, [dict(num_blocks=d) for d in (1, 3)], make_image_train)


def test_a_scanned_plain_depth_grid_is_one_program_of_the_networks_alone(chunk_programs):
    model = dict(kind="plain_mlp", width=8, depth=1, norm="batch", scan=True)
    g = grid([0, 1], {"model.depth": [1, 3]})
    result = fit_grid(make_train(_config(model, optimizer="adam", learning_rate=0.01), VECTORS), g, chunk_epochs=2,
                      progress=False, pack=True)
    assert len(chunk_programs) == 1 and set(result.frame().depth) == {1, 3}
    for depth in (1, 3):
        _, alone = make_train(_config({**model, "depth": depth}, optimizer="adam", learning_rate=0.01),
                              VECTORS).fit([0, 1])
        rows = [g.index(seed=s, depth=depth) for s in (0, 1)]
        np.testing.assert_allclose(result.history["train_loss"][rows], alone["train_loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(result.history["test_loss"][rows], alone["test_loss"], rtol=RTOL, atol=ATOL)


def test_packing_by_default_on_accelerators_and_on_cpus_where_it_is_predicted_faster(no_training, monkeypatch):
    """``pack='auto'`` (the default): always on an accelerator; on a CPU where ``packing_pays`` predicts it faster,
    at the rates measured on the 2-core CPU (docs/benchmarks.md, section 5): the benchmark's grid packs at 10 epochs
    (measured 1.65x faster packed) and not at 30 (0.94x)."""
    import importlib

    from resjax.data import load_dataset

    grid_module = importlib.import_module("resjax.train.grid")  # (resjax.train.grid is also the function)

    class Chip:
        def __init__(self, platform):
            self.platform = platform
    cpu, gpu = [Chip("cpu")], [Chip("gpu")]
    assert grid_module.auto_pack(gpu) and grid_module.auto_pack([Chip("tpu")])
    assert not grid_module.auto_pack(cpu)  # nothing to predict from
    data = load_dataset("mnist1d")
    g = grid(3, {"model.num_blocks": [2, 8, 16, 32], "model.width": [32, 64]})
    for epochs, expected in ((10, True), (30, False)):
        trainer = make_train(run_config(dict(kind="residual_mlp", width=64, num_blocks=32, norm="batch"),
                                        train_config(batch_size=64, epochs=epochs, learning_rate=0.005)), data)
        assert grid_module.auto_pack(cpu, trainer, g) is expected, epochs
        assert grid_module.auto_pack(gpu, trainer, g)
    seen = []  # fit_grid asks with its own trainer and grid, and packs as told
    monkeypatch.setattr(grid_module, "packing_pays", lambda t, gg: seen.append(gg is g) or False)
    monkeypatch.setattr(grid_module, "programs", lambda t, gg, pack: seen.append(pack) or [][0])
    for devices, expected in ((cpu, [True, False]), (gpu, [True])):
        seen.clear()
        with pytest.raises(IndexError):
            fit_grid(trainer, g, devices=devices)
        assert seen == expected


def test_packed_initial_draws_are_the_networks_own_and_blocks_past_a_runs_depth_stay_untouched():
    """Initial draws: bit for bit the depth-d network's (its own initialisers, Fixup's K-dependent ones too).
    Training: the blocks past the run's depth keep their parameters, BatchNorm statistics and optimiser state
    exactly (weight decay 1e-3 and momentum 0.9 would move them), while the active blocks train."""
    for model in (dict(kind="residual_mlp", width=8, num_blocks=3, scaling="fixup", num_layers=2),  # gain K^(-1/2)
                  dict(kind="residual_mlp", width=8, num_blocks=3, norm="batch", scan=True),
                  dict(kind="residual_mlp", width=8, num_blocks=3, norm="batch")):
        trainer = make_train(_config(model), VECTORS).with_packed_depths([1, 3])
        # one draw serves every depth only where a shallow network's draws are a deep one's first blocks: not
        # under Fixup, whose initialisers depend on the number of blocks (checked by drawing, packing.draws_...)
        assert trainer.packed_prefix == (model.get("scaling") != "fixup")
        hp = trainer.check_hparams({"active_depth": 1.0})
        key = jax.random.key(7)
        init = jax.jit(trainer.init_run)(key, 0, hp)
        alone = make_train(_config({**model, "num_blocks": 1}), VECTORS)
        own = jax.jit(alone.init_run)(key, 0, alone.check_hparams(None))
        # the packed program scans its stack (an unrolled config's too: packing.scanned); the network alone is
        # in the config's layout
        assert trainer.config.model.scan and trainer.packed_unrolled == (not model.get("scan"))
        own_block = (lambda p: p["blocks"]["block"]) if model.get("scan") else (
            lambda p: jax.tree_util.tree_map(lambda a: a[None], p["blocks_0"]))
        for a, b in zip(jax.tree_util.tree_leaves((init.state.params["stem"], init.state.params["head"],
                                                   jax.tree_util.tree_map(lambda a: a[:1],
                                                                          init.state.params["blocks"]["block"]))),
                        jax.tree_util.tree_leaves((own.state.params["stem"], own.state.params["head"],
                                                   own_block(own.state.params)))):
            np.testing.assert_array_equal(a, b)
        step = jax.jit(lambda r: trainer.train_step(r, (jnp.asarray(VECTORS.x_train[:16]),
                                                        jnp.asarray(VECTORS.y_train[:16])), hp)[0])
        after = step(step(init))
        past = lambda t: jax.tree_util.tree_map(lambda a: a[1:], t["blocks"]["block"])  # noqa: E731
        inner = lambda s: s.opt_state.inner_state  # noqa: E731
        trees = lambda r: (r.state.params, r.state.batch_stats)  # noqa: E731
        for old, new in zip(trees(init), trees(after)):
            if old:
                for a, b in zip(jax.tree_util.tree_leaves(past(old)), jax.tree_util.tree_leaves(past(new))):
                    np.testing.assert_array_equal(a, b)
        traces = [t for t in jax.tree_util.tree_leaves(inner(after.state), is_leaf=lambda n: isinstance(n, dict)
                                                       and "head" in n) if isinstance(t, dict)]
        assert traces, "no momentum trace found"
        for t in traces:
            assert all(not np.any(np.asarray(a)) for a in jax.tree_util.tree_leaves(past(t)))  # no drift
            assert np.any(np.asarray(jax.tree_util.tree_leaves(t["head"])[0]))  # the active ones moved
        assert not np.array_equal(after.state.params["stem"]["kernel"], init.state.params["stem"]["kernel"])


def test_depth_packing_switches_off_and_falls_back_where_it_cannot_pack(no_training):
    trainer = make_train(_config(), VECTORS)
    g = grid(1, {"model.num_blocks": [1, 2, 4]}, learning_rate=[0.1, 0.05])
    packed = programs(trainer, g, pack=True)
    assert len(packed) == 1 and packed[0].trainer.config.model.num_blocks == 4
    np.testing.assert_array_equal(packed[0].hparams["active_depth"], [1, 1, 2, 2, 4, 4])
    assert [p.name for p in programs(trainer, g, pack=False)] == [f"model.num_blocks={d}" for d in (1, 2, 4)]
    remat = make_train(_config(dict(kind="residual_mlp", width=8, num_blocks=1, scan=True, remat=True)), VECTORS)
    assert len(programs(remat, g, pack=True)) == 3  # a rematerialised stack does not pack: a program per depth
    tau_rule = make_train(_config(dict(kind="residual_mlp", width=8, num_blocks=1, scaling="tau", tau="1/sqrt(K)")),
                          VECTORS)
    assert len(programs(tau_rule, g, pack=True)) == 3  # its forward pass depends on K
    with pytest.raises(ValueError, match=r"hparams\.active_depth: \[2\.0\] not among the program's packed depths"):
        trainer.with_packed_depths([1, 4]).check_hparams({"active_depth": [1, 2]}, 2)
    with pytest.raises(ValueError, match=r"active_depth: this trainer's depth cannot be packed: a rematerialised"):
        remat.with_packed_depths([1, 2])
    widths = grid(1, {"model.width": [4, 8]})
    assert len(programs(trainer, widths, pack=True)) == 1
    layer = make_train(_config(dict(kind="residual_mlp", width=8, num_blocks=1, norm="layer")), VECTORS)
    assert len(programs(layer, widths, pack=True)) == 2  # a layer norm mixes the units: a program per width
    with pytest.raises(ValueError, match=r"active_width: this trainer's width cannot be packed: norm 'layer'"):
        layer.with_packed_widths([4, 8])
    # the issue's grid: depth {2, 8, 16, 32} x width {32, 64} x 3 seeds of a residual MLP, one program of 24 runs
    issue = programs(make_train(_config(dict(kind="residual_mlp", width=64, num_blocks=2, norm="batch")), VECTORS),
                     grid(3, {"model.num_blocks": [2, 8, 16, 32], "model.width": [32, 64]}), pack=True)
    assert len(issue) == 1 and len(issue[0].runs) == 24
    assert (issue[0].trainer.packed_depths, issue[0].trainer.packed_widths) == ((2, 8, 16, 32), (32, 64))
    both = grid(1, {"model.num_blocks": [1, 2], "model.width": [4, 8]})
    assert [len(programs(trainer, both, pack=p)) for p in (True, "depth", "width", False)] == [1, 2, 2, 4]
    with pytest.raises(ValueError, match="pack: must be True, False, 'depth', 'width' or 'auto'"):
        fit_grid(trainer, g, pack="yes")


def test_a_packed_depth_outside_the_stack_or_on_a_rematerialised_one_is_refused_by_name():
    from resjax.nn import build_model

    x = jnp.zeros((2, 10))
    model = build_model(dict(kind="residual_mlp", width=8, num_blocks=3), num_classes=3)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    for bad in (0, 4, 1.5):
        with pytest.raises(ValueError, match=r"active_depth: a packed depth must be an integer in 1 \.\. 3"):
            jax.eval_shape(lambda v: model.apply(v, x, train=False, active_depth=bad), variables)
    remat = build_model(dict(kind="plain_mlp", width=8, depth=4, scan=True, remat=2), num_classes=3)
    with pytest.raises(ValueError, match=r"remat: a packed depth \(active_depth= at call time\) needs remat=False"):
        jax.eval_shape(lambda: remat.init(jax.random.key(0), x, train=False, active_depth=2))


def test_degradation_packs_its_plain_cells_per_batch_size_when_asked():
    """``experiments.degradation``: plain:2, plain:8 and plain:32 as one program (``pack_cells``), its runs each depth's
    seeds in turn; the other cells alone. On the CPU the default (``auto``) packs nothing (measured slower)."""
    from experiments import degradation
    from resjax.data import load_dataset

    config = degradation.get_config("quick")
    assert [[c.name for c in g] for g in degradation.packed_groups(config, degradation.cells(config))] == [
        ["plain_d2"], ["plain_d8"], ["plain_d32"], ["residual_bn_d32"], ["residual_d32"]]  # auto, on the CPU
    config.pack_cells = "true"
    groups = degradation.packed_groups(config, degradation.cells(config))
    assert [[c.name for c in g] for g in groups] == [["plain_d2", "plain_d8", "plain_d32"], ["residual_bn_d32"],
                                                     ["residual_d32"]]
    args = degradation.packed_job(config, groups[0], 64, load_dataset(config.data), [0.005])()
    assert args["trainer"].packed_depths == (2, 8, 32) and len(args["keys"]) == 3 * config.num_seeds
    np.testing.assert_array_equal(args["hparams"]["active_depth"], np.repeat([2, 8, 32], config.num_seeds))
    config.pack_cells = "maybe"
    with pytest.raises(ValueError, match="pack_cells: must be true, false or auto"):
        degradation.check(config)
