"""Issue #12, settings and the residual promises: finite float settings, tau checked on every path, the
shape check of ``residual_add`` with chex asserts off, no bias before BatchNorm in the MLP blocks, and the
BatchNorm class's PyTorch default (rho = 0.1). Small shapes; the whole file runs in seconds."""

import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.data import Dataset
from resjax.nn import PlainMLP, ResidualBlock, ResidualMLP, ResidualStack, build_model, residual_add, tau_resnet
from resjax.nn.norms import BatchNorm, is_batch_norm, make_norm
from resjax.nn.resnet import ResNet, ResNetBlock, cifar_resnet
from resjax.train import make_train, run_config, train_config
from resjax.train.config import FLOAT_SETTINGS, check_train_config, image_train_config

pytestmark = pytest.mark.usefixtures("fast_compiles")  # tiny programs: XLA's optimisations cost more than they save

X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
IMAGES = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 4, 3)), jnp.float32)
NON_FINITE = (math.nan, math.inf, -math.inf)


def tiny_resnet(**kw) -> ResNet:
    """A one-stage conv ResNet of two blocks on 4x4 images."""
    return ResNet(stage_sizes=(2,), stage_widths=(4,), stem_width=4, **{"norm": "none", **kw})


def zero_vars(model, x, **kw):
    """Variables of the right shapes without running init (for checks that raise while tracing)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, **kw))
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


# ---- 1. settings: every float setting finite ----------------------------------------------------------------


def test_float_settings_are_every_float_of_the_train_config():
    """FLOAT_SETTINGS, the list the check walks, holds every float default of train_config (so a new float
    setting cannot escape the finiteness check unnoticed)."""
    c = train_config()
    floats = {k for k in c.keys() if isinstance(c[k], float)}
    assert floats == set(FLOAT_SETTINGS)


@pytest.mark.parametrize("bad", NON_FINITE, ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_non_finite_float_train_setting_is_refused_by_name(name, bad):
    # mutation: remove the check_finite_settings(c) call in check_train_config -> nan/inf of e.g.
    # decay_factor, warmup_epochs, adam_b1 (with sgd), momentum=inf... pass
    c = train_config(**{name: bad})
    with pytest.raises(ValueError, match=rf"^train\.{name}: must be a finite number, got {bad!r}$"):
        check_train_config(c)


def test_finite_defaults_and_milestones():
    check_train_config(train_config())
    check_train_config(image_train_config())
    with pytest.raises(ValueError, match=r"^train\.milestones: must be finite numbers"):
        check_train_config(image_train_config(milestones=(100, math.nan)))


def test_make_train_refuses_a_nan_learning_rate_before_training():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    data = Dataset(x[:32], y[:32], x[32:], y[32:])
    config = run_config(dict(kind="residual_mlp", width=8, num_blocks=2),
                        train_config(batch_size=8, epochs=1, learning_rate=math.nan))
    with pytest.raises(ValueError, match=r"train\.learning_rate: must be a finite number, got nan"):
        make_train(config, data)


@pytest.mark.parametrize("bad", NON_FINITE, ids=("nan", "inf", "-inf"))
def test_build_model_refuses_a_non_finite_float_field(bad):
    with pytest.raises(ValueError, match=rf"^model\.compression: must be a finite number, got {bad!r}$"):
        build_model(dict(kind="densenet_bc_cifar", depth=10, compression=bad))
    with pytest.raises(ValueError, match=r"^model\.stage_widths: must be a finite number"):
        build_model(dict(kind="resnet", stage_sizes=(1,), stage_widths=(bad,)))


@pytest.mark.parametrize("tau", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, "nan", "-0.5", "1/K^2"])
@pytest.mark.parametrize("kind", [dict(kind="residual_mlp", width=8, num_blocks=2, scaling="tau"),
                                  dict(kind="residual_mlp", width=8, num_blocks=2),  # tau set on a non-tau model
                                  dict(kind="tau_resnet", variant="tau", width=8, depth=3),
                                  dict(kind="cifar_resnet", depth=8, scaling="tau")], ids=("mlp", "mlp_none", "tau_resnet",
                                                                                         "cifar"))
def test_build_model_refuses_a_bad_tau_naming_model_tau(kind, tau):
    with pytest.raises(ValueError, match=r"^model\.tau: "):
        build_model({**kind, "tau": tau})


def test_build_model_keeps_good_taus():
    for tau in (0.5, 2, "1/sqrt(K)", "1/L", "1"):
        build_model(dict(kind="residual_mlp", width=8, num_blocks=2, scaling="tau", tau=tau))


# ---- 2a. tau <= 0 refused wherever it is concrete ------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf])
def test_a_concrete_tau_field_is_refused_at_construction(bad):
    """Numbers were only checked when the rule was evaluated; a traced tau at call time skipped that."""
    makers = [
        lambda: ResidualBlock(features=8, scaling="tau", tau=bad),
        lambda: ResidualMLP(width=8, num_blocks=2, scaling="tau", tau=bad),
        lambda: ResidualStack(width=8, num_blocks=2, scaling="tau", tau=bad),
        lambda: ResNetBlock(features=4, norm="none", scaling="tau", tau=bad),
        lambda: tiny_resnet(scaling="tau", tau=bad),
        lambda: cifar_resnet(8, scaling="tau", tau=bad),
        lambda: tau_resnet("tau", 8, 3, tau=bad),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=r"^tau: must be a finite number > 0"):
            make()


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, np.float32(0.0), jnp.array([0.5, -0.5])])
def test_a_concrete_tau_call_argument_is_refused(bad):
    for model, x in ((ResidualMLP(width=8, num_blocks=2, scaling="tau"), X),
                     (ResidualBlock(features=8, scaling="tau", num_blocks=2), X),
                     (tiny_resnet(scaling="tau"), IMAGES),
                     (tiny_resnet(scaling="tau", learnable_tau=True), IMAGES),  # the tau that starts the parameter
                     (ResNetBlock(features=3, norm="none", scaling="tau", num_blocks=2), IMAGES)):
        v = zero_vars(model, x)
        with pytest.raises(ValueError, match=r"^tau: must be a finite number > 0"):
            model.apply(v, x, tau=bad)
        with pytest.raises(ValueError, match=r"^tau: must be a finite number > 0"):
            model.init(jax.random.key(0), x, tau=bad)


def test_a_learned_tau_is_not_checked_as_a_call_argument():
    """ResNet(learnable_tau=True) hands its tau parameter to the blocks: a trained tau may be anything."""
    model = tiny_resnet(scaling="tau", learnable_tau=True)
    v = zero_vars(model, IMAGES)
    v["params"]["tau"] = jnp.float32(-0.5)
    jax.eval_shape(lambda: model.apply(v, IMAGES))


def test_a_traced_tau_is_not_checked_by_value():
    """A traced tau's value is unknown at trace time: tau = 0 under jit is the identity network (documented)."""
    model = ResidualStack(width=8, num_blocks=2, scaling="tau")
    v = model.init(jax.random.key(0), X)
    np.testing.assert_array_equal(jax.jit(lambda t: model.apply(v, X, tau=t))(0.0), X)
    ys = jax.jit(jax.vmap(lambda t: model.apply(v, X, tau=t)))(jnp.array([0.25, 0.5]))
    np.testing.assert_allclose(ys[1], model.apply(v, X, tau=0.5), rtol=1e-5, atol=1e-6)


