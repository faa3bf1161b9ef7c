"""Mixed precision (issue #13): the conv models' ``dtype`` setting (``resjax.nn.precision``).

bfloat16 computation with float32 parameters, optimiser state, BatchNorm statistics and logits; training in
bfloat16 follows float32; the float32 default is bit-identical to an explicit float32; bad settings name
``dtype``. Small shapes: ResNets of widths 4-8 on 8x8 images, batch 8.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn import DTYPES, PlainMLP, ResidualMLP, ResidualStack, ResNet, build_model, make_norm, resolve_dtype
from resjax.train import image_train_config, make_image_train, run_config

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)

#: A CIFAR-style ResNet-8 (one basic block per stage) at widths 4/8/8: BatchNorm, option A.
SMALL = dict(kind="resnet", stage_sizes=(1, 1, 1), stage_widths=(4, 8, 8), stem_width=4)

# bfloat16 against float32 from the same seed (bfloat16 keeps 8 significant bits: one rounding is 2^-9 = 2e-3
# relative). Measured on the project's 2-core CPU, training SMALL for 8 SGD steps (2 epochs of 4 minibatches
# of 8, learning rate 0.05): the largest relative difference of a minibatch loss is 1.7e-2 (step 7; the
# trajectories drift apart), of an epoch's mean training loss 7.8e-3, of the final test loss 3.4e-3; one
# forward pass of each family at initialisation differs by at most 4.9e-4.
#: Tolerance of each minibatch loss (measured 1.7e-2).
STEP_RTOL = 4e-2
#: Tolerance of an epoch's mean training loss and of the test loss (measured 7.8e-3 and 3.4e-3).
LOSS_RTOL = 2e-2
#: Tolerance of one forward pass's loss (measured 4.9e-4).
FORWARD_RTOL = 5e-3


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


class Images:
    """The image-source interface of ``resjax.data`` on a tiny in-memory set: a colour per class plus noise."""

    def __init__(self, num_examples=32, seed=0, image_shape=(8, 8, 3), num_classes=4):
        rng = np.random.default_rng(seed)
        colours = np.random.default_rng(123).normal(size=(num_classes, 1, 1, image_shape[-1]))
        self.labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
        self.images = (colours[self.labels] + rng.normal(size=(num_examples, *image_shape))).astype(np.float32)
        self.num_examples, self.num_classes, self.image_shape = num_examples, num_classes, image_shape

    def num_batches(self, batch_size, drop_remainder=True):
        return self.num_examples // batch_size if drop_remainder else -(-self.num_examples // batch_size)

    def epoch(self, epoch, batch_size, *, seed=0, shuffle=True, augment=False, drop_remainder=True):
        order = np.random.default_rng([seed, epoch]).permutation(self.num_examples)
        for i in range(self.num_batches(batch_size, drop_remainder)):
            idx = order[i * batch_size:(i + 1) * batch_size]
            yield self.images[idx], self.labels[idx]


def _trainer(model=SMALL, epochs=2, **model_fields):
    config = run_config(dict(model, **model_fields), train=image_train_config(
        epochs=epochs, batch_size=8, eval_batch_size=16, milestones=(epochs,), learning_rate=0.05, augment=False))
    return make_image_train(config, Images(), Images(16, seed=1))


@pytest.fixture(scope="module")
def trainers():
    """One trainer per ``dtype`` setting (``None``: not given), built once: their compiled steps are shared."""
    return {dtype: _trainer(**({} if dtype is None else {"dtype": dtype})) for dtype in (None, "float32", "bfloat16")}


def _float_dtypes(tree):
    return {leaf.dtype for leaf in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)}


def _train(trainer, epochs=2):
    """Per-step training losses, the final test loss and the final state, from seed 0."""
    run, losses = trainer.init(0), []
    for epoch in range(epochs):
        for x, y in trainer.train_source.epoch(epoch, 8, seed=0):
            run, (loss, _) = trainer.step(run, jnp.asarray(x), jnp.asarray(y))
            assert loss.dtype == F32
            losses.append(float(loss))
    return np.array(losses), float(trainer.evaluate(run)["loss"]), run


def test_collections_stay_float32_and_computation_is_bfloat16(trainers):
    trainer = trainers["bfloat16"]
    assert trainer.model.dtype == "bfloat16"
    run = trainer.init(0)
    ts = run.state
    assert _float_dtypes(ts.params) == {F32} and _float_dtypes(ts.batch_stats) == {F32}
    assert _float_dtypes(ts.opt_state) == {F32}

    x, y = next(trainer.train_source.epoch(0, 8, seed=0))
    apply = jax.jit(lambda v, x: trainer.model.apply(v, x, train=True, capture_intermediates=True,
                                                    mutable=["batch_stats", "intermediates"]))
    logits, state = apply(ts.variables(), x)
    assert logits.shape == (8, 4) and logits.dtype == F32
    inter = state["intermediates"]
    assert inter["stem_conv"]["__call__"][0].dtype == BF16                     # a conv's output
    assert inter["stage2_first"]["conv_1"]["__call__"][0].shape == (8, 4, 4, 8)
    assert inter["stage2_first"]["conv_1"]["__call__"][0].dtype == BF16
    assert inter["stage3_first"]["norm_0"]["__call__"][-1].dtype == BF16       # BatchNorm's output
    assert inter["head"]["__call__"][0].dtype == BF16                          # the classifier, cast after
    assert inter["stage3_first"]["block_out"][0].dtype == BF16                 # the residual sum
    assert _float_dtypes(state["batch_stats"]) == {F32}

    before = jax.device_get(ts.batch_stats)
    run, (loss, error) = trainer.step(run, jnp.asarray(x), jnp.asarray(y))
    ts = run.state
    assert loss.dtype == F32 and np.isfinite(float(loss)) and int(ts.step) == 1
    assert _float_dtypes(ts.params) == {F32} and _float_dtypes(ts.batch_stats) == {F32}
    assert _float_dtypes(ts.opt_state) == {F32}
    assert jax.tree_util.tree_structure(ts.params) == jax.tree_util.tree_structure(trainer.init(0).state.params)
    moved = jax.tree_util.tree_map(lambda a, b: not np.array_equal(a, b), before, jax.device_get(ts.batch_stats))
    assert all(jax.tree_util.tree_leaves(moved))                             # the running estimates were updated


def test_batchnorm_statistics_are_float32():
    # An input away from zero (mean 10): reduced in bfloat16 (8 significant bits) the statistics would be off
    # by ~1e-2 relative; in float32 the running estimates match numpy's float64 statistics of the (bfloat16)
    # input to float32 rounding (flax's one-pass variance E[x^2] - E[x]^2 loses ~1e-5 here).
    x = (10.0 + jax.random.normal(jax.random.key(0), (64, 4, 4, 3))).astype(jnp.bfloat16)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return make_norm("batch", train=train, name="bn", dtype=jnp.bfloat16)(x)

    variables = Net().init(jax.random.key(1), x, train=False)
    y, updates = Net().apply(variables, x, train=True, mutable=["batch_stats"])
    assert y.dtype == BF16
    stats = updates["batch_stats"]["bn"]
    assert stats["mean"].dtype == F32 and stats["var"].dtype == F32
    assert _float_dtypes(variables["params"]) == {F32}
    x64 = np.asarray(x, np.float64).reshape(-1, 3)
    np.testing.assert_allclose(stats["mean"], 0.1 * x64.mean(0), rtol=1e-6)
    np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * x64.var(0), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(y, np.float32).reshape(-1, 3).mean(0), 0, atol=2e-2)


@pytest.mark.parametrize("fields", [
    dict(SMALL, norm="none", scaling="fixup", option_a_input="conv_input"),                  # scalar parameters
    dict(SMALL, norm="none", scaling="tau", scalar_biases=True, learnable_tau=True, stem_head_biases=False),
    dict(SMALL, stage_sizes=(2, 1, 1), order="pre", shortcut="B", scan=True, scaling="skipinit"),
    dict(kind="taki_resnet", num_blocks=2, features=4, kernel_size=3, norm="batch", kernel_init="he_normal"),
    dict(kind="densenet_bc_cifar", depth=10, growth_rate=4),
], ids=["fixup", "tau_nobn", "pre_B_scan_skipinit", "taki_bn", "densenet"])
def test_every_family_float32_parameters_and_bit_identical_default(fields):
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    y = jnp.arange(4) % 4
    default, f32, bf16 = (build_model(fields, num_classes=4, **kw) for kw in ({}, {"dtype": "float32"},
                                                                             {"dtype": jnp.bfloat16}))
    assert repr(f32) == repr(default) and "dtype" not in repr(default)  # checkpoints made before still match
    assert "bfloat16" in repr(bf16)
    variables = jax.jit(lambda key: default.init(key, x, train=False))(jax.random.key(1))
    assert _float_dtypes(variables) == {F32}
    assert _float_dtypes(jax.eval_shape(lambda key: bf16.init(key, x, train=False), jax.random.key(1))) == {F32}

    # float32 spelled out is the default, bit for bit (forward in both modes)
    @jax.jit
    def forward(variables):
        return [(m.apply(variables, x, train=True, mutable=["batch_stats"]), m.apply(variables, x, train=False))
                for m in (default, f32)]
    out_default, out_f32 = forward(variables)
    for a, b in zip(jax.tree_util.tree_leaves(out_default), jax.tree_util.tree_leaves(out_f32)):
        np.testing.assert_array_equal(a, b)

    @jax.jit
    @jax.value_and_grad
    def bf16_loss(params):
        logits, state = bf16.apply({**variables, "params": params}, x, train=True, capture_intermediates=True,
                                   mutable=["batch_stats", "intermediates"])
        assert logits.dtype == F32 and _float_dtypes(state.get("batch_stats", {})) <= {F32}
        convs = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state["intermediates"])
                 if "conv" in jax.tree_util.keystr(path) and leaf.ndim == 4]
        assert convs and {c.dtype for c in convs} == {BF16}
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])

    loss, grads = bf16_loss(variables["params"])
    assert loss.dtype == F32 and _float_dtypes(grads) == {F32}
    logits = out_default[0][0]  # the default model in training mode
    np.testing.assert_allclose(float(loss), float(-jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])),
                               rtol=FORWARD_RTOL)


def test_bfloat16_training_follows_float32_and_float32_is_bit_identical(trainers):
    (l_def, t_def, run_def), (l_f32, t_f32, run_f32), (l_bf, t_bf, run_bf) = (
        _train(trainers[dtype]) for dtype in (None, "float32", "bfloat16"))

    # float32 spelled out is the default, bit for bit: every minibatch loss, the test loss, every leaf
    np.testing.assert_array_equal(l_f32, l_def)
    assert t_f32 == t_def
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(run_f32.state)),
                    jax.tree_util.tree_leaves(jax.device_get(run_def.state))):
        np.testing.assert_array_equal(a, b)

    # bfloat16 follows float32 at every step and in each epoch's mean, and learns
    assert len(l_bf) == 8 and np.all(np.isfinite(l_bf)) and not np.array_equal(l_bf, l_def)  # really bfloat16
    np.testing.assert_allclose(l_bf, l_def, rtol=STEP_RTOL)
    np.testing.assert_allclose(l_bf.reshape(2, 4).mean(1), l_def.reshape(2, 4).mean(1), rtol=LOSS_RTOL)
    np.testing.assert_allclose(t_bf, t_def, rtol=LOSS_RTOL)
    assert l_bf[4:].mean() < l_bf[:4].mean()
    assert _float_dtypes(run_bf.state) == {F32}


def test_bad_dtype_settings_name_the_setting():
    for bad in ("bf17", "float64", jnp.float64, jnp.int32, True, 3):
        with pytest.raises(ValueError, match=r"^model\.dtype: unknown value .*choose one of \('float32', "):
            build_model(SMALL, dtype=bad)
    with pytest.raises(ValueError, match=r"^dtype: unknown value 'bf17'"):
        ResNet(stage_sizes=(1,), stage_widths=(4,), dtype="bf17")
    with pytest.raises(ValueError, match=r"^model\.dtype: unknown value 'bf17'"):
        _trainer(dtype="bf17")  # before anything compiles
    with pytest.raises(ValueError, match=r"^model\.dtype: 'bfloat16' is not available for model\.kind='residual_mlp'"):
        build_model(dict(kind="residual_mlp", width=8, num_blocks=2, dtype="bfloat16"), num_classes=4)
    for cls, kw in ((ResidualMLP, dict(num_blocks=2)), (PlainMLP, dict(depth=2)), (ResidualStack, dict(num_blocks=2))):
        for half in ("bfloat16", jnp.float16):  # the classes agree with build_model: float32 only
            with pytest.raises(ValueError, match=rf"^dtype: .* is not available for {cls.__name__}, which computes in "
                                                 "float32 only"):
                cls(width=8, dtype=half, **kw)
        cls(width=8, dtype="float32", **kw)
    # float32 means what those kinds compute in: accepted (and dropped)
    build_model(dict(kind="residual_mlp", width=8, num_blocks=2, dtype="float32"), num_classes=4)
    assert [resolve_dtype(d) for d in DTYPES] == [F32, BF16, jnp.dtype(jnp.float16)]
    assert resolve_dtype(None) is None and resolve_dtype(jnp.bfloat16) == BF16
