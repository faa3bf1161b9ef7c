"""``load_mnist1d(**args)``: the generator's arguments, the cache keyed by them, and ``shuffle_length``."""

import numpy as np
import pytest

from resjax.data import load_dataset, load_mnist1d
from resjax.data import mnist1d as mnist1d_module


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path))
    return tmp_path


def test_shuffle_length_is_one_fixed_permutation_of_every_example(cache):
    plain = load_mnist1d()
    shuffled = load_mnist1d(shuffle_length=True)
    perm = mnist1d_module.length_permutation(40)
    assert sorted(perm.tolist()) == list(range(40)) and not np.array_equal(perm, np.arange(40))
    # the same permutation for every example of train and test: column i of the shuffled set is column perm[i]
    np.testing.assert_array_equal(shuffled.x_train, plain.x_train[:, perm])
    np.testing.assert_array_equal(shuffled.x_test, plain.x_test[:, perm])
    np.testing.assert_array_equal(shuffled.y_train, plain.y_train)
    np.testing.assert_array_equal(shuffled.y_test, plain.y_test)
    # recover the permutation from the data alone, example by example: each shuffled column equals exactly one
    # plain column in every example (no example is permuted differently)
    for x_s, x_p in ((shuffled.x_train, plain.x_train), (shuffled.x_test, plain.x_test)):
        match = (x_s[:, :, None] == x_p[:, None, :]).all(axis=0)  # [shuffled position, plain position]
        assert (match.sum(axis=1) == 1).all()
        np.testing.assert_array_equal(match.argmax(axis=1), perm)
    # the stated seed: numpy's default_rng(SHUFFLE_SEED)
    assert mnist1d_module.SHUFFLE_SEED == 0
    np.testing.assert_array_equal(perm, np.random.default_rng(0).permutation(40))
    np.testing.assert_array_equal(load_dataset("mnist1d_shuffled").x_test, shuffled.x_test)


def test_generator_arguments_are_passed_and_the_cache_is_keyed_by_them(cache, monkeypatch):
    small = load_mnist1d(num_samples=200, final_seq_length=24, iid_noise_scale=0.05)
    assert small.x_train.shape == (160, 24) and small.x_test.shape == (40, 24)
    other = load_mnist1d(num_samples=200, final_seq_length=24, iid_noise_scale=0.1)
    assert not np.array_equal(small.x_train, other.x_train)  # another noise, another data set (another file)
    files = sorted(p.name for p in cache.glob("mnist1d_*.npz"))
    assert len(files) == 2 and "mnist1d_default.npz" not in files
    assert mnist1d_module.cache_path(num_samples=200, final_seq_length=24, iid_noise_scale=0.05) != \
        mnist1d_module.cache_path(num_samples=200, final_seq_length=24, iid_noise_scale=0.1)
    # the default arguments, given explicitly, are the default file
    assert mnist1d_module.cache_path(seed=42).name == "mnist1d_default.npz"

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated although cached")

    monkeypatch.setattr("mnist1d.data.make_dataset", no_generation)
    again = load_mnist1d(num_samples=200, final_seq_length=24, iid_noise_scale=0.05)
    for a, b in zip(small, again):
        np.testing.assert_array_equal(a, b)
    shuffled = load_mnist1d(num_samples=200, final_seq_length=24, iid_noise_scale=0.05, shuffle_length=True)
    np.testing.assert_array_equal(shuffled.x_test, small.x_test[:, mnist1d_module.length_permutation(24)])


def test_unknown_or_bad_arguments_name_the_setting(cache):
    with pytest.raises(ValueError, match="unknown argument 'lenght'"):
        load_mnist1d(lenght=40)
    with pytest.raises(ValueError, match="unknown argument 'url'"):
        load_mnist1d(url="https://example.com")
    with pytest.raises(ValueError, match="num_samples"):
        load_mnist1d(num_samples=0)
    with pytest.raises(ValueError, match="shuffle_length"):
        load_mnist1d(shuffle_length="yes")
