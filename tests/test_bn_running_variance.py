"""BatchNorm's running-variance convention (``running_variance='unbiased'``, PyTorch's): imported tau-ResNet
BN weights give the PyTorch fixtures' evaluation outputs *and* their training-mode running statistics at once
(``tests/data/parity``, made by the repository's own code with ``tools/make_parity_fixtures.py``); the
default (flax's biased estimate) and every parameter name are unchanged."""

import functools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax import interop
from resjax.nn.norms import BatchNorm, UnbiasedBatchNorm, make_norm, running_variance_of
from resjax.nn.resnet import REPOSITORY_MODELS, cifar_resnet

pytestmark = pytest.mark.usefixtures("optimized_compiles")  # float64 convolutions
DATA = Path(__file__).parent / "data" / "parity"
TOL = 1e-12


def _fixture(name="tau_resnet_bn"):
    with np.load(DATA / f"{name}_resnet20.npz") as f:
        data = {k: f[k] for k in f.files}
    meta = json.loads(str(data.pop("meta")))
    group = lambda prefix: {k[len(prefix):]: v.astype(np.float64) if v.dtype.kind == "f" else v  # noqa: E731
                            for k, v in data.items() if k.startswith(prefix)}
    return meta, group("sd/"), group("after/"), data


def _rel(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == np.float64
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@functools.partial(jax.jit, static_argnames=("model", "train"))
def _apply(model, variables, x, train):
    """One program per model and mode (a model's two imports evaluated alike share it)."""
    if train:
        return model.apply(variables, x, train=True, mutable=["batch_stats"])
    return model.apply(variables, x, train=False), {}


def _forward(model, variables, x_nchw, train):
    return _apply(model, variables, jnp.asarray(np.transpose(x_nchw, (0, 2, 3, 1))), train=train)


def test_unbiased_option_gives_torchs_eval_logits_and_running_statistics_at_once():
    meta, sd, after, data = _fixture()
    settings = interop.repository_settings("tau_resnet_bn", running_variance="unbiased")
    model = cifar_resnet(meta["depth"], **meta["resjax"], **settings)
    default = cifar_resnet(meta["depth"], **meta["resjax"], **REPOSITORY_MODELS["tau_resnet_bn"])
    with jax.enable_x64(True):
        variables = interop.from_torch_state_dict(model, sd)  # one import, no bn_count
        np.testing.assert_array_equal(variables["batch_stats"]["stem_norm"]["var"], sd["bn1.running_var"])
        logits, _ = _forward(model, variables, data["x"], train=False)
        assert _rel(logits, data["logits_eval"]) < TOL
        logits, state = _forward(model, variables, data["x"], train=True)
        assert _rel(logits, data["logits_train"]) < TOL
        new = interop.to_torch_state_dict({**variables, **state}, model)
        assert set(after) == {k for k in new if k.endswith(("running_mean", "running_var"))} and len(after) == 42
        for k, v in after.items():
            assert _rel(new[k], v) < TOL, k

        # flax's default convention gets one of the two, never both: copied as it is, the training update's
        # running variance misses torch's by rho * var_batch / (n - 1); rescaled by bn_count, eval logits move
        plain = interop.from_torch_state_dict(default, sd)
        assert _rel(_forward(default, plain, data["x"], train=False)[0], data["logits_eval"]) < TOL
        _, state = _forward(default, plain, data["x"], train=True)
        new = interop.to_torch_state_dict({**plain, **state}, default)
        assert max(_rel(new[k], v) for k, v in after.items() if k.endswith("running_var")) > 1e-5
        counts = interop.bn_counts(default, (4, 32, 32, 3))
        counted = interop.from_torch_state_dict(default, sd, bn_count=counts)
        assert _rel(_forward(default, counted, data["x"], train=False)[0], data["logits_eval"]) > 1e-5


def test_two_sgd_steps_continue_exactly_with_the_unbiased_option(monkeypatch):
    """resjax's training step from the imported weights (no bn_count) against two steps of the repository's
    own training script: every stored tensor, the running statistics of both steps included. The run state the
    step starts from is initialised op by op without XLA's optimisation passes (its parameters, statistics and
    optimiser state are then replaced by the imported ones; with the passes its ~100 programs compile in ~6 s);
    the training step compiles with them (float64 convolutions)."""
    from resjax.train import image_train_config
    from resjax.train.core import Core
    from tests.conftest import xla_optimisations
    from tests.test_peer_training import assert_two_peer_steps

    init_run = Core.init_run

    def init_run_unoptimised(self, *args, **kwargs):
        with xla_optimisations(False):
            return init_run(self, *args, **kwargs)

    monkeypatch.setattr(Core, "init_run", init_run_unoptimised)

    meta, start, _, _ = _fixture()
    with np.load(DATA / "tau_resnet_bn_sgd_steps.npz") as f:
        steps = {k: f[k] for k in f.files}
    model = cifar_resnet(meta["depth"], **meta["resjax"],
                         **interop.repository_settings("tau_resnet_bn", running_variance="unbiased"))
    config = image_train_config(param_groups=("tau_resnet",))
    with jax.enable_x64(True):
        variables = interop.from_torch_state_dict(model, start)
        compared = assert_two_peer_steps(model, config, variables, steps)  # no bn_count: copied as they are
    assert [sum(k.endswith("running_var") for k in names) for names in compared] == [21, 21]


def test_same_parameter_names_round_trip_and_bn_count_refused():
    meta, sd, _, _ = _fixture()
    unbiased = cifar_resnet(20, **meta["resjax"], norm=UnbiasedBatchNorm,
                            **{k: v for k, v in REPOSITORY_MODELS["tau_resnet_bn"].items() if k != "norm"})
    assert unbiased == cifar_resnet(20, **meta["resjax"],
                                    **interop.repository_settings("tau_resnet_bn", running_variance="unbiased"))
    default = cifar_resnet(20, **meta["resjax"], **REPOSITORY_MODELS["tau_resnet_bn"])
    shapes = lambda m: jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))  # noqa: E731
    assert shapes(unbiased) == shapes(default)
    assert list(interop.torch_layout(unbiased)) == list(interop.torch_layout(default)) == list(sd)
    v = interop.from_torch_state_dict(unbiased, sd)
    back = interop.to_torch_state_dict(v, unbiased)
    assert list(back) == list(sd)
    assert all(np.array_equal(back[k], sd[k]) for k in sd if "num_batches" not in k)
    for call in (lambda: interop.from_torch_state_dict(unbiased, sd, bn_count=4096),
                 lambda: interop.to_torch_state_dict(v, unbiased, bn_count=4096)):
        with pytest.raises(ValueError, match="bn_count: this model's BatchNorm keeps PyTorch's unbiased"):
            call()
    assert interop.repository_settings("tau_resnet_bn") == REPOSITORY_MODELS["tau_resnet_bn"]
    for name in ("tau_resnet_nobn", "fixup"):
        assert interop.repository_settings(name, running_variance="unbiased") == REPOSITORY_MODELS[name]
    with pytest.raises(ValueError, match="running_variance"):
        interop.repository_settings("tau_resnet_bn", running_variance="population")
    with pytest.raises(ValueError, match="name"):
        interop.repository_settings("resnet20")


