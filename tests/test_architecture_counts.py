"""Conv blocks (resjax.nn.conv_blocks) and the architecture_counts experiment: exact lecture counts,
merge contracts, forward + backward under jit on tiny shapes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import architecture_counts as ac
from experiments import common
from resjax.nn.block import ResidualBlock
from resjax.nn.conv_blocks import (BasicBranch, BottleneckBranch, ConvResidualBlock, DenseBlock, DenseLayer,
                                   Transition, conv_kernel_weights)


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    out = tmp_path_factory.mktemp("architecture_counts")
    results = common.run_experiment(ac, ac.get_config("quick"), out)
    assert (out / "results.json").exists() and (out / f"{ac.NAME}.png").exists()
    assert json.loads((out / "results.json").read_text())["experiment"] == ac.NAME
    return results["metrics"]


def test_bottleneck_counts(metrics):
    assert metrics["bottleneck.basic_weights"] == 2 * 9 * 256 ** 2 == 1_179_648
    assert metrics["bottleneck.bottleneck_weights"] == 256 * 64 + 9 * 64 ** 2 + 64 * 256 == 69_632
    assert round(metrics["bottleneck.basic_weights"] / metrics["bottleneck.bottleneck_weights"]) == 17
    assert round(100 * metrics["bottleneck.one_by_one_share"]) == 47
    assert metrics["bottleneck.three_by_three_fraction"] == 1 / 32


def test_dense_counts(metrics):
    assert metrics["dense.channels_in"] == [64 + 32 * k for k in range(12)]
    assert metrics["dense.channels_in"][11] == 416
    assert metrics["dense.conv_weights"][11] == 119_808
    assert metrics["residual_stage.conv_weights"] == [36_864] * 12
    assert metrics["dense.conv_weights"][2] == metrics["residual_stage.conv_weights"][2]  # level at layer 3
    assert metrics["dense.level_layer"] == 3


def test_claims_hold(metrics):
    for claim in ac.CLAIMS:
        assert claim.holds(metrics), claim.text
    assert "416" in ac.report_section(metrics)


def test_counts_exclude_biases_and_norms():
    """With norm='none' the convs carry biases; the weight count is unchanged."""
    x = jax.ShapeDtypeStruct((1, 4, 4, 32), jnp.float32)
    for norm in ("none", "batch"):
        p = jax.eval_shape(lambda k, x: BottleneckBranch(32, 8, norm=norm).init(k, x), jax.random.PRNGKey(0), x)
        assert sum(conv_kernel_weights(p["params"]).values()) == 32 * 8 + 9 * 8 * 8 + 8 * 32


def test_mismatched_add_and_concat_raise():
    x = jnp.ones((2, 8, 8, 16))
    bad = ConvResidualBlock(BasicBranch(8))  # branch gives 8 channels on a 16-channel stream
    with pytest.raises(ValueError, match=r"^inputs: ResidualBlock takes inputs of width 8 \(features=8: the skip is "
                                         r"the identity\), got width 16"):
        bad.init(jax.random.PRNGKey(0), x)
    # a branch of one's own without the width check still meets residual_add's
    with pytest.raises(ValueError, match="residual_add"):
        ResidualBlock(16, branch=BasicBranch(8)).init(jax.random.PRNGKey(0), x)
    from resjax.nn.residual import concat_merge
    with pytest.raises(ValueError, match="concat_merge"):
        concat_merge(x, jnp.ones((2, 4, 4, 8)))  # spatial sizes differ
    assert concat_merge(x, jnp.ones((2, 8, 8, 4))).shape == (2, 8, 8, 20)


@pytest.mark.parametrize("name", ["basic", "bottleneck", "dense", "dense_b", "transition"])
def test_forward_backward_jit(name):
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 16))
    module, out_shape = {
        "basic": (ConvResidualBlock(BasicBranch(16)), (2, 8, 8, 16)),
        "bottleneck": (ConvResidualBlock(BottleneckBranch(16, 4)), (2, 8, 8, 16)),
        "dense": (DenseBlock(3, 4), (2, 8, 8, 16 + 3 * 4)),
        "dense_b": (DenseBlock(2, 4, bottleneck=True), (2, 8, 8, 16 + 2 * 4)),
        "transition": (Transition(0.5), (2, 4, 4, 8)),
    }[name]
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), x)  # one program (eagerly: one per operation)
    assert set(variables) == {"params", "batch_stats"}

    @jax.jit
    def loss_and_grad(params, x):  # and the evaluation-mode output, in the same program
        def loss(p):
            y, updates = module.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, True,
                                      mutable=["batch_stats"])
            return jnp.mean(y ** 2), (y, updates)
        return jax.value_and_grad(loss, has_aux=True)(params), module.apply(variables, x, False)

    ((value, (y, updates)), grads), y_eval = loss_and_grad(variables["params"], x)
    assert y.shape == out_shape
    assert np.isfinite(float(value))
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    assert "batch_stats" in updates
    assert y_eval.shape == out_shape


def test_dense_layer_bottleneck_width():
    x = jax.ShapeDtypeStruct((1, 4, 4, 24), jnp.float32)
    p = jax.eval_shape(lambda k, x: DenseLayer(8, bottleneck=True).init(k, x), jax.random.PRNGKey(0), x)["params"]
    w = conv_kernel_weights(p)
    assert w == {"conv1x1": 24 * 32, "conv3x3": 9 * 32 * 8}


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="compression"):
        Transition(0.0)
    with pytest.raises(ValueError, match="growth_rate"):
        DenseBlock(3, 0)
    with pytest.raises(ValueError, match="norm"):
        BasicBranch(8, norm="bogus")
