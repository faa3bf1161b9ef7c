"""What a researcher hit in the grid API (issue 64), each fixed: an optimiser factory that cannot take resjax's
rate is refused before training, saying what it receives; refusals point at the right fix; a grid says what it
resumes; a stop in a later program says what the earlier ones kept; ``select(**label)`` takes every label back."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest

import resjax.train
from resjax.data import from_arrays, load_dataset
from resjax.train import (Preempted, fit_grid, grid, image_train_config, make_image_train, make_train, run_config,
                          train_config)
from resjax.train.host import ImageTrainer

MLP = dict(kind="residual_mlp", num_blocks=2, width=8)


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    return from_arrays(rng.normal(size=(96, 12)).astype(np.float32), rng.integers(0, 3, 96))


def test_a_factory_that_cannot_take_a_schedule_is_refused_before_training_saying_what_it_receives():
    data = load_dataset("mnist1d")
    bad = lambda lr: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 10, 60))  # noqa: E731
    with pytest.raises(ValueError, match=r"^optimizer: your factory f\(learning_rate\) is called with resjax's "
                                         r"learning rate, a schedule .* it raised TypeError: .*set "
                                         r"train.schedule='constant' and multiply it in"):
        make_train(run_config(MLP, train_config(epochs=1), "mnist1d"), data, optimizer=bad)
    with pytest.raises(ValueError, match="it returned float, not an optax.GradientTransformation"):
        make_train(run_config(MLP, train_config(epochs=1), "mnist1d"), data, optimizer=lambda lr: 0.1)
    # the composition the message gives trains, its schedule the user's
    good = lambda lr: optax.adamw(lambda s: lr(s) * optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 60)(s))  # noqa
    trainer = make_train(run_config(MLP, train_config(epochs=1, schedule="constant"), "mnist1d"), data,
                         optimizer=good)
    assert np.isfinite(trainer.fit(0, progress=False)[1]["train_loss"]).all()


def test_a_learning_rate_axis_over_a_ready_transformation_points_at_a_factory(arrays):
    trainer = make_image_train(run_config(MLP, image_train_config(epochs=1, batch_size=32, schedule="constant")),
                               arrays, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"holds its own learning rate; .*pass your optimiser as a factory of the "
                                         r"rate: make_train\(\.\.\., optimizer=lambda learning_rate:") as err:
        fit_grid(trainer, grid(1, learning_rate=[0.1, 0.01]), progress=False)
    assert "momentum" not in str(err.value)


def test_an_axis_on_a_field_the_model_kind_lacks_names_its_fields_and_the_closest():
    from resjax.data import synthetic_image_dataset

    trainer = make_image_train(run_config(dict(kind="cifar_resnet", depth=8), image_train_config(
        epochs=1, batch_size=32, milestones=())), synthetic_image_dataset("cifar10", 64))
    with pytest.raises(ValueError, match=r"^model.width: a 'cifar_resnet' model has no field 'width'; its fields: "
                                         r"depth, num_classes, widen_factor$"):
        fit_grid(trainer, grid(1, **{"model.width": [8, 16]}), progress=False)
    mlp = make_train(run_config(MLP, train_config(epochs=1), "mnist1d"), load_dataset("mnist1d"))
    with pytest.raises(ValueError, match=r"has no field 'num_block' \(did you mean 'model.num_blocks'\?\)"):
        fit_grid(mlp, grid(1, **{"model.num_block": [2, 4]}), progress=False)


def test_a_grid_says_what_it_resumes_and_what_it_leaves(arrays, tmp_path, capsys):
    trainer = make_image_train(run_config(MLP, image_train_config(epochs=1, batch_size=16, schedule="constant")),
                               arrays)
    g = grid(1, **{"train.batch_size": [16, 32]})
    fit_grid(trainer, g, checkpoint_dir=str(tmp_path), progress=False)
    first = capsys.readouterr().out
    assert "resum" not in first  # a fresh grid: nothing read back, nothing said
    fit_grid(trainer, g, checkpoint_dir=str(tmp_path))
    again = capsys.readouterr().out
    assert f"grid: resuming from {tmp_path}" in again
    assert "batch_size=16: resumes from its step" in again and "batch_size=32: resumes from its step" in again
    fit_grid(trainer, grid(1, **{"train.batch_size": [16, 48]}), checkpoint_dir=str(tmp_path))
    changed = capsys.readouterr().out
    assert "batch_size=48: starts afresh" in changed
    assert "left as they are, no program of this grid (another setting): train.batch_size=32" in changed


def test_a_stop_in_a_later_program_says_what_the_earlier_ones_kept(arrays, tmp_path, capsys, monkeypatch):
    trainer = make_image_train(run_config(MLP, image_train_config(epochs=1, batch_size=16, schedule="constant")),
                               arrays)
    fit = ImageTrainer.fit
    calls = []

    def stopped_second(self, *args, **kwargs):  # the second program is stopped before its first step
        calls.append(1)
        if len(calls) == 2:
            raise Preempted(2, "resjax: stopped by SIGINT before training started: nothing was trained yet", None, 0)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(ImageTrainer, "fit", stopped_second)
    with pytest.raises(Preempted):
        fit_grid(trainer, grid(1, **{"train.batch_size": [16, 32]}), checkpoint_dir=str(tmp_path), progress=False)
    err = capsys.readouterr().err
    assert ("the grid stopped in its program 2 of 2 (train.batch_size=32); its programs train.batch_size=16 had "
            f"finished and are saved in {tmp_path}/<program>: run the same command again to go on") in err


def test_select_takes_every_label_of_the_grid_back(arrays):
    trainer = make_image_train(run_config(MLP, image_train_config(epochs=1, batch_size=32, schedule="constant")),
                               arrays)
    g = grid(1, optimizer={"sgd": dict(momentum=[0.0, 0.9]), "adam": {}})
    res = fit_grid(trainer, g, progress=False)
    labels = g.labels()
    assert labels[2]["momentum"] is None and len({lab["seed"] for lab in labels}) == 1
    for label in labels:
        assert g.index(**label) == label["run"]
        state = res.select(**label)
        mine = res.programs[[label["run"] in p.runs for p in res.programs].index(True)]
        want = mine.run.select(mine.runs.index(label["run"]))
        leaves = [jax.tree_util.tree_leaves(r.state.params) for r in (state, want)]
        assert all(np.array_equal(a, b) for a, b in zip(*leaves))
    assert g.index(optimizer="adam") == 2  # one seed: seed may be left out
    with pytest.raises(ValueError, match="run=0 is not the run with"):
        g.index(**{**labels[1], "run": 0})
    assert res.summary()["momentum"].tolist() == [0.0, 0.9, None]  # None where the axis does not apply, not NaN
    assert g.index(optimizer="sgd", momentum=0.900000001) == 1  # floats to a relative 1e-6 (documented)


def test_the_grid_module_is_reachable_and_callable():
    import resjax.train.grid as module

    assert resjax.train.grid is module and resjax.train.grid.fit_grid is fit_grid
    assert "Grids of runs" in (module.__doc__ or "") or module.__doc__
    assert resjax.train.grid(2).num_runs == grid(2).num_runs == 2


def test_the_milestones_warning_is_said_once_and_a_vector_model_refuses_images():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from resjax.data import synthetic_image_dataset

        images = synthetic_image_dataset("cifar10", 64)
        make_image_train(run_config(dict(kind="cifar_resnet", depth=8), image_train_config(epochs=3, batch_size=32)),
                         images)
    assert sum("milestones:" in str(w.message) for w in caught) == 1
    rng = np.random.default_rng(0)
    digits = from_arrays(rng.normal(size=(64, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 64))
    with pytest.raises(ValueError, match=r"^model.kind: 'residual_mlp' takes vectors, and the examples are 8x8x1 "
                                         r"arrays: flatten them \(from_arrays\(x.reshape\(len\(x\), -1\), y\)\)"):
        make_image_train(run_config(MLP, image_train_config(epochs=1, batch_size=32)), digits)
