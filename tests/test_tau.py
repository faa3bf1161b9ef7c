"""Zhang et al.'s tau-ResNet (resjax.nn.tau_resnet), log-space stability tracking (resjax.analysis.stability)
and the four issue-5 experiments (quick modes)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, fixup_one_step, tau_batchnorm_growth, tau_stability, tau_training
from resjax.analysis import stability
from resjax.analysis.propagation import stream_activations
from resjax.nn import PlainMLP, build_model, resolve_tau, stack_unrolled
from resjax.nn.tau_resnet import plain_params_from_residual, tau_resnet

X = jax.random.normal(jax.random.key(0), (6, 12))
V = jax.random.normal(jax.random.key(1), (6, 10))


def _scan_params_from_unrolled(kind, variables, depth):
    """The scanned layout of an unrolled tau_resnet's variables."""
    if kind == "plain":
        p = variables["params"]
        per = [p[f"hidden_{k}"] for k in range(depth)]
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per)
        return {"params": {"stem": p["stem"], "head": p["head"], "hidden_layers": {"layer": {"hidden": stacked}}}}
    return {name: stack_unrolled(col, depth) for name, col in variables.items()}


# ---- the model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tau", "bn", "fixup", "plain"])
def test_scan_equals_unrolled_for_every_kind(kind):
    depth = 5
    unrolled = tau_resnet(kind, 8, depth, tau=0.7, scan=False)
    scanned = tau_resnet(kind, 8, depth, tau=0.7, scan=True)
    v = unrolled.init(jax.random.key(2), X)
    if kind == "fixup":  # W_l = 0 makes every block the identity; compare on random W_l as well
        v = jax.tree_util.tree_map(lambda a: a, v)
        for k in range(depth):
            v["params"][f"blocks_{k}"]["linear_0"]["kernel"] = 0.3 * jax.random.normal(jax.random.key(k), (8, 8))
    vs = _scan_params_from_unrolled(kind, v, depth)
    with jax.default_matmul_precision("highest"):
        for train in ([False, True] if kind == "bn" else [False]):
            mutable = ["batch_stats"] if train else False
            a = unrolled.apply(v, X, train=train, mutable=mutable)
            b = scanned.apply(vs, X, train=train, mutable=mutable)
            a, b = (a[0], b[0]) if train else (a, b)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["none", "batch"])
def test_plain_mlp_scan_equals_unrolled(norm):
    depth = 4
    unrolled = PlainMLP(width=8, depth=depth, norm=norm, bias_init="fan_in")
    scanned = PlainMLP(width=8, depth=depth, norm=norm, bias_init="fan_in", scan=True)
    v = unrolled.init(jax.random.key(3), X)
    p = v["params"]
    layer = [{"hidden": p[f"hidden_{k}"], **({"norm": p[f"norm_{k}"]} if norm == "batch" else {})} for k in range(depth)]
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    vs = {"params": {"stem": p["stem"], "head": p["head"], "hidden_layers": {"layer": stack(layer)}}}
    if norm == "batch":
        vs["batch_stats"] = {"hidden_layers": {"layer": stack([{"norm": v["batch_stats"][f"norm_{k}"]}
                                                                for k in range(depth)])}}
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(unrolled.apply(v, X), scanned.apply(vs, X), rtol=1e-5, atol=1e-5)
        assert scanned.init(jax.random.key(3), X)["params"]["hidden_layers"]["layer"]["hidden"]["kernel"].shape == (depth, 8, 8)
    # the default is unchanged: unrolled, parameters named hidden_0 ...
    assert PlainMLP(width=8, depth=2).scan is False and "hidden_0" in p


def test_model_follows_the_papers_shapes_and_draws():
    model = tau_resnet("tau", 128, 50, tau="1/sqrt(L)")
    assert model.tau == pytest.approx(50 ** -0.5) and model.scaling == "tau" and model.order == "post"
    p = model.init(jax.random.key(4), X)["params"]
    assert set(p) == {"stem", "blocks", "head"} and "bias" not in p["stem"]
    assert set(p["blocks"]["block"]) == {"linear_0"} and set(p["blocks"]["block"]["linear_0"]) == {"kernel"}
    # A, W_l: variance 2/m (m = 128); B: variance 1/d (d = 10)
    assert np.var(p["stem"]["kernel"]) == pytest.approx(2 / 128, rel=0.1)
    assert np.var(p["blocks"]["block"]["linear_0"]["kernel"]) == pytest.approx(2 / 128, rel=0.02)
    assert np.var(p["head"]["kernel"]) == pytest.approx(1 / 10, rel=0.15)
    assert tau_resnet("tau", 8, 10, seed_indexing=True).num_blocks == 9
    # the config route used by make_train
    assert build_model(kind="tau_resnet", variant="plain", width=8, depth=3, num_classes=10).depth == 3