# ---- 2b. a tau passed to a model that does not use it ------------------------------------------------------


NOT_TAU = [
    ("ResidualMLP", lambda: ResidualMLP(width=8, num_blocks=2), X),
    ("ResidualMLP", lambda: ResidualMLP(width=8, num_blocks=2, norm="batch", scaling="skipinit", scan=True), X),
    ("ResidualStack", lambda: ResidualStack(width=8, num_blocks=2, scaling="rescale"), X),
    ("ResidualBlock", lambda: ResidualBlock(features=8, scaling="fixup", num_blocks=3), X),
    ("ResNetBlock", lambda: ResNetBlock(features=3, norm="none"), IMAGES),
    ("ResNet", lambda: tiny_resnet(norm="batch"), IMAGES),
]


@pytest.mark.parametrize("name,make,x", NOT_TAU, ids=[f"{n}{i}" for i, (n, _, _) in enumerate(NOT_TAU)])
def test_tau_passed_to_a_model_without_tau_scaling_raises(name, make, x):
    """Before: silently ignored, so a tau sweep on the wrong model trained identical copies."""
    model = make()
    v = zero_vars(model, x)
    message = rf"^tau: {name} has scaling='\w+' and does not use tau"
    with pytest.raises(ValueError, match=message):  # concrete
        model.apply(v, x, tau=0.5)
    with pytest.raises(ValueError, match=message):  # traced, under jit
        jax.jit(lambda t: model.apply(v, x, tau=t))(jnp.float32(0.5))
    with pytest.raises(ValueError, match=message):  # traced, a vmapped sweep
        jax.vmap(lambda t: model.apply(v, x, tau=t))(jnp.array([0.25, 0.5]))
    jax.eval_shape(lambda: model.apply(v, x, train=False))  # without tau it traces


