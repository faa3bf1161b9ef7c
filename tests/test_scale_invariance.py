"""Scale invariance of a weight layer followed by BatchNorm (lecture 000, "Scale invariance")."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common
from experiments import scale_invariance as experiment
from resjax.analysis import scale_invariance as si
from resjax.nn import PlainMLP

EPS0 = functools.partial(nn.BatchNorm, use_running_average=False, epsilon=0.0, momentum=0.9)
X = jax.random.normal(jax.random.key(0), (32, 10))
Y = jnp.arange(32) % 10
MODEL = PlainMLP(width=16, depth=2, norm=EPS0)
VARIABLES = PlainMLP(width=16, depth=2, norm="batch").init(jax.random.key(1), X)


@pytest.fixture(scope="module")
def loss_fn():
    return jax.jit(si.weight_loss_fn(MODEL, VARIABLES, X, Y, "blocks_1/linear_0/kernel", train=True))


@pytest.mark.parametrize("a", [0.1, 0.7, 3.0, 25.0])
def test_the_four_identities_hold_to_float32_tolerance(loss_fn, a):
    w = si.get_weight(VARIABLES, "blocks_1/linear_0/kernel")
    with jax.default_matmul_precision("highest"):
        r = si.scale_identities(loss_fn, w, a, alpha=0.1)
    assert r["loss"] < 1e-5
    assert r["grad"] < 1e-4
    assert r["cosine"] < 1e-5
    assert r["step"] < 1e-4
    assert r["grad_norm_aw"] == pytest.approx(r["grad_norm"] / a, rel=1e-4)


def test_epsilon_breaks_the_invariance_at_small_scale():
    model = PlainMLP(width=16, depth=2, norm="batch")  # epsilon 1e-5
    f = jax.jit(si.weight_loss_fn(model, VARIABLES, X, Y, ("blocks_0", "linear_0", "kernel"), train=True))
    w = si.get_weight(VARIABLES, "blocks_0/linear_0/kernel")
    with jax.default_matmul_precision("highest"):
        small, large = si.scale_identities(f, w, 0.01, 0.1), si.scale_identities(f, w, 10.0, 0.1)
    assert small["grad"] > 100 * large["grad"]


def test_effective_learning_rate_relation(loss_fn):
    """A step from aW at rate alpha points where a step from W at rate alpha / a^2 points; the angle turned
    is arctan(alpha |g| / |W|) (perpendicular step) and the effective learning rate is alpha / |W|^2."""
    w = si.get_weight(VARIABLES, "blocks_1/linear_0/kernel")
    a, alpha = 4.0, 0.2
    with jax.default_matmul_precision("highest"):
        g, g_a = jax.grad(loss_fn)(w), jax.grad(loss_fn)(a * w)
    at_aw = si.sgd_step_geometry(a * w, g_a, alpha)
    at_w = si.sgd_step_geometry(w, g, si.equivalent_learning_rate(alpha, a))
    np.testing.assert_allclose(at_aw["angle"], at_w["angle"], rtol=1e-4)
    np.testing.assert_allclose(at_aw["angle"], at_aw["predicted_angle"], rtol=1e-4)
    np.testing.assert_allclose(at_aw["effective_learning_rate"], alpha / (a ** 2 * np.sum(np.square(w))), rtol=1e-6)
    np.testing.assert_allclose(si.effective_learning_rate(alpha, a * w),
                               si.effective_learning_rate(alpha / a ** 2, w), rtol=1e-5)
    # Recovering the step from the weights before and after gives the same description.
    new = a * w - alpha * (g_a + 0.01 * a * w)
    rec = si.step_geometry_from_update(a * w, new, alpha, 0.01)
    direct = si.sgd_step_geometry(a * w, g_a, alpha, 0.01)
    np.testing.assert_allclose(rec["angle"], direct["angle"], rtol=1e-3)


def test_angle_between_is_accurate_for_tiny_angles():
    u = jnp.array([1.0, 0.0, 0.0])
    v = jnp.array([1.0, 1e-5, 0.0])
    np.testing.assert_allclose(si.angle_between(u, v), 1e-5, rtol=1e-4)


def test_bad_inputs_raise_value_error_naming_the_setting(loss_fn):
    w = si.get_weight(VARIABLES, "blocks_1/linear_0/kernel")
    with pytest.raises(ValueError, match="^a:"):
        si.scale_identities(loss_fn, w, 0.0, 0.1)
    with pytest.raises(ValueError, match="^a:"):
        si.scale_identities(loss_fn, w, -2.0, 0.1)
    with pytest.raises(ValueError, match="^alpha:"):
        si.scale_identities(loss_fn, w, 2.0, -0.1)
    with pytest.raises(ValueError, match="^weights:"):
        si.scale_identities(loss_fn, jnp.zeros_like(w), 2.0, 0.1)
    with pytest.raises(ValueError, match="^path:"):
        si.weight_loss_fn(MODEL, VARIABLES, X, Y, "blocks_9/linear_0/kernel", train=True)
    with pytest.raises(ValueError, match="^path:"):
        si.get_weight(VARIABLES, "blocks_0/linear_0")
    with pytest.raises(ValueError, match="^inputs:"):
        si.weight_loss_fn(MODEL, VARIABLES, X[:1], Y[:1], "blocks_0/linear_0/kernel", train=True)
    with pytest.raises(ValueError, match="^weight:"):
        si.replace_weight(VARIABLES, "blocks_0/linear_0/kernel", jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="^weight_decay:"):
        si.sgd_step_geometry(w, w, 0.1, weight_decay=-1.0)
    c = experiment.get_config("quick")
    c.scales = (0.0,)
    with pytest.raises(ValueError, match="^a:"):
        experiment.run(c, None)


def test_quick_experiment_writes_results(tmp_path):
    results = common.run_experiment(experiment, experiment.get_config("quick"), tmp_path)
    m = results["metrics"]
    for i in experiment.IDENTITIES:
        assert m[f"identities.eps0.{i}.max"] < experiment.TOL[i]
        assert f"identities.eps_default.{i}.max" in m
    assert len(m["train.wd0.norm_ratio"]) == results["config"]["num_seeds"]
    assert min(m["train.wd0.nondecreasing_fraction"]) == 1.0
    assert (tmp_path / "results.json").exists() and (tmp_path / "scale_invariance.png").stat().st_size > 10_000
    for claim in experiment.CLAIMS:
        claim.measure(m), claim.holds(m)
