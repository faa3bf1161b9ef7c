"""Optimisers from optax by name or as objects, optax schedules by name, parameter groups and the learning
rate's dtype (``resjax.train.optim``, ``resjax.train.schedules``); the peers' presets are checked against
their own training steps in ``test_peer_training.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import common, degradation
from resjax.data import from_arrays
from resjax.train import make_image_train, make_optimizer, make_schedule, make_train, run_config, train_config
from resjax.train.optim import group_factors
from tests.small_data import separable_arrays


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


VECTORS = from_arrays(*separable_arrays(64, (10,)), *separable_arrays(32, (10,), seed=1))
MODEL = dict(kind="residual_mlp", width=8, num_blocks=1, norm="batch")  # one block: its programs compile faster
PARAMS = {"stem": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones((2,))}, "block_0": {"scale": jnp.ones((2,))},
          "tau": jnp.float32(1.0)}


def _config(**train):
    return run_config(MODEL, train_config(batch_size=16, epochs=2, **train))


def _step(tx, params=PARAMS, grads=None):
    """One step of ``tx`` from its initial state (gradients 0.5 by default), as one jitted program (eagerly, every
    op would compile a program of its own)."""
    @jax.jit
    def step(params, grads):
        grads = jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params) if grads is None else grads
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    return step(params, grads)


@pytest.mark.parametrize("make", [make_train, make_image_train], ids=["ondevice", "host"])
def test_adamw_by_name_and_as_an_object_train_alike(make):
    by_name = make(_config(optimizer="adamw", learning_rate=3e-3, weight_decay=0.05, weight_decay_on="all"), VECTORS)
    as_object = make(_config(learning_rate=3e-3, weight_decay=0.0), VECTORS,
                     optimizer=optax.adamw(3e-3, weight_decay=0.05))
    run_a, a = by_name.fit([0, 1])
    run_b, b = as_object.fit([0, 1])
    for name in ("train_loss", "test_error", "test_loss"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(run_a.state.params["head"]["kernel"], run_b.state.params["head"]["kernel"], rtol=1e-5,
                               atol=1e-7)
    assert np.all(a["lr"] == np.float32(3e-3)) and np.all(np.isnan(b["lr"]))  # the object's rate is its own
    assert np.all(a["train_loss"][:, 1] < a["train_loss"][:, 0])  # it trains


def test_a_factory_receives_the_per_run_rate_and_an_object_refuses_one():
    factory = make_train(_config(learning_rate=0.01), VECTORS, optimizer=lambda lr: optax.adam(lr))
    _, both = factory.fit([0, 0], hparams={"learning_rate": [0.01, 0.003]})
    _, slow = make_train(_config(learning_rate=0.003), VECTORS, optimizer=lambda lr: optax.adam(lr)).fit([0])
    np.testing.assert_allclose(both["train_loss"][1], slow["train_loss"][0], rtol=1e-6)
    assert not np.allclose(both["train_loss"][0], both["train_loss"][1])
    obj = make_train(_config(), VECTORS, optimizer=optax.sgd(0.01))
    with pytest.raises(ValueError, match="holds its own learning rate"):
        obj.fit([0, 1], hparams={"learning_rate": [0.1, 0.2]})


def test_adamw_decays_only_what_weight_decay_on_and_the_groups_say():
    """optax.adamw gets resjax's mask: with weight_decay_on='kernels' a bias with zero gradient stays put."""
    zero = jax.tree.map(jnp.zeros_like, PARAMS)
    out = _step(make_optimizer(train_config(optimizer="adamw", learning_rate=0.1, weight_decay=0.5,
                                            weight_decay_on="kernels"), PARAMS), grads=zero)
    assert np.all(out["stem"]["bias"] == 1.0) and np.allclose(out["stem"]["kernel"], 1 - 0.1 * 0.5)
    with pytest.raises(ValueError, match="weight_decay_factor other than 0 or 1"):
        make_optimizer(train_config(optimizer="adamw", weight_decay=0.1,
                                    param_groups=(dict(rank=0, weight_decay_factor=0.5),)), PARAMS)