def test_tau_passed_to_init_of_a_model_without_tau_scaling_raises():
    with pytest.raises(ValueError, match=r"^tau: ResidualMLP has scaling='none'"):
        ResidualMLP(width=8, num_blocks=2).init(jax.random.key(0), X, tau=0.5)


# ---- 2c. a tau rule without the block count it needs ------------------------------------------------------


def test_standalone_tau_block_without_block_count_raises():
    """Before: num_blocks defaulted to 1, so every rule gave tau = 1."""
    for block, x in ((ResidualBlock(features=8, scaling="tau"), X),
                     (ResidualBlock(features=8, scaling="tau", tau="1/L"), X),
                     (ResNetBlock(features=3, norm="none", scaling="tau"), IMAGES)):
        with pytest.raises(ValueError, match=r"^num_blocks: the tau rule '1/(sqrt\(K\)|L)' needs the number of blocks K"):
            jax.eval_shape(lambda: block.init(jax.random.key(0), x))


def test_standalone_tau_block_with_block_count_or_explicit_tau_works():
    with jax.default_matmul_precision("highest"):
        counted = ResidualBlock(features=8, scaling="tau", num_blocks=4)
        v = counted.init(jax.random.key(0), X)
        y = counted.apply(v, X)
        np.testing.assert_allclose(y, counted.apply(v, X, tau=0.5), rtol=1e-6)  # 1/sqrt(4)
        assert not np.allclose(y, counted.apply(v, X, tau=1.0))
        bare = ResidualBlock(features=8, scaling="tau")  # no K needed: a tau at call time, a number, rule '1'
        np.testing.assert_allclose(bare.apply(v, X, tau=0.5), y, rtol=1e-6)
        np.testing.assert_allclose(ResidualBlock(features=8, scaling="tau", tau=0.5).apply(v, X), y, rtol=1e-6)
        np.testing.assert_allclose(ResidualBlock(features=8, scaling="tau", tau="1").apply(v, X),
                                   bare.apply(v, X, tau=1.0), rtol=1e-6)


def test_stacks_pass_their_block_count_to_the_rule():
    with jax.default_matmul_precision("highest"):
        for model in (ResidualMLP(width=8, num_blocks=4, scaling="tau"),
                      ResidualMLP(width=8, num_blocks=4, scaling="tau", scan=True)):
            v = model.init(jax.random.key(0), X)
            np.testing.assert_allclose(model.apply(v, X), model.apply(v, X, tau=0.5), rtol=1e-6)
        model = tiny_resnet(scaling="tau")  # 2 blocks: tau = 1/sqrt(2)
        v = jax.jit(model.init)(jax.random.key(0), IMAGES)
        apply = jax.jit(lambda v, t=None: model.apply(v, IMAGES, tau=t))
        np.testing.assert_allclose(apply(v), apply(v, 1 / math.sqrt(2)), rtol=1e-5)
        assert not np.allclose(apply(v), apply(v, 1.0))


# ---- 3. residual_add with chex asserts disabled ------------------------------------------------------------


def test_residual_add_refuses_unequal_shapes_with_chex_asserts_disabled():
    # mutation: remove the plain-Python `if skip_shape != branch_shape` check -> the (4, 1) branch
    # broadcasts onto the (4, 8) stream and this test fails
    skip, branch = jnp.ones((4, 8)), jnp.ones((4, 1))
    with pytest.raises(ValueError) as enabled:
        residual_add(skip, branch)
    assert isinstance(enabled.value.__cause__, AssertionError)  # chex's message kept as the cause
    chex.disable_asserts()
    try:
        with pytest.raises(ValueError) as disabled:
            residual_add(skip, branch)
        with pytest.raises(ValueError, match=r"skip shape \(4, 8\) and branch shape \(8,\) differ"):
            residual_add(skip, jnp.ones((8,)))
        np.testing.assert_array_equal(residual_add(skip, 2 * skip), 3 * skip)  # equal shapes still add
    finally:
        chex.enable_asserts()
    assert str(disabled.value) == str(enabled.value)
    assert "skip shape (4, 8) and branch shape (4, 1) differ" in str(disabled.value)


