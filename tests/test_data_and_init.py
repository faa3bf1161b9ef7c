"""MNIST-1D generation and caching; initialisers and norms by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.data import load_dataset, load_mnist1d
from resjax.data import mnist1d as mnist1d_module
from resjax.nn import INITIALIZERS, NORMS, get_initializer, make_norm


def test_mnist1d_shapes_types_and_standardisation():
    d = load_mnist1d()
    assert d.x_train.shape == (4000, 40) and d.x_test.shape == (1000, 40)
    assert d.y_train.shape == (4000,) and d.y_test.shape == (1000,)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
    assert d.num_classes == 10 and set(np.unique(d.y_train)) == set(range(10))
    everything = np.concatenate([d.x_train, d.x_test])
    assert abs(everything.mean()) < 1e-3 and abs(everything.std() - 1.0) < 1e-3


def test_mnist1d_is_cached_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path))
    fresh = load_mnist1d()
    assert (tmp_path / "mnist1d_default.npz").exists()

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated although cached")

    monkeypatch.setattr("mnist1d.data.make_dataset", no_generation)
    cached = load_mnist1d()
    for a, b in zip(fresh, cached):
        np.testing.assert_array_equal(a, b)
    assert mnist1d_module.cache_dir() == tmp_path


def test_unknown_dataset_names_the_setting():
    with pytest.raises(ValueError, match="data.name"):
        load_dataset("mnist2d")


@pytest.mark.parametrize("name, variance", [
    ("he_normal_fan_in", 2 / 300), ("he_normal_fan_out", 2 / 200), ("he_uniform_fan_in", 2 / 300),
    ("he_uniform_fan_out", 2 / 200), ("fan_in", 1 / 300), ("torch_default", 1 / 900), ("zeros", 0.0),
])
def test_initialiser_variances(name, variance):
    w = get_initializer(name)(jax.random.key(0), (300, 200))
    assert abs(float(jnp.var(w)) - variance) <= 0.03 * variance + 1e-12
    assert abs(float(jnp.var(get_initializer(name, gain=0.5)(jax.random.key(0), (300, 200)))) - variance / 4) <= 0.03 * variance + 1e-12


def test_uniform_initialisers_are_bounded_like_pytorch_kaiming_uniform():
    w = get_initializer("he_uniform")(jax.random.key(0), (64, 64))
    assert float(jnp.max(jnp.abs(w))) <= np.sqrt(6 / 64)


def test_every_listed_initialiser_resolves_and_unknown_raises():
    for name in INITIALIZERS:
        assert get_initializer(name)(jax.random.key(0), (3, 3)).shape == (3, 3)
    with pytest.raises(ValueError, match="kernel_init"):
        get_initializer("xavier")


@pytest.mark.parametrize("kind", [k for k in NORMS if k != "instance"])
def test_norms_by_name(kind):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return make_norm(kind, train=train, num_groups=4)(x) if kind == "group" else make_norm(kind, train=train)(x)

    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (32, 16))
    v = Net().init(jax.random.key(1), x, True)
    y, _ = Net().apply(v, x, True, mutable=["batch_stats"])
    if kind == "none":
        np.testing.assert_array_equal(y, x)
    elif kind == "batch":
        np.testing.assert_allclose(jnp.mean(y, 0), 0.0, atol=1e-5)
        np.testing.assert_allclose(jnp.var(y, 0), 1.0, atol=1e-3)
        assert set(v) == {"params", "batch_stats"}
    else:  # per-example normalisation
        np.testing.assert_allclose(jnp.mean(y, 1), 0.0, atol=1e-5)


def test_instance_norm_on_images():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return make_norm("instance", train=True)(x)

    x = 1.0 + jax.random.normal(jax.random.key(0), (2, 5, 5, 3))
    y = Net().apply(Net().init(jax.random.key(1), x), x)
    np.testing.assert_allclose(jnp.mean(y, (1, 2)), 0.0, atol=1e-5)


def test_unknown_norm_names_the_setting():
    with pytest.raises(ValueError, match="norm"):
        make_norm("weight", train=True)
