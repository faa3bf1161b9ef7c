"""Santurkar et al.'s loss-surface measurements and noisy BatchNorm (lecture 000, "BatchNorm and the loss surface")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import batchnorm_loss_surface as experiment
from experiments import common
from resjax.analysis import loss_surface as ls
from resjax.nn import PlainMLP

A = jnp.diag(jnp.array([1.0, 2.0, 5.0]))
THETA = {"w": jnp.array([1.0, -1.0, 0.5])}
X = jax.random.normal(jax.random.key(0), (32, 10))
Y = jnp.arange(32) % 10


def quadratic(p):
    return 0.5 * p["w"] @ A @ p["w"]


def test_probe_on_a_quadratic_matches_the_formulas():
    etas = np.array([0.05, 0.1, 0.2, 0.3, 0.45])
    with jax.default_matmul_precision("highest"):
        r = jax.jit(lambda t, e: ls.probe_gradient_direction(quadratic, t, e))(THETA, etas)
    w = np.asarray(THETA["w"], np.float64)
    a = np.asarray(A, np.float64)
    g = a @ w
    losses = 0.5 * w @ a @ w - etas * (g @ g) + 0.5 * etas ** 2 * (g @ a @ g)
    np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(r["loss_range"], losses.max() - losses.min(), rtol=1e-5)
    np.testing.assert_allclose(r["grad_changes"], etas * np.linalg.norm(a @ g), rtol=1e-5)
    np.testing.assert_allclose(r["grad_change"], etas.max() * np.linalg.norm(a @ g), rtol=1e-5)
    np.testing.assert_allclose(r["beta_smoothness"], np.linalg.norm(a @ g) / np.linalg.norm(g), rtol=1e-5)
    np.testing.assert_allclose(r["grad_norm"], np.linalg.norm(g), rtol=1e-6)


def test_probe_on_a_network_uses_batch_statistics_and_changes_nothing():
    model = PlainMLP(width=8, depth=2, norm="batch")

    @jax.jit
    def probe_and_logits(key):  # one program (op by op, the probe's gradients compile one program per op)
        v = model.init(key, X)
        f = ls.params_loss_fn(model, v, X, Y, train=True)
        logits, _ = model.apply(v, X, train=True, mutable=["batch_stats"])
        return ls.probe_gradient_direction(f, v["params"], [0.01, 0.1]), logits  # concrete steps: checked

    r, logits = jax.device_get(probe_and_logits(jax.random.key(1)))
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1)
    expected = np.mean(m + np.log(np.exp(logits - m[:, None]).sum(-1)) - logits[np.arange(32), np.asarray(Y)])
    np.testing.assert_allclose(r["loss0"], expected, rtol=1e-5)
    assert np.all(np.isfinite(r["losses"]))


def test_largest_trainable_learning_rate():
    final = np.array([[0.2, 0.3], [0.5, 0.9], [0.4, 1.5], [np.nan, 0.1]])
    diverged = np.array([[False, False], [False, False], [False, False], [True, False]])
    ok = ls.trains(final, diverged, threshold=1.0)
    assert ok.tolist() == [[True, True], [True, True], [True, False], [False, True]]
    assert ls.largest_trainable_learning_rate([0.01, 0.1, 1.0, 10.0], ok) == 0.1
    assert np.isnan(ls.largest_trainable_learning_rate([0.1], [[False, True]]))


def test_noisy_batchnorm_reduces_to_batchnorm_without_noise():
    plain = PlainMLP(width=16, depth=2, norm="batch")
    vp = plain.init(jax.random.key(1), X)
    quiet = ls.NoisyBNMLP(width=16, depth=2, shift=0.0, scale_low=1.0, scale_high=1.0, sigma=0.0)
    vq = quiet.init(jax.random.key(1), X)
    # the same layout as PlainMLP's: the same initial weights from the same key (BatchNorm's under norm_0/bn)
    blocks = {f"blocks_{k}": {"linear_0": vp["params"][f"blocks_{k}"]["linear_0"],
                              "norm_0": {"bn": vp["params"][f"blocks_{k}"]["norm_0"]}} for k in range(2)}
    params = {**vp["params"], **blocks}
    jax.tree_util.tree_map(np.testing.assert_array_equal, vq["params"], params)
    out_q, upd_q = quiet.apply({"params": params, "batch_stats": vq["batch_stats"]}, X, train=True,
                               mutable=["batch_stats"])
    out_p, upd_p = plain.apply(vp, X, train=True, mutable=["batch_stats"])
    np.testing.assert_array_equal(out_q, out_p)
    np.testing.assert_array_equal(upd_q["batch_stats"]["blocks_0"]["norm_0"]["bn"]["mean"],
                                  upd_p["batch_stats"]["blocks_0"]["norm_0"]["mean"])


def test_noisy_batchnorm_changes_every_step_and_only_in_training():
    model = ls.NoisyBNMLP(width=16, depth=2)
    v = model.init(jax.random.key(1), X)
    o1, u1 = model.apply(v, X, train=True, mutable=["batch_stats"])
    o2, u2 = model.apply({**v, **u1}, X, train=True, mutable=["batch_stats"])
    assert not np.allclose(o1, o2)
    assert int(u2["batch_stats"]["blocks_0"]["norm_0"]["noise_step"]) == 2
    e1 = model.apply(v, X, train=False)
    e2 = model.apply({**v, **u1}, X, train=False)  # running estimates moved; no noise either way
    np.testing.assert_array_equal(e1, model.apply(v, X, train=False))
    assert e2.shape == e1.shape
    # Different seeds draw different noise.
    w = model.init(jax.random.key(2), X)
    assert not np.array_equal(v["batch_stats"]["blocks_0"]["norm_0"]["noise_key"],
                              w["batch_stats"]["blocks_0"]["norm_0"]["noise_key"])


def test_bad_inputs_raise_value_error_naming_the_setting():
    with pytest.raises(ValueError, match="^step_sizes:"):
        ls.probe_gradient_direction(quadratic, THETA, [])
    with pytest.raises(ValueError, match="^step_sizes:"):
        ls.probe_gradient_direction(quadratic, THETA, [0.2, 0.1])
    with pytest.raises(ValueError, match="^step_sizes:"):
        ls.probe_gradient_direction(quadratic, THETA, [-0.1, 0.1])
    with pytest.raises(ValueError, match="^inputs:"):
        ls.params_loss_fn(PlainMLP(width=8, depth=1), {"params": {}}, X[:1], Y[:1], train=True)
    with pytest.raises(ValueError, match="^threshold:"):
        ls.trains([0.1], [False], threshold=0.0)
    with pytest.raises(ValueError, match="^sigma:"):
        ls.NoisyBNMLP(width=8, depth=1, sigma=-1.0)
    with pytest.raises(ValueError, match="^scale_low, scale_high:"):
        ls.NoisyBatchNorm(scale_low=2.0, scale_high=1.0)
    with pytest.raises(ValueError, match="^width:"):
        ls.NoisyBNMLP(width=0, depth=1)
    c = experiment.get_config("quick")
    c.probe_every = 3
    with pytest.raises(ValueError, match="^probe_every:"):
        experiment.run(c, None)


def test_quick_experiment_writes_results(tmp_path):
    results = common.run_experiment(experiment, experiment.get_config("quick"), tmp_path)
    m, c = results["metrics"], results["config"]
    checkpoints = c["train"]["epochs"] // c["probe_every"] + 1
    for net in experiment.NETS:
        assert np.asarray(m[f"path.{net}.loss_range"]).shape == (c["num_seeds"], checkpoints)
        assert len(m[f"lr_sweep.{net}.trains"]) == len(c["sweep_learning_rates"])
    assert len(m["final_test_error_pct.noisy_bn"]) == c["num_seeds"]
    assert (tmp_path / "batchnorm_loss_surface.png").stat().st_size > 10_000
    for claim in experiment.CLAIMS:
        claim.measure(m), claim.holds(m)