# ---- 4. no bias before BatchNorm in the MLP blocks ----------------------------------------------------------


def _params(model, x=X):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), x))["params"]


def test_no_bias_before_batchnorm_in_residual_blocks():
    post = _params(ResidualMLP(width=8, num_blocks=2, order="post", norm="batch", num_layers=2))
    for k in range(2):
        assert set(post[f"blocks_{k}"]["linear_0"]) == set(post[f"blocks_{k}"]["linear_1"]) == {"kernel"}
    # pre order: norm -> act -> linear; linear_0 feeds norm_1 (no bias), the last linear feeds the sum (bias)
    pre = _params(ResidualMLP(width=8, num_blocks=2, order="pre", norm="batch", num_layers=2, scan=True))
    assert set(pre["blocks"]["block"]["linear_0"]) == {"kernel"}
    assert set(pre["blocks"]["block"]["linear_1"]) == {"kernel", "bias"}
    one = _params(ResidualBlock(features=8, order="pre", norm="batch"))
    assert set(one["linear_0"]) == {"kernel", "bias"}
    partial_bn = functools.partial(nn.BatchNorm, use_running_average=True)
    assert set(_params(ResidualBlock(features=8, order="post", norm=partial_bn))["linear_0"]) == {"kernel"}
    # the stems and heads (no BatchNorm right after them) keep their biases
    assert set(post["stem"]) == set(post["head"]) == {"kernel", "bias"}


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_the_bias_stays_without_batchnorm(norm):
    post = _params(ResidualMLP(width=8, num_blocks=2, order="post", norm=norm, num_layers=2))
    assert set(post["blocks_0"]["linear_0"]) == set(post["blocks_0"]["linear_1"]) == {"kernel", "bias"}
    plain = _params(PlainMLP(width=8, depth=2, norm=norm))
    assert set(plain["blocks_0"]["linear_0"]) == set(plain["blocks_1"]["linear_0"]) == {"kernel", "bias"}


def test_no_bias_before_batchnorm_in_plain_mlps():
    for scan in (False, True):
        p = _params(PlainMLP(width=8, depth=2, norm="batch", scan=scan))
        hidden = [p["blocks"]["block"]["linear_0"]] if scan else [p["blocks_0"]["linear_0"], p["blocks_1"]["linear_0"]]
        assert all(set(h) == {"kernel"} for h in hidden)
        assert set(p["stem"]) == set(p["head"]) == {"kernel", "bias"}


def test_is_batch_norm():
    assert is_batch_norm("batch") and is_batch_norm(BatchNorm) and is_batch_norm(functools.partial(nn.BatchNorm))
    assert not any(is_batch_norm(k) for k in ("none", "layer", "group", nn.LayerNorm, functools.partial(nn.LayerNorm)))


# ---- 5. the BatchNorm class's default is PyTorch's rho = 0.1 ----------------------------------------------


def test_batchnorm_class_default_momentum_is_pytorch_rho():
    """The running mean after one training step from 0 is 0.1 x the batch mean (flax's 0.99 gave 0.01 x)."""
    # mutation: delete `momentum: float = ...` in resjax.nn.norms.BatchNorm -> 0.01 x the batch mean
    x = jnp.asarray(np.random.default_rng(2).normal(3.0, 2.0, size=(16, 5)), jnp.float32)
    for layer in (BatchNorm(use_running_average=False), None):
        if layer is None:  # make_norm's layer, for comparison: the same constants
            class Net(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return make_norm("batch", train=True, name="bn")(x)
            layer = Net()
        v = layer.init(jax.random.key(0), x)
        _, upd = layer.apply(v, x, mutable=["batch_stats"])
        stats = upd["batch_stats"].get("bn", upd["batch_stats"])
        np.testing.assert_allclose(stats["mean"], 0.1 * x.mean(0), rtol=1e-5)
        np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * x.var(0), rtol=1e-5)
    assert BatchNorm().momentum == 0.9 and BatchNorm().epsilon == 1e-5


# ---- issue #22 item 6: settings refused or named before training ------------------------------------------