class _Norm(nn.Module):
    kind: object
    overrides: tuple = ()

    @nn.compact
    def __call__(self, x, train):
        return make_norm(self.kind, train=train, name="bn", **dict(self.overrides))(x)


@pytest.mark.parametrize("kind,overrides", [
    ("batch", (("running_variance", "unbiased"),)), (UnbiasedBatchNorm, ()),
    (functools.partial(BatchNorm, running_variance="unbiased"), ())])
def test_the_update_is_torchs_and_the_default_is_flaxs(kind, overrides):
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, (4, 3, 3, 5))
    n = 4 * 3 * 3
    with jax.enable_x64(True):
        layer = _Norm(kind, overrides)
        variables = layer.init(jax.random.PRNGKey(0), x, train=False)
        variables = {"params": variables["params"],
                     "batch_stats": {"bn": {"mean": rng.normal(size=5), "var": 0.5 + rng.random(5)}}}
        y, state = layer.apply(variables, x, train=True, mutable=["batch_stats"])
        y_default, state_default = _Norm("batch").apply(variables, x, train=True, mutable=["batch_stats"])
        old = variables["batch_stats"]["bn"]["var"]
        var = x.reshape(-1, 5).var(axis=0)
        np.testing.assert_array_equal(y, y_default)  # both normalise with the biased batch variance
        np.testing.assert_array_equal(state["batch_stats"]["bn"]["mean"], state_default["batch_stats"]["bn"]["mean"])
        np.testing.assert_allclose(state["batch_stats"]["bn"]["var"], 0.9 * old + 0.1 * var * n / (n - 1), rtol=1e-14)
        np.testing.assert_allclose(state_default["batch_stats"]["bn"]["var"], 0.9 * old + 0.1 * var, rtol=1e-14)
        # evaluation mode uses the stored estimate as it is
        np.testing.assert_array_equal(layer.apply(variables, x, train=False),
                                      _Norm("batch").apply(variables, x, train=False))
        # a mask: n counts the values it keeps
        mask = np.ones((4, 3, 3, 1), bool)
        mask[0] = False
        bn = (kind.func if isinstance(kind, functools.partial) else kind if kind != "batch" else BatchNorm)
        _, masked = bn(use_running_average=False, running_variance="unbiased").apply(
            {"params": variables["params"]["bn"], "batch_stats": variables["batch_stats"]["bn"]}, x, mask=mask,
            mutable=["batch_stats"])
        var, n = x[1:].reshape(-1, 5).var(axis=0), 27
        np.testing.assert_allclose(masked["batch_stats"]["var"], 0.9 * old + 0.1 * var * n / (n - 1), rtol=1e-14)


def test_settings_and_mixed_precision():
    assert BatchNorm.running_variance == "biased" and UnbiasedBatchNorm.running_variance == "unbiased"
    assert [running_variance_of(k) for k in ("batch", nn.BatchNorm, UnbiasedBatchNorm, "layer")] == [
        "biased", "biased", "unbiased", None]
    x = jnp.ones((4, 2, 2, 3))
    with pytest.raises(ValueError, match="running_variance"):
        _Norm("batch", (("running_variance", "sample"),)).init(jax.random.PRNGKey(0), x, train=True)
    with pytest.raises(ValueError, match="running_variance"):
        BatchNorm(use_running_average=False, running_variance="sample").init(jax.random.PRNGKey(0), x)

    class Half(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return make_norm(UnbiasedBatchNorm, train=train, name="bn", dtype=jnp.bfloat16)(x)

    variables = Half().init(jax.random.PRNGKey(0), x, train=False)
    assert variables["params"]["bn"]["scale"].dtype == jnp.float32
    y, state = Half().apply(variables, x, train=True, mutable=["batch_stats"])
    assert y.dtype == jnp.bfloat16 and state["batch_stats"]["bn"]["var"].dtype == jnp.float32
    with pytest.raises(ValueError, match="train"):  # the mode comes from train, as for 'batch'
        Half().apply(variables, x, train=None)
