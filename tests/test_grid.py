"""Grids of seeds x hyperparameters (``resjax.train.grid``) on both feeders, one call each: every run of the grid
is that run trained alone, the results come back labelled, and a resume never mixes hyperparameters."""

import inspect

import numpy as np
import pytest

from resjax.data import from_arrays
from resjax.train import image_train_config, make_image_train, make_train, run_config, train_config
from resjax.train.grid import fit_grid, grid
from resjax.train.host import ImageTrainer
from resjax.train.ondevice import Trainer
from tests.small_data import separable_arrays


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


IMAGES = from_arrays(*separable_arrays(32, (12, 12, 1)), *separable_arrays(16, (12, 12, 1), seed=1),
                     augment="flip")
VECTORS = from_arrays(*separable_arrays(64, (10,)), *separable_arrays(32, (10,), seed=1))
SEEDS, RATES = [0, 1, 2, 3], [0.1, 0.03, 0.01]
METRICS = ("train_loss", "batch_error", "test_loss", "test_error", "lr")


def _resnet(**model):
    config = run_config(dict(kind="resnet", stage_sizes=(1,), stage_widths=(4,), stem_width=4, **model),
                        image_train_config(batch_size=16, eval_batch_size=16, epochs=2, schedule="constant",
                                           augment=True, weight_decay=0.0))
    return make_image_train(config, IMAGES)


def _mlp(epochs=2, **train):
    config = run_config(dict(kind="residual_mlp", width=8, num_blocks=2, norm="batch"),
                        train_config(batch_size=16, epochs=epochs, **train))
    return make_train(config, VECTORS)


def _assert_each_run_is_the_run_alone(trainer, result, metrics=METRICS):
    for label in result.grid.labels():
        hp = {k: v for k, v in label.items() if k not in ("run", "seed")}
        run, alone = trainer.fit(label["seed"], hparams=hp)
        for name in metrics:
            np.testing.assert_allclose(result.history[name][label["run"]], alone[name], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(result.select(**{k: label[k] for k in result.grid.axes}).state.params
                                              ["head"]["kernel"]), np.asarray(run.state.params["head"]["kernel"]),
                                   rtol=1e-6, atol=1e-7)


def test_a_grid_is_every_combination_with_the_seed_fastest():
    g = grid(seeds=SEEDS, learning_rate=RATES, weight_decay=[0.0, 1e-4])
    assert g.num_runs == 24 and g.seeds[:5] == [0, 1, 2, 3, 0]
    np.testing.assert_allclose(g.hparams["learning_rate"][:8], [0.1] * 8)
    np.testing.assert_allclose(g.hparams["weight_decay"][:8], [0.0] * 4 + [1e-4] * 4)
    assert g.index(seed=2, learning_rate=0.03, weight_decay=1e-4) == 8 + 4 + 2
    assert grid(3).seeds == [0, 1, 2] and grid(3).hparams == {}
    for kwargs, match in [(dict(momentum=["fast"]), "momentum: want numbers"), (dict(seed=[1, 2]), "seed: the seeds"),
                          (dict(seeds=[0, 0]), "each seed once"), (dict(seeds=0), "seeds: want a positive count"),
                          (dict(tau=[0.5, 0.5]), "tau: want distinct"),
                          (dict(seeds=[1.5]), "seeds: want a non-empty list")]:
        with pytest.raises(ValueError, match=match):
            grid(**kwargs)
    with pytest.raises(ValueError, match="no run of the grid"):
        g.index(seed=9, learning_rate=0.1, weight_decay=0.0)


def test_both_feeders_take_the_same_call():
    host, device = inspect.signature(ImageTrainer.fit).parameters, inspect.signature(Trainer.fit).parameters
    assert [p for p in host if p != "keys_or_state"] == [p for p in device if p not in ("keys", "chunk_epochs")]


def test_a_resnet_grid_of_4_seeds_x_3_learning_rates_through_the_host_feeder():
    trainer = _resnet()
    result = fit_grid(trainer, grid(SEEDS, learning_rate=RATES))
    assert result.history["train_loss"].shape == (12, 2)
    np.testing.assert_allclose(result.history["lr"][:, 0], np.repeat(RATES, 4), rtol=1e-6)
    _assert_each_run_is_the_run_alone(trainer, result)
    frame = result.frame()
    assert len(frame) == 24 and set(frame.columns) >= {"run", "seed", "learning_rate", "epoch", *METRICS}
    fast = frame.query("learning_rate == 0.1 and epoch == 2")
    assert sorted(fast.seed) == SEEDS
    np.testing.assert_allclose(fast.train_loss, result.history["train_loss"][:4, 1], rtol=1e-6)


def test_a_tau_grid_on_a_tau_resnet_through_the_host_feeder():
    trainer = _resnet(scaling="tau", norm="none")
    result = fit_grid(trainer, grid([0, 1], tau=[0.25, 1.0]))
    _assert_each_run_is_the_run_alone(trainer, result)
    assert not np.allclose(result.history["train_loss"][0], result.history["train_loss"][2])  # tau changes the run


def test_a_residual_mlp_grid_through_the_on_device_feeder_with_the_same_call():
    trainer = _mlp()
    result = fit_grid(trainer, grid(SEEDS, learning_rate=RATES))
    _assert_each_run_is_the_run_alone(trainer, result, METRICS + ("train_error",))
    summary = result.summary()
    assert len(summary) == 12 and summary.diverged_epoch.isna().all()
    np.testing.assert_allclose(summary.best_test_error, np.nanmin(result.history["test_error"], axis=1))