def test_fixup_block_is_the_identity_at_init():
    model = tau_resnet("fixup", 16, 7)
    v = model.init(jax.random.key(5), X)
    stream = stream_activations(model, v, X)
    for k in range(1, 8):
        np.testing.assert_array_equal(stream[k], stream[0])
    assert np.all(v["params"]["blocks"]["block"]["linear_0"]["kernel"] == 0)
    assert np.any(v["params"]["head"]["kernel"] != 0)  # the seed's B is random (not resjax's scaling='fixup')


# ---- log-space tracking -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind,scan", [("tau", True), ("tau", False), ("plain", True), ("plain", False)])
def test_log_space_tracking_equals_the_direct_pass(kind, scan):
    model = tau_resnet(kind, 16, 6, tau=0.8, scan=scan)
    v = model.init(jax.random.key(6), X)
    with jax.default_matmul_precision("highest"):
        out = stability.log_space_propagation(model, v, X, cotangent=V)
        direct = stability.direct_norms(model, v, X)
        np.testing.assert_allclose(np.exp(out["log_norm"]), direct, rtol=1e-4)
        np.testing.assert_allclose(np.exp(out["log_ratio"]), direct / direct[:1], rtol=1e-4)
        np.testing.assert_allclose(np.exp(out["log_output_norm"]), jnp.linalg.norm(model.apply(v, X), axis=-1), rtol=1e-4)
        if scan:  # per-example gradient of <v_i, y_i> with respect to each W_l, by autodiff
            def f(p, i):
                return jnp.sum(V[i] * model.apply({"params": p}, X[i:i + 1])[0])
            path = ("blocks", "block", "linear_0") if kind == "tau" else ("hidden_layers", "layer", "hidden")
            for i in (0, 3):
                g = jax.grad(f)(v["params"], i)
                for name in path:
                    g = g[name]
                direct_g = jnp.linalg.norm(g["kernel"].reshape(6, -1), axis=-1)
                np.testing.assert_allclose(np.exp(out["log_grad_norm"][:, i]), direct_g, rtol=1e-4)


def test_log_space_stays_finite_where_float32_overflows():
    model = tau_resnet("tau", 16, 400, tau=1.0)
    v = model.init(jax.random.key(7), X)
    direct = stability.direct_norms(model, v, X)
    assert not np.all(np.isfinite(direct[-1]))  # |h_L| beyond float32
    out = jax.jit(lambda v: stability.log_space_propagation(model, v, X, cotangent=V))(v)
    assert np.all(np.isfinite(out["log_ratio"])) and np.all(np.isfinite(out["log_grad_norm"]))
    assert np.median(out["log_ratio"][-1]) / np.log(10) > 40
    # where the direct pass is finite, the two agree
    ok = np.isfinite(direct).all(axis=1) & (direct.max(axis=1) < 1e30)
    np.testing.assert_allclose(np.exp(out["log_norm"][ok]), direct[ok], rtol=1e-3)


def test_tau_inverse_sqrt_depth_keeps_the_forward_ratio_bounded_and_quarter_power_grows():
    width, draws = 32, 8
    x = jax.random.normal(jax.random.key(8), (4, 12))
    medians = {}
    for depth in (4, 16, 64):
        model = tau_resnet("tau", width, depth, tau=1.0)
        params = jax.vmap(lambda k: model.init(k, x))(jax.random.split(jax.random.key(depth), draws))
        run = jax.jit(jax.vmap(lambda v, t: stability.log_space_propagation(model, v, x, tau=t, backward=False)
                               ["log_ratio"][-1], in_axes=(0, None)))
        for name, t in (("sqrt", depth ** -0.5), ("quarter", depth ** -0.25)):
            medians[name, depth] = float(np.exp(np.median(run(params, jnp.float32(t)))))
    for depth in (4, 16, 64):
        assert 0.25 <= medians["sqrt", depth] <= 4, medians
    assert medians["quarter", 4] < medians["quarter", 16] < medians["quarter", 64]
    assert medians["quarter", 64] > 2 * medians["sqrt", 64]


