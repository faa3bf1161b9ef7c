"""BatchNorm and the other normalisations: the worked example, the hand steps against flax's layer,
running estimates, batch noise, normalisation axes, train/eval modes, per-seed statistics, errors."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import batch_noise, batchnorm_example, common, normalisation_axes, running_estimates
from resjax.analysis import batchnorm as bn
from resjax.nn import make_norm
from resjax.train import make_train
from tests.test_training import DATA, tiny_config


def test_worked_example_to_two_decimals():
    steps = bn.batchnorm_steps([2.0, 4.0, 6.0, 8.0], gamma=2.0, delta=1.0, epsilon=0.0)
    y, _ = bn.apply_norm("batch", np.array([[2.0], [4.0], [6.0], [8.0]]), train=True, gamma=2.0, delta=1.0,
                         epsilon=0.0)
    lecture = [-1.68, 0.11, 1.89, 3.68]
    np.testing.assert_allclose(np.round(np.asarray(y, np.float64)[:, 0], 2), lecture, atol=1e-12)
    np.testing.assert_allclose(np.round(np.asarray(steps["output"], np.float64), 2), lecture, atol=1e-12)
    np.testing.assert_allclose(np.round(np.asarray(steps["standardised"], np.float64), 2), [-1.34, -0.45, 0.45, 1.34],
                               atol=1e-12)
    assert float(steps["mean"]) == 5.0 and float(steps["var_population"]) == 5.0
    assert round(float(steps["var_unbiased"]), 2) == 6.67


@pytest.mark.parametrize("shape, axis", [((16, 5), 0), ((4, 3, 3, 6), (0, 1, 2))])
def test_hand_steps_equal_flax_layer(shape, axis):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = 2.0 + 3.0 * jax.random.normal(k1, shape)
    gamma = 1 + jax.random.uniform(k2, shape[-1:])
    delta = jax.random.normal(k3, shape[-1:])
    y, stats = bn.apply_norm("batch", x, train=True, gamma=gamma, delta=delta, rho=1.0)
    steps = bn.batchnorm_steps(x, gamma, delta, epsilon=1e-5, axis=axis)
    np.testing.assert_allclose(y, steps["output"], rtol=1e-5, atol=1e-5)
    # rho = 1 stores exactly this batch's mean and (population) variance
    np.testing.assert_allclose(stats["mean"], steps["mean"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats["var"], steps["var_population"], rtol=1e-5)


@pytest.mark.parametrize("rho", [1.0, 0.3, 0.1, 0.01])
def test_running_update_equals_flax_batch_stats_update(rho):
    x = 1.0 + 2.0 * jax.random.normal(jax.random.key(1), (32, 4))
    old = {"mean": jnp.array([0.5, -1.0, 2.0, 0.0]), "var": jnp.array([1.0, 3.0, 0.5, 2.0])}
    _, new = bn.apply_norm("batch", x, train=True, batch_stats=old, rho=rho)
    # flax's statistics: E[x] and E[x^2] - E[x]^2 (its fast variance)
    m = jnp.mean(x, 0)
    v = jnp.maximum(0.0, jnp.mean(x ** 2, 0) - m ** 2)
    # equal up to float32 rounding (XLA may fuse the layer's arithmetic differently)
    np.testing.assert_allclose(new["mean"], bn.running_update(old["mean"], m, rho), rtol=5e-7, atol=1e-7)
    np.testing.assert_allclose(new["var"], bn.running_update(old["var"], v, rho), rtol=5e-7, atol=1e-7)
    if rho != 1.0:  # the other convention (PyTorch's momentum passed as flax's) is clearly different
        assert np.abs(new["mean"] - bn.running_update(old["mean"], m, 1.0 - rho)).max() > 1e-3
    # make_norm's own momentum is flax's: momentum = 1 - rho gives the same update
    _, same = bn.apply_norm("batch", x, train=True, batch_stats=old, momentum=1.0 - rho)
    jax.tree_util.tree_map(np.testing.assert_array_equal, same, new)


def test_running_estimate_over_many_steps_equals_the_layer():
    means = jnp.asarray(bn.drifting_mean(60, 10, 40, 0.0, 2.0)) + 0.3 * jax.random.normal(jax.random.key(2), (60,))
    trace = running_estimates.layer_trace(means, 0.1, 0.0)
    np.testing.assert_allclose(trace, bn.running_estimate(means, 0.1, 0.0), atol=1e-6)
    split = bn.lag_and_noise(bn.drifting_mean(60, 10, 40, 0.0, 2.0), means, 0.1, 0.0)
    np.testing.assert_allclose(split["estimate"], bn.drifting_mean(60, 10, 40, 0.0, 2.0) - split["lag"] + split["noise"],
                               atol=1e-5)


def test_momentum_conventions():
    assert bn.flax_from_rho(0.1) == pytest.approx(0.9) and bn.rho_from_flax(0.99) == pytest.approx(0.01)
    assert bn.torch_from_rho(0.1) == 0.1 and bn.rho_from_torch(0.1) == 0.1
    assert bn.flax_from_torch(0.1) == pytest.approx(0.9) and bn.torch_from_flax(0.9) == pytest.approx(0.1)
    assert bn.unbiased_from_population(5.0, 4) == pytest.approx(20 / 3)
    assert bn.lag_steps(0.1) == pytest.approx(9.0)
    assert bn.noise_std(1.0, 0.3) == pytest.approx(0.3)


def test_batch_noise_std_falls_like_one_over_sqrt_batch():
    sizes = (4, 16, 64)
    key = jax.random.key(3)
    y = np.asarray(bn.example_outputs(key, 2.5, sizes, 600, data_mean=1.0, data_std=2.0))
    std = y.std(axis=1)
    assert abs(bn.loglog_slope(sizes, std) + 0.5) < 0.1
    np.testing.assert_allclose(std * np.sqrt(sizes), std[-1] * 8, rtol=0.25)
    np.testing.assert_allclose(np.median(y[-1]), 0.75, atol=0.05)
    hand = np.asarray(bn.example_outputs(key, 2.5, sizes, 600, data_mean=1.0, data_std=2.0, via="hand"))
    np.testing.assert_allclose(y, hand, atol=1e-3)
    # the masked batch of 4 is exactly the example plus the first 3 others, unmasked
    others = 1.0 + 2.0 * jax.random.normal(jax.random.fold_in(key, 4), (600, 63))
    first = jnp.concatenate([jnp.array([2.5]), others[0, :3]])[:, None]
    np.testing.assert_allclose(y[0, 0], bn.apply_norm("batch", first, train=True, epsilon=0.0)[0][0, 0], rtol=1e-6)


# ---- normalisation axes ----------------------------------------------------------------------------

AXES_CASES = {  # name: (kind, layer_axes, NCHW axes of the lecture's table)
    "batch": ("batch", "position", (0, 2, 3)),
    "layer": ("layer", "example", (1, 2, 3)),
    "layer_default": ("layer", "position", (1,)),
    "group": ("group", "position", (1, 2, 3)),
    "instance": ("instance", "position", (2, 3)),
}


@pytest.mark.parametrize("name", list(AXES_CASES))
def test_layer_statistics_equal_numpy_reduction_over_documented_axes(name):
    kind, layer_axes, nchw = AXES_CASES[name]
    assert bn.reduction_axes(kind, "NCHW", layer_axes) == nchw
    nhwc = bn.reduction_axes(kind, "NHWC", layer_axes)
    assert nhwc == tuple(sorted((0, 3, 1, 2)[a] for a in nchw))
    x_nchw = np.asarray(jax.random.normal(jax.random.key(4), (4, 8, 3, 3)) * 2
                        + 3 * jax.random.normal(jax.random.key(5), (4, 8, 1, 1)), np.float32)
    x = bn.nchw_to_nhwc(x_nchw)
    overrides = bn.layer_overrides(kind, layer_axes, num_groups=2)
    y, stats = bn.apply_norm(kind, x, train=True, rho=1.0, **overrides) if kind == "batch" else \
        bn.apply_norm(kind, x, train=True, **overrides)
    labels = bn.statistic_groups(kind, x.shape, num_groups=2, layer_axes=layer_axes)
    ref, mean, var = bn.normalise_by_groups(x, labels, 1e-5)
    np.testing.assert_allclose(y, ref, atol=1e-4)
    if kind == "batch":  # the stored statistics are the numpy reduction over (B, H, W) of the NHWC array
        np.testing.assert_allclose(stats["mean"], x_nchw.mean((0, 2, 3)), atol=1e-5)
        np.testing.assert_allclose(stats["var"], x_nchw.var((0, 2, 3)), rtol=1e-4)
        np.testing.assert_allclose(mean[0, 0, 0], x.mean(nhwc), atol=1e-6)
    elif kind != "group":  # the documented groups are exactly a reduction over the documented axes
        np.testing.assert_allclose(mean, np.broadcast_to(x.astype(np.float64).mean(nhwc, keepdims=True), x.shape),
                                   atol=1e-9)
        np.testing.assert_allclose(var, np.broadcast_to(x.astype(np.float64).var(nhwc, keepdims=True), x.shape),
                                   atol=1e-9)
    found = bn.groups_from_layer(lambda v: bn.apply_norm(kind, v, train=True, **overrides)[0], x[:2, :2, :2])
    assert bn.same_partition(found, bn.statistic_groups(kind, (2, 2, 2, 8), num_groups=2, layer_axes=layer_axes))


# ---- train and eval --------------------------------------------------------------------------------


def test_train_mode_uses_batch_statistics_and_updates_running_estimates():
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(6), (32, 4))
    stored = {"mean": jnp.full((4,), -1.0), "var": jnp.full((4,), 9.0)}
    y, new = bn.apply_norm("batch", x, train=True, batch_stats=stored)  # resjax default: rho 0.1
    np.testing.assert_allclose(y, (x - x.mean(0)) / jnp.sqrt(x.var(0) + 1e-5), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new["mean"], 0.9 * -1.0 + 0.1 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(new["var"], 0.9 * 9.0 + 0.1 * x.var(0), rtol=1e-5)


def test_eval_mode_uses_stored_statistics_and_changes_nothing():
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(7), (1, 4))  # a single example is fine in eval mode
    stored = {"mean": jnp.arange(4.0), "var": jnp.full((4,), 4.0)}
    y, same = bn.apply_norm("batch", x, train=False, batch_stats=stored)
    np.testing.assert_allclose(y, (x - stored["mean"]) / jnp.sqrt(4.0 + 1e-5), rtol=1e-6)
    module = bn.norm_module("batch")
    variables = {"params": {"norm": {"scale": jnp.ones(4), "bias": jnp.zeros(4)}}, "batch_stats": {"norm": stored}}
    _, upd = module.apply(variables, x, False, mutable=["batch_stats"])
    jax.tree_util.tree_map(np.testing.assert_array_equal, upd["batch_stats"]["norm"], stored)


def test_vmapped_batchnorm_keeps_statistics_per_element():
    xs = jnp.stack([jax.random.normal(jax.random.key(8), (16, 3)), 5 + jax.random.normal(jax.random.key(9), (16, 3))])
    ys, stats = jax.vmap(lambda x: bn.apply_norm("batch", x, train=True, rho=1.0))(xs)
    for i in range(2):
        y, s = bn.apply_norm("batch", xs[i], train=True, rho=1.0)
        np.testing.assert_allclose(ys[i], y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(stats["mean"][i], xs[i].mean(0), rtol=1e-5, atol=1e-6)


def test_seed_vmapped_training_keeps_batch_stats_per_seed():
    config = tiny_config()  # residual MLP with BatchNorm, the same data for every seed
    config.train.epochs = 2
    trainer = make_train(config, DATA)
    k0, k1 = jax.random.split(jax.random.key(10), 2)
    mixed, _ = trainer.sweep(jnp.stack([k0, k1]))
    leaves = jax.tree_util.tree_leaves(mixed.state.batch_stats)
    assert leaves and all(leaf.shape[0] == 2 for leaf in leaves)
    assert not any(np.allclose(leaf[0], leaf[1]) for leaf in leaves)  # different init: different statistics
    # Each seed's statistics are those of that seed run beside a copy of itself (the same compiled
    # program): they do not depend on the seed-mate, so nothing is pooled across the seed axis.
    for i, k in enumerate((k0, k1)):
        alone, _ = trainer.sweep(jnp.stack([k, k]))
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a[i], b[0], rtol=1e-5, atol=1e-6),
                               mixed.state.batch_stats, alone.state.batch_stats)


# ---- errors ----------------------------------------------------------------------------------------


class _Net(nn.Module):
    kind: str
    kw: tuple = ()

    @nn.compact
    def __call__(self, x, train):
        return make_norm(self.kind, train=train, **dict(self.kw))(x)


def test_batch_of_one_in_training_mode_names_the_setting():
    x = jnp.ones((1, 4))
    net = _Net("batch")
    v = net.init(jax.random.key(0), x, True)  # init needs shapes only
    with pytest.raises(ValueError, match="batch_size"):
        net.apply(v, x, True, mutable=["batch_stats"])
    net.apply(v, x, False)  # evaluation mode is fine
    with pytest.raises(ValueError, match="batch_size"):
        bn.apply_norm("batch", x, train=True)
    with pytest.raises(ValueError, match="batch_size"):
        bn.example_outputs(jax.random.key(0), 2.5, (1, 8), 10)
    with pytest.raises(ValueError, match="batch_size"):
        bn.batchnorm_steps([3.0])


def test_group_count_that_does_not_divide_channels_names_the_setting():
    x = jnp.ones((2, 3, 3, 8))
    with pytest.raises(ValueError, match="num_groups"):
        _Net("group", (("num_groups", 3),)).init(jax.random.key(0), x, True)
    with pytest.raises(ValueError, match="num_groups"):
        bn.statistic_groups("group", (2, 3, 3, 8), num_groups=3)
    _Net("group", (("num_groups", 4),)).init(jax.random.key(0), x, True)


@pytest.mark.parametrize("rho", [0.0, -0.1, 1.5])
def test_rho_outside_unit_interval_names_the_setting(rho):
    with pytest.raises(ValueError, match="rho"):
        bn.running_update(0.0, 1.0, rho)
    with pytest.raises(ValueError, match="rho"):
        bn.flax_from_rho(rho)
    with pytest.raises(ValueError, match="rho"):
        _Net("batch", (("rho", rho),)).init(jax.random.key(0), jnp.ones((4, 2)), True)
    with pytest.raises(ValueError, match="momentum"):
        _Net("batch", (("momentum", 1.0 - rho),)).init(jax.random.key(0), jnp.ones((4, 2)), True)
    config = running_estimates.get_config("quick")
    config.rhos = (0.1, rho)
    with pytest.raises(ValueError, match="rho"):
        running_estimates.run(config, None)


# ---- experiments -----------------------------------------------------------------------------------

EXPERIMENTS = {
    batchnorm_example: ("output.layer", "variance.population", "max_abs_diff.layer_vs_hand"),
    batch_noise: ("batch_noise.b8.centre", "batch_noise.b8.mean", "batch_noise.b8.std", "batch_noise.b64.centre",
                  "batch_noise.b64.mean", "batch_noise.b64.std", "sweep.loglog_slope"),
    running_estimates: ("lag.fast.at_drift_end", "lag.slow.at_drift_end", "noise.fast.std", "noise.slow.std"),
    normalisation_axes: tuple(f"max_abs_diff.{n}" for n in normalisation_axes.LAYERS),
}


@pytest.mark.parametrize("module", list(EXPERIMENTS), ids=lambda m: m.NAME)
def test_quick_experiment_writes_results(module, tmp_path):
    common.run_experiment(module, module.get_config("quick"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["experiment"] == module.NAME
    for name in EXPERIMENTS[module]:
        assert name in results["metrics"], name
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 10_000
    m = results["metrics"]
    for claim in module.CLAIMS:
        claim.measure(m)
        held = claim.holds(m)
        if module in (batchnorm_example, normalisation_axes, running_estimates):  # no sampling at stake
            assert held in (True, None), claim.text
    assert module.report_section(m)


# ---- train has no default: forgetting it is an error, not a silent evaluation-mode run ----------------------


def _bn_models():
    from resjax.nn import DenseNet, PlainMLP, ResidualMLP, UNet, cifar_resnet, tau_resnet

    mlp_x, img_x = jnp.ones((4, 40)), jnp.ones((2, 16, 16, 3))
    return [
        ("ResidualMLP", ResidualMLP(width=8, num_blocks=2, norm="batch"), mlp_x),
        ("ResidualMLP scan", ResidualMLP(width=8, num_blocks=2, norm="batch", scan=True), mlp_x),
        ("PlainMLP", PlainMLP(width=8, depth=2, norm="batch"), mlp_x),
        ("tau_resnet bn", tau_resnet("bn", width=8, depth=3), mlp_x),
        ("cifar_resnet", cifar_resnet(8), img_x),
        ("DenseNet", DenseNet(block_layers=(2, 2), growth_rate=4, init_features=8, num_classes=10, stem="cifar"),
         img_x),
        ("UNet", UNet(features=(4, 8), out_channels=2), img_x),
    ]


@pytest.mark.parametrize("index", range(7), ids=lambda i: _bn_models()[i][0])
def test_a_batchnorm_model_applied_without_train_raises(index):
    """``init`` (shapes only) needs no ``train``; ``apply`` without it raises naming ``train`` and the layer,
    directly, under jit and under vmap; with ``train`` given both modes run."""
    _, model, x = _bn_models()[index]
    variables = jax.jit(model.init)(jax.random.key(0), x)  # jitted: one program (op by op: one per op)
    assert "batch_stats" in variables
    for call in (lambda: model.apply(variables, x), lambda: jax.jit(lambda v: model.apply(v, x))(variables),
                 lambda: jax.vmap(lambda xi: model.apply(variables, xi))(jnp.stack([x, x]))):
        with pytest.raises(ValueError, match=r"^train: this model has BatchNorm \(layer [\w/]+\)"):
            call()
    out_eval, (out_train, updates) = jax.jit(lambda v: (  # both modes in one program
        model.apply(v, x, train=False), model.apply(v, x, train=True, mutable=["batch_stats"])))(variables)
    assert out_eval.shape == out_train.shape
    changed = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)),
                                                               updates["batch_stats"], variables["batch_stats"]))
    assert any(changed)


def test_a_model_without_batchnorm_needs_no_train():
    from resjax.nn import ResidualMLP

    model, x = ResidualMLP(width=8, num_blocks=2, norm="layer"), jnp.ones((4, 40))
    variables = model.init(jax.random.key(0), x)
    np.testing.assert_array_equal(model.apply(variables, x), model.apply(variables, x, train=True))


def test_worked_example_runs_on_a_minibatch_of_another_length(tmp_path):
    """``--minibatch`` of 3 values used to crash after the run, in the comparison with the lecture's 4 outputs;
    the layer still equals the steps by hand, and the comparison with the lecture is null (not applicable)."""
    config = batchnorm_example.get_config("quick")
    config.minibatch = (1.0, 2.0, 4.0)
    common.run_experiment(batchnorm_example, config, tmp_path)
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert len(m["output.layer"]) == 3 and m["max_abs_diff.layer_vs_hand"] <= 1e-5
    assert m["max_abs_diff.layer_vs_lecture"] is None
