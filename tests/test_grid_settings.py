"""Grids over any setting (``resjax.train.grid``): traced optimiser settings (momentum, Adam's betas) inside one
program, program-changing settings (batch size, width, optimiser) split into programs run side by side, one
labelled result, a grid that checkpoints and resumes as a whole, and axes that are not settings refused by name
before training. Every run of a grid is its setting trained alone."""

import os

import jax
import numpy as np
import pytest

from resjax.data import from_arrays
from resjax.nn import build_model
from resjax.train import make_image_train, make_train, run_config, train_config
from resjax.train.grid import fit_grid, grid
from resjax.train.ondevice import Trainer
from tests.small_data import separable_arrays


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles, default_emitters):
    """XLA's optimisation passes off; XLA:CPU's default emitters (not the run's loop emitters, see conftest): the
    promises here are bit-identities between programs (a traced momentum against a constant one), which the loop
    emitters break in the last bit of a fused evaluation loss."""
    yield


VECTORS = from_arrays(*separable_arrays(64, (10,)), *separable_arrays(32, (10,), seed=1))
# One residual block with BatchNorm (batch_stats to compare): its programs compile about a fifth faster than two.
MODEL = dict(kind="residual_mlp", width=8, num_blocks=1, norm="batch")


def _config(epochs=2, model=MODEL, **train):
    return run_config(dict(model), train_config(**{"batch_size": 16, "epochs": epochs, "learning_rate": 0.05,
                                                   "weight_decay_on": "all", **train}))


@pytest.fixture(scope="module")
def momentum_alone():
    """``(trainer, run, history)``: ``_config(momentum=0.9)`` (2 epochs, batch 16) trained alone, seeds 0 and 1, on
    the on-device feeder: the constant-momentum runs that the traced momentum (test_traced_momentum_...), a grid
    over momentum and a grid over batch size x momentum are compared with (one program for the three tests; its
    trainer traces momentum in the first two, one program for both)."""
    trainer = make_train(_config(momentum=0.9), VECTORS)
    return (trainer, *trainer.fit([0, 1]))


def _leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree_util.tree_leaves(tree)]