def test_log_space_refuses_a_non_homogeneous_module():
    x = X[:4]
    bn = tau_resnet("bn", 8, 3)
    with pytest.raises(ValueError, match="norm"):
        stability.log_space_propagation(bn, bn.init(jax.random.key(0), x), x)
    biased = PlainMLP(width=8, depth=2)
    with pytest.raises(ValueError, match="use_bias"):
        stability.log_space_propagation(biased, biased.init(jax.random.key(0), x), x)
    plain = tau_resnet("plain", 8, 3)
    with pytest.raises(ValueError, match="tau"):
        stability.log_space_propagation(plain, plain.init(jax.random.key(0), x), x, tau=0.5)


def test_plain_params_share_the_residual_draws():
    res, plain = tau_resnet("tau", 8, 4), tau_resnet("plain", 8, 4)
    p = res.init(jax.random.key(9), X)["params"]
    q = plain_params_from_residual(p)
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(plain.init(jax.random.key(0), X)["params"])
    np.testing.assert_array_equal(q["hidden_layers"]["layer"]["hidden"]["kernel"], p["blocks"]["block"]["linear_0"]["kernel"])


def test_batchnorm_after_the_branch_grows_like_sqrt_l():
    model = tau_resnet("bn", 32, 300)
    x = jax.random.normal(jax.random.key(10), (64, 12))
    stream = jax.jit(lambda v: stream_activations(model, v, x, train=True))(model.init(jax.random.key(11), x))
    curve = np.asarray(jnp.mean(jnp.linalg.norm(stream, axis=-1), axis=-1))
    assert abs(stability.log_log_slope(curve, start=30) - 0.5) < 0.15


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,setting", [
    (dict(tau=0.0), "tau"), (dict(tau=-0.5), "tau"), (dict(tau="1/L^2"), "tau"), (dict(tau="-1"), "tau"),
    (dict(depth=0), "depth"), (dict(depth=1, seed_indexing=True), "depth"), (dict(kind="resnet"), "kind"),
    (dict(width=0), "width"),
])
def test_bad_settings_raise_value_error_naming_them(kwargs, setting):
    args = {"kind": "tau", "width": 8, "depth": 4, **kwargs}
    with pytest.raises(ValueError, match=setting):
        tau_resnet(args.pop("kind"), args.pop("width"), args.pop("depth"), **args)


def test_resolve_tau_refuses_non_positive_values():
    assert resolve_tau("1/sqrt(L)", 100) == pytest.approx(0.1)
    for bad in (0, -1.0, "0", "nan"):
        with pytest.raises(ValueError, match="tau"):
            resolve_tau(bad, 10)
    with pytest.raises(ValueError, match="variant"):
        build_model(kind="tau_resnet", width=8, depth=3)


# ---- experiments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("module,keys", [
    (tau_stability, ["log10_forward_norm_ratio.L^-1/2.L4", "forward_norm_ratio.1.L4", "median_grad_norm.L^-1/4.L4",
                     "median_grad_norm.plain.L4", "total_grad_norm.L^-1.L4"]),
    (tau_batchnorm_growth, ["bn_norm_growth_exponent", "curves.bn_mean_norm"]),
    (fixup_one_step, ["log10_output_norm_after_one_step.fixup.L4", "log10_output_norm_after_one_step.tau.L4"]),
    (tau_training, ["final_train_loss.plain.L4", "final_train_loss.tau=1/sqrt(L).L4", "diverged_epoch.tau=1/L^(1/4).L4"]),
])
def test_quick_mode_writes_results(module, keys, tmp_path):
    common.run_experiment(module, module.get_config("quick"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["experiment"] == module.NAME
    for k in keys:
        assert k in results["metrics"], k
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 10_000
    for claim in module.CLAIMS:  # every claim evaluates (or says it cannot) on the quick metrics
        try:
            claim.measure(results["metrics"])
            claim.holds(results["metrics"])
        except (KeyError, ValueError, IndexError, ZeroDivisionError):
            pass