def test_a_diverged_run_keeps_its_last_finite_metrics_and_its_divergence_epoch():
    # 4 epochs in one chunk (one program call): the program of the 4-epoch runs of
    # test_a_finished_run_extended_from_its_checkpoint_equals_the_longer_run[on-device] (compiled once)
    trainer = _mlp(epochs=4)
    result = fit_grid(trainer, grid([0], learning_rate=[0.05, 1e6]), chunk_epochs=4)
    d = result.history["diverged_epoch"]
    assert d[0] == -1 and d[1] >= 1, d
    summary = result.summary().set_index("learning_rate")
    bad = summary.loc[1e6]
    assert bad.diverged_epoch == d[1]
    assert np.isnan(bad.final_train_loss) == (d[1] <= 4)
    finite = result.history["test_loss"][1][np.isfinite(result.history["test_loss"][1])]
    if len(finite):
        assert bad.last_finite_test_loss == pytest.approx(finite[-1])
        assert bad.best_test_loss == pytest.approx(finite.min())
    frame = result.frame()
    assert frame[frame.learning_rate == 1e6].diverged.tolist() == [e >= d[1] for e in (1, 2, 3, 4)]


@pytest.mark.parametrize("feeder", ["on-device", "host"])
def test_a_resume_with_other_hparams_is_refused(tmp_path, feeder):
    trainer = _mlp(epochs=2) if feeder == "on-device" else _resnet(scaling="tau", norm="none")
    name = "learning_rate" if feeder == "on-device" else "tau"
    trainer.fit([0, 1], hparams={name: [0.1, 0.1]}, checkpoint_dir=tmp_path / "ckpt", epochs=1)
    refused = rf"made with hparams\.{name}=\[0\.1, 0\.1\], this run asks for \[0\.01, 0\.01\]"
    with pytest.raises(ValueError, match=refused):
        trainer.fit([0, 1], hparams={name: [0.01, 0.01]}, checkpoint_dir=tmp_path / "ckpt")
    run, history = trainer.fit([0, 1], hparams={name: [0.1, 0.1]}, checkpoint_dir=tmp_path / "ckpt")
    assert history["epochs"] == 2  # the same hparams resume


def _same_runs(a, b, names=("train_loss", "test_loss", "test_error", "lr")):
    for name in names:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("feeder", ["on-device", "host"])
def test_a_finished_run_extended_from_its_checkpoint_equals_the_longer_run(tmp_path, feeder):
    """Constant learning rate: 2 epochs, then ``fit(..., epochs=4)`` resumes from the checkpoint of the finished
    run and equals a run configured for 4 epochs from the start."""
    make = (lambda e: _mlp(epochs=e, learning_rate=0.05)) if feeder == "on-device" else _host_with_epochs
    # the longer run on the on-device feeder in one chunk: one call of its program
    one_chunk = {"chunk_epochs": 4} if feeder == "on-device" else {}
    short, long = make(2), make(4)
    _, first = short.fit([0, 1], checkpoint_dir=tmp_path / "ckpt")
    assert first["epochs"] == 2
    run, extended = short.fit([0, 1], epochs=4, checkpoint_dir=tmp_path / "ckpt")
    _, whole = long.fit([0, 1], **one_chunk)
    assert extended["epochs"] == 4 and extended["train_loss"].shape == (2, 4)
    _same_runs(extended, whole)
    np.testing.assert_allclose(extended["train_loss"][:, :2], first["train_loss"], rtol=1e-6)
    if feeder == "host":  # and from the state itself, without a checkpoint
        state, _ = short.fit([0, 1])
        _, again = short.fit(state, epochs=4)
        _same_runs(again, whole)


def _host_with_epochs(epochs):
    config = run_config(dict(kind="resnet", stage_sizes=(1,), stage_widths=(4,), stem_width=4),
                        image_train_config(batch_size=16, eval_batch_size=16, epochs=epochs, schedule="constant",
                                           augment=True, weight_decay=0.0, learning_rate=0.05))
    return make_image_train(config, IMAGES)


def test_extending_a_cosine_run_retimes_its_schedule(tmp_path):
    """A schedule over the whole run (cosine) cannot be the longer run's for the steps already taken: the
    extension keeps those epochs as trained and goes on at the longer run's rate of each later step."""
    short, long = _mlp(epochs=2, learning_rate=0.05, schedule="cosine"), _mlp(epochs=4, learning_rate=0.05,
                                                                                schedule="cosine")
    _, first = short.fit([0], checkpoint_dir=tmp_path / "ckpt")
    _, extended = short.fit([0], epochs=4, checkpoint_dir=tmp_path / "ckpt")
    _, whole = long.fit([0], chunk_epochs=4)  # one chunk: one call of its program
    np.testing.assert_allclose(extended["lr"][:, :2], first["lr"], rtol=1e-6)
    np.testing.assert_allclose(extended["lr"][:, 2:], whole["lr"][:, 2:], rtol=1e-6)
    assert not np.allclose(first["lr"], whole["lr"][:, :2])
    with pytest.raises(ValueError, match="made with other settings .*train.epochs"):
        _mlp(epochs=3, learning_rate=0.05, schedule="cosine").fit([0], checkpoint_dir=tmp_path / "ckpt")