def test_a_misspelt_setting_raises_instead_of_being_ignored():
    """Configs are locked once built (``config.train.lr = 0.5`` used to be silently ignored); existing settings
    and an optax function's argument dicts stay settable."""
    c = train_config()
    with pytest.raises(AttributeError, match='"lr" does not exist'):  # mutation: remove c.lock() -> fails (seen)
        c.lr = 0.5
    c.learning_rate = 0.5
    c.optimizer_args.b2 = 0.95  # mutation: remove the unlock of DICT_SETTINGS in train_config -> AttributeError
    assert c.learning_rate == 0.5 and c.optimizer_args.b2 == 0.95
    with pytest.raises(AttributeError, match='"lr" does not exist'):
        image_train_config().lr = 0.5


def test_a_trainer_without_data_and_an_empty_checkpoint_dir_are_named():
    from resjax.data import from_arrays
    from resjax.train import make_image_train

    with pytest.raises(ValueError, match="data: make_train needs data"):
        make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config()))
    with pytest.raises(ValueError, match="train_source: make_image_train needs data"):
        make_image_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config()), None)
    rng = np.random.default_rng(0)
    data = from_arrays(rng.normal(size=(8, 4)).astype(np.float32), np.arange(8) % 2)
    trainer = make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config(batch_size=4, epochs=1)),
                         data)
    with pytest.raises(ValueError, match="checkpoint_dir: an empty path"):
        trainer.fit(0, checkpoint_dir="")


def test_milestones_past_the_run_are_warned_about_naming_both_numbers():
    from resjax.train.schedules import check_schedule

    with pytest.warns(UserWarning, match=r"milestones: \(100, 150\) at or past the run's epochs=3"):
        check_schedule(image_train_config(epochs=3), 1)


# ---- issue #22 item 7: labels checked where a Dataset enters the on-device feeder -------------------------


@pytest.mark.parametrize("y_train, y_test, match", [
    ([0, 1, 2, 1], [0, 1000], r"data.y_test: example 1 has label 1000, a class the training split never has"),
    ([0, 1, -1, 1], [0, 1], r"data.y_train: example 2 has label -1"),
    ([0.0, 1.5, 1.0, 0.0], [0, 1], r"data.y_train: want integer class labels, got dtype float64"),
    ([0, 1, 1], [0, 1], r"data.y_train: 3 labels for the 4 examples of data.x_train"),
])
def test_bad_labels_of_a_dataset_are_named_before_training(y_train, y_test, match):
    # mutation: remove check_labels from make_train -> a 1001-class model, a wrapped -1, truncated floats
    x = np.zeros((4, 3), np.float32)
    data = Dataset(x, np.asarray(y_train), np.zeros((len(y_test), 3), np.float32), np.asarray(y_test))
    with pytest.raises(ValueError, match=match):
        make_train(run_config(dict(kind="plain_mlp", depth=1, width=4), train_config(batch_size=2)), data)


def test_a_label_outside_the_given_models_classes_is_named():
    data = Dataset(np.zeros((4, 3), np.float32), np.asarray([0, 1, 2, 10]), np.zeros((2, 3), np.float32),
                   np.asarray([0, 1]))
    with pytest.raises(ValueError, match=r"data.y_train: example 3 has label 10, outside the model's 0 .. 9"):
        make_train(run_config(train=train_config(batch_size=2)), data, model=PlainMLP(width=4, depth=1,
                                                                                      num_classes=10))


# ---- issue #22 item 5: optional caches that cannot be written -----------------------------------------------


def test_an_unwritable_compilation_cache_is_a_warning(tmp_path):
    """In a fresh process (this one's JAX already has the test run's cache folder): a cache folder through a
    file warns and the run goes on without it. Mutation: drop the try in enable_compilation_cache -> OSError."""
    import os
    import subprocess
    import sys

    (tmp_path / "file").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["RESJAX_COMPILATION_CACHE"] = str(tmp_path / "file" / "jax")
    code = "import resjax, jax.numpy as jnp; print(resjax.enable_compilation_cache(), float(jnp.ones(2).sum()))"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["None", "2.0"], out.stderr[-2000:]
    assert "compilation cache: cannot use" in out.stderr


def test_an_unwritable_mnist1d_cache_is_a_warning_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    from resjax.data import mnist1d

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path / "file"))
    with pytest.warns(UserWarning, match="mnist1d cache: could not write"):
        data = mnist1d.load_mnist1d()
    assert data.x_train.shape == (4000, 40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