def _bit_equal(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def no_training(monkeypatch):
    """Training refused: a refusal must come before any run starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("training started")
    monkeypatch.setattr(Trainer, "fit", refuse)
    monkeypatch.setattr(Trainer, "sweep", refuse)


def test_an_axis_that_is_not_a_setting_is_refused_by_name_before_training(no_training):
    trainer = make_train(_config(), VECTORS)
    for axes, match in [({"train.batch_sise": [16, 32]}, r"train\.batch_sise: not a setting"),
                        ({"batch_sise": [16, 32]}, r"batch_sise: not a setting"),
                        ({"model.widht": [4, 8]}, r"model\.widht: a .residual_mlp. model has no field .widht. "
                                                  r"\(did you mean .model\.width.\?\); its fields: "),
                        ({"train.optimizer_args": [1, 2]}, r"train\.optimizer_args: not a setting"),
                        ({"tau": [0.5, 1.0]}, r"tau: has no effect on runs \[0, 1, 2, 3\] of the grid: the model "
                                              r"has no scaling='tau'"),  # the model has no tau
                        ({"train.batch_size": [16, "big"]}, r"train\.batch_size: cannot set .* to .big."),
                        ({"train.batch_size": [16, 0]}, r"batch_size: must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            fit_grid(trainer, grid(2, axes))
    given = make_train(_config(), VECTORS, model=build_model(MODEL, num_classes=3))
    with pytest.raises(ValueError, match=r"model\.width: the trainer's model was given as a module object"):
        fit_grid(given, grid(1, {"model.width": [4, 8]}))
    with pytest.raises(ValueError, match=r"hparams\.momentum: optimizer 'sgd' \(nesterov=True\) needs momentum > 0"):
        fit_grid(make_train(_config(momentum=0.9, nesterov=True), VECTORS), grid(1, momentum=[0.0, 0.9]))
    with pytest.raises(ValueError, match=r"hparams\.adam_b2: must be >= 0 and < 1"):
        fit_grid(make_train(_config(optimizer="adam"), VECTORS), grid(1, adam_b2=[0.99, 1.0]))


def test_names_resolve_to_settings_and_split_the_grid_where_they_change_the_program():
    from resjax.train.grid import programs

    trainer = make_train(_config(), VECTORS)
    g = grid([0, 1], {"train.batch_size": [16, 32], "model.width": [4, 8]}, momentum=[0.0, 0.9],
             learning_rate=[0.1, 0.05])
    progs = programs(trainer, g, pack=False)  # (the width packed: tests/test_grid_packing.py)
    assert [p.name for p in progs] == ["train.batch_size=16,model.width=4", "train.batch_size=16,model.width=8",
                                       "train.batch_size=32,model.width=4", "train.batch_size=32,model.width=8"]
    assert all(p.trainer.traced == ("momentum",) and len(p.runs) == 8 for p in progs)
    assert progs[3].trainer.config.train.batch_size == 32 and progs[3].trainer.config.model.width == 8
    np.testing.assert_array_equal(progs[0].hparams["momentum"], [0.0, 0.0, 0.0, 0.0, 0.9, 0.9, 0.9, 0.9])
    assert trainer.traced == () and trainer.config.train.batch_size == 16  # the trainer given is left as it was
    # the optimiser's own settings: momentum is traced for SGD; under Adam (which has none) it is refused, naming
    # the runs, unless a conditional axis gives it only where it applies
    with pytest.raises(ValueError, match=r"momentum: has no effect on runs \[4, 5, 6, 7\] of the grid "
                                         r"\(optimizer='adam'\): optimizer 'adam' has no momentum"):
        programs(trainer, grid(1, optimizer=["sgd", "adam"], momentum=[0.0, 0.9], adam_b1=[0.8, 0.9]))
    with pytest.raises(ValueError, match=r"adam_b1: has no effect on runs \[0, 1\] .*\(optimizer='sgd'\)"):
        programs(trainer, grid(1, optimizer=["sgd", "adam"], adam_b1=[0.8, 0.9]))
    mixed = programs(trainer, grid(1, optimizer={"sgd": dict(momentum=[0.0, 0.9]), "adam": dict(adam_b1=[0.8, 0.9])}))
    assert [(p.name, p.runs, p.trainer.traced) for p in mixed] == [
        ("train.optimizer=sgd", [0, 1], ("momentum",)), ("train.optimizer=adam", [2, 3], ("adam_b1",))]
    np.testing.assert_array_equal(mixed[1].hparams["adam_b1"], [0.8, 0.9])
    assert programs(trainer, grid(1, optimizer=["adam"], adam_b1=[0.8, 0.9]))[0].trainer.traced == ("adam_b1",)


def _grid_run(result, label, name):
    return result.history[name][label["run"]]


def test_traced_momentum_is_the_constant_momentum_bit_for_bit_on_both_feeders(momentum_alone):
    """A trainer that traces momentum (at the config's value) trains exactly as the one whose momentum is a
    constant of its program, and a default trainer's optimiser state is what it always was (learning rate and
    weight decay injected only: its checkpoints and program unchanged). On-device: ``momentum_alone`` (2 epochs);
    host: 1 epoch, the configuration of the host grid of test_programs_of_other_shapes_... (one program)."""
    on_device, *on_device_runs = momentum_alone
    host = make_image_train(_config(epochs=1, momentum=0.9), VECTORS)
    for trainer, (run, history) in ((on_device, on_device_runs), (host, host.fit([0, 1]))):
        # the optimiser state's structure (no program to compile)
        assert sorted(jax.eval_shape(trainer.init_run, jax.random.key(0)).state.opt_state.hyperparams) == [
            "learning_rate", "weight_decay"]
        traced = trainer.with_traced(["momentum"])
        assert trainer.with_traced([]) is trainer and traced.traced == ("momentum",)
        traced_run, traced_history = traced.fit([0, 1])
        assert float(traced_run.state.opt_state.hyperparams["momentum"][0]) == np.float32(0.9)
        ts, tt = run.state, traced_run.state
        _bit_equal((ts.step, ts.params, ts.batch_stats, ts.opt_state.inner_state, run.key, run.history),
                   (tt.step, tt.params, tt.batch_stats, tt.opt_state.inner_state, traced_run.key, traced_run.history))
        np.testing.assert_array_equal(history["train_loss"], traced_history["train_loss"])


def test_a_grid_over_momentum_and_adam_betas_is_one_program_of_the_settings_alone(momentum_alone):
    trainer, _, alone = momentum_alone  # momentum 0.9 alone, seeds 0 and 1
    # seed 0 x two momenta: two runs, as many as the traced trainer of test_traced_momentum_... (the same program)
    result = fit_grid(trainer, grid([0], momentum=[0.0, 0.9]))
    assert len(result.programs) == 1 and result.programs[0].trainer.traced == ("momentum",)
    for momentum in (0.9,):
        r = result.grid.index(seed=0, momentum=momentum)
        np.testing.assert_allclose(result.history["train_loss"][r], alone["train_loss"][0], rtol=1e-6)
        np.testing.assert_allclose(result.history["test_loss"][r], alone["test_loss"][0], rtol=1e-6)
    assert not np.allclose(result.history["train_loss"][0], result.history["train_loss"][1])
    adam = make_train(_config(epochs=1, optimizer="adam", learning_rate=0.01), VECTORS)
    result = fit_grid(adam, grid([0], adam_b1=[0.8, 0.95], adam_b2=[0.99]))
    for b1 in (0.8,):  # 1 - b1 in float32 from the traced beta: float rounding, not bit for bit
        _, alone = make_train(_config(epochs=1, optimizer="adam", learning_rate=0.01, adam_b1=b1, adam_b2=0.99),
                              VECTORS).fit(0)
        r = result.grid.index(seed=0, adam_b1=b1, adam_b2=0.99)
        np.testing.assert_allclose(result.history["train_loss"][r], alone["train_loss"], rtol=1e-4)
    assert not np.allclose(result.history["train_loss"][0], result.history["train_loss"][1])


def test_batch_size_x_momentum_x_seeds_runs_as_two_programs_side_by_side_and_resumes_as_a_whole(tmp_path,
                                                                                                 momentum_alone):
    trainer = make_train(_config(epochs=2), VECTORS)
    g = grid([0, 1], {"train.batch_size": [16, 32], "train.momentum": [0.0, 0.9]})
    whole = fit_grid(trainer, g)
    assert [p.name for p in whole.programs] == ["train.batch_size=16", "train.batch_size=32"]
    assert whole.run is None and whole.history["train_loss"].shape == (8, 2)
    if jax.device_count() >= 2:  # side by side: each program whole on one device, the two on two devices
        on = [{d.id for d in jax.tree_util.tree_leaves(p.run)[0].devices()} for p in whole.programs]
        assert all(len(d) == 1 for d in on) and on[0] != on[1], on
    alone_runs = {(16, 0.9): momentum_alone[1:],  # one setting of each program
                  (32, 0.0): make_train(_config(batch_size=32, momentum=0.0), VECTORS).fit([0, 1])}
    for (batch, momentum), (run, alone) in alone_runs.items():  # each run is its setting trained alone
        rows = [g.index(seed=s, **{"train.batch_size": batch, "train.momentum": momentum}) for s in (0, 1)]
        for name in ("train_loss", "train_error", "test_loss", "test_error", "lr"):
            np.testing.assert_allclose(whole.history[name][rows], alone[name], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(whole.select(seed=1, batch_size=batch, momentum=momentum).state.params["head"]
                                   ["kernel"], run.state.params["head"]["kernel"][1], rtol=1e-6, atol=1e-7)
    frame = whole.frame()
    # the columns are the names select and summary take: batch_size, not train.batch_size
    assert len(frame) == 16 and {"batch_size", "momentum", "seed", "epoch", "train_loss"} <= set(frame)
    cell = frame[(frame["batch_size"] == 32) & (frame["momentum"] == 0.9) & (frame.epoch == 2)]
    np.testing.assert_allclose(cell.train_loss, whole.history["train_loss"][[6, 7], 1], rtol=0)
    assert sorted(cell.seed) == [0, 1] and len(whole.summary()) == 8

    # Interrupted: every program stopped after epoch 1, then the first finished alone (the sweep the grid runs for
    # it, on the device it ran on: its program is compiled); the rerun resumes the unfinished program only and
    # equals the uninterrupted grid bit for bit.
    root = tmp_path / "grid"
    fit_grid(trainer, g, checkpoint_dir=root, epochs=1)
    first = whole.programs[0]
    first.trainer.sweep([0, 1, 0, 1], first.hparams, checkpoint_dir=root / first.name,
                        devices=list(jax.tree_util.tree_leaves(first.run)[0].devices()))
    finished = {f: os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root / first.name) for f in fs}
    again = fit_grid(trainer, g, checkpoint_dir=root)
    assert {f: os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root / first.name)
            for f in fs} == finished  # read back, not trained or saved again
    assert sorted(os.listdir(root)) == ["grid.json", "train.batch_size=16", "train.batch_size=32"]
    for name in ("train_loss", "train_error", "test_loss", "test_error", "lr", "diverged_epoch"):
        np.testing.assert_array_equal(again.history[name], whole.history[name], err_msg=name)
    for p, q in zip(again.programs, whole.programs):
        _bit_equal(p.run, q.run)


def test_programs_of_other_shapes_and_optimisers_on_both_feeders():
    """A width axis (other parameter shapes) on the on-device feeder; an optimiser axis (names as labels) with a
    traced learning rate on the host feeder, whose programs run one after another. The width-8 program (first, on
    the first device) is test_batch_size_x_momentum_x_seeds_...'s batch-16 program: compiled once."""
    widths = fit_grid(make_train(_config(), VECTORS), grid([0, 1], {"model.width": [8, 4]}, momentum=[0.0, 0.9]),
                      pack=False)
    assert widths.select(seed=1, width=4, momentum=0.9).state.params["head"]["kernel"].shape == (4, 3)
    assert widths.select(seed=1, width=8, momentum=0.9).state.params["head"]["kernel"].shape == (8, 3)
    host = make_image_train(_config(epochs=1, momentum=0.9), VECTORS)  # sgd: test_traced_momentum_...'s program
    g = grid([0], optimizer=["sgd", "adam"], learning_rate=[0.05, 0.01])
    result = fit_grid(host, g)
    assert [p.name for p in result.programs] == ["train.optimizer=sgd", "train.optimizer=adam"]
    _, alone = make_image_train(_config(epochs=1, optimizer="adam", learning_rate=0.01), VECTORS).fit(0)
    r = g.index(seed=0, optimizer="adam", learning_rate=0.01)
    np.testing.assert_allclose(result.history["train_loss"][r], alone["train_loss"], rtol=1e-6)
    frame = result.frame()
    assert frame.set_index(["optimizer", "learning_rate"]).loc[("adam", 0.01), "train_loss"] == pytest.approx(
        float(alone["train_loss"][0]), rel=1e-6)
    assert set(result.summary().optimizer) == {"sgd", "adam"}