def test_param_groups_select_by_pattern_rank_and_function():
    groups = (dict(match=r"^stem/bias$", lr_factor=0.5), dict(rank=0, lr_factor=0.1, weight_decay_factor=0.0),
              dict(where=lambda path, leaf: path.endswith("scale"), lr_factor=2.0))
    lr, wd = group_factors(PARAMS, groups, "all")
    assert lr == {"stem": {"kernel": 1.0, "bias": 0.5}, "block_0": {"scale": 2.0}, "tau": 0.1}
    assert wd == {"stem": {"kernel": 1.0, "bias": 1.0}, "block_0": {"scale": 1.0}, "tau": 0.0}
    # one plain SGD step: w - lr * f_lr * (g + wd * f_wd * w)
    out = _step(make_optimizer(train_config(learning_rate=0.1, weight_decay=0.2, weight_decay_on="all",
                                            param_groups=groups[:2]), PARAMS, param_groups=groups[2:]))
    np.testing.assert_allclose(out["stem"]["bias"], 1 - 0.1 * 0.5 * (0.5 + 0.2), rtol=1e-6)
    np.testing.assert_allclose(out["tau"], 1 - 0.1 * 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(out["block_0"]["scale"], 1 - 0.1 * 2.0 * (0.5 + 0.2), rtol=1e-6)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: selects no parameter"):
        make_optimizer(train_config(param_groups=(dict(match="stme"),)), PARAMS)
    with pytest.raises(ValueError, match=r"param_groups\[0\].where: a function goes through the API"):
        make_optimizer(train_config(param_groups=(dict(where=len),)), PARAMS)


@pytest.mark.parametrize("train, match", [
    (dict(optimizer="adamx"), "optimizer: unknown optimizer 'adamx'"),
    (dict(optimizer="lbfgs"), "optimizer: optax.lbfgs cannot train here"),
    (dict(optimizer="adamw", optimizer_args=dict(beta2=0.9)), "optimizer_args.beta2: optax.adamw has no argument"),
    (dict(optimizer="adamw", optimizer_args=dict(weight_decay=0.1)), "optimizer_args.weight_decay: set by resjax"),
    (dict(optimizer_args=dict(b1=0.9)), "optimizer_args: the built-in 'sgd'"),
    (dict(schedule="exponential_decay"), "schedule_args: optax.exponential_decay needs transition_steps"),
    (dict(schedule="cosine", schedule_args=dict(alpha=0.1)), "schedule_args: the built-in schedule 'cosine'"),
    (dict(schedule="warmup_cosine"), "schedule: unknown schedule 'warmup_cosine'"),
    (dict(param_groups=("fixupp",)), r"param_groups\[0\]: unknown preset 'fixupp'"),
    (dict(param_groups=(dict(rank=0, lr=0.1),)), r"param_groups\[0\]: unknown keys \['lr'\]"),
    (dict(param_groups=(dict(match="(", lr_factor=0.1),)), r"param_groups\[0\].match: not a regular expression"),
])
def test_bad_optimiser_settings_are_refused_by_name_before_training(train, match):
    with pytest.raises(ValueError, match=match):
        make_train(_config(**train), VECTORS)


def test_an_optax_schedule_by_name_multiplies_the_learning_rate():
    config = train_config(learning_rate=0.1, schedule="exponential_decay",
                          schedule_args=dict(transition_steps=4, decay_rate=0.5))
    rate = make_schedule(config, steps_per_epoch=4)
    np.testing.assert_allclose([float(rate(s)) for s in (0, 4, 8)], [0.1, 0.05, 0.025], rtol=1e-6)
    mine = make_schedule(train_config(learning_rate=0.1), 4, schedule=optax.cosine_decay_schedule(1.0, 8))
    np.testing.assert_allclose([float(mine(s)) for s in (0, 4, 8)], [0.1, 0.05, 0.0], rtol=1e-6, atol=1e-9)
    config.batch_size, config.epochs = 16, 2
    _, history = make_train(run_config(MODEL, config), VECTORS).fit(0)
    np.testing.assert_allclose(history["lr"], [0.1, 0.05], rtol=1e-6)  # 4 steps per epoch


def test_the_learning_rate_is_float64_under_x64():
    with jax.enable_x64(True):
        params = {"w": jnp.ones((3,), jnp.float64)}
        for schedule in ("constant", "step", "cosine"):
            config = train_config(learning_rate=0.1, schedule=schedule, milestones=(5,), epochs=10)
            assert make_schedule(config, 1)(0).dtype == jnp.float64
        out = _step(make_optimizer(train_config(learning_rate=0.1, weight_decay_on="all"), params),
                    params, {"w": jnp.full((3,), 0.5, jnp.float64)})
        assert out["w"].dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out["w"]), 1.0 - 0.1 * 0.5)  # exactly, not 1 - 0.10000000149 * 0.5
    assert make_schedule(train_config(learning_rate=0.1), 1)(0).dtype == jnp.float32


def test_optimiser_settings_from_the_command_line():
    config, _ = common.parse_args(degradation, ["--quick", "--train.optimizer", "adamw", "--train.optimizer_args",
                                                "dict(b2=0.95, eps=1e-6)", "--train.param_groups", "tau_resnet",
                                                "--train.schedule", "exponential_decay", "--train.schedule_args",
                                                "{'transition_steps': 10, 'decay_rate': 0.9}"])
    assert config.train.optimizer == "adamw" and config.train.optimizer_args.to_dict() == {"b2": 0.95, "eps": 1e-6}
    assert config.train.param_groups == ("tau_resnet",)
    assert config.train.schedule_args.to_dict() == {"transition_steps": 10, "decay_rate": 0.9}
    with pytest.raises(SystemExit):
        common.parse_args(degradation, ["--quick", "--train.optimizer_args", "b2"])
