"""A user's own arrays (``resjax.data.from_arrays``): checked when built, normalised, batched as the TFDS
sources are, and trained on by both feeders."""

import jax
import numpy as np
import pytest

from resjax.data import ArrayData, Dataset, from_arrays
from resjax.data.source import BatchSource
from resjax.data.tfds import ImageSource, random_crop_flip
from resjax.train import image_train_config, make_image_train, make_train, run_config, train_config


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


def digits(n=48, shape=(12, 12, 1), classes=4, seed=0, dtype=np.float64):
    """Float images of a shape no built-in data set has, 0..16 like sklearn's digits, learnable by class mean."""
    rng = np.random.default_rng(seed)
    protos = np.random.default_rng(7).uniform(0, 16, (classes, *shape))
    y = np.arange(n) % classes
    x = np.clip(protos[y] + rng.normal(0, 2, (n, *shape)), 0, 16)
    return x.astype(dtype), y


X, Y = digits()
XT, YT = digits(16, seed=1)
VECTOR_CONFIG = run_config(dict(kind="residual_mlp", width=8, num_blocks=2, norm="batch"),
                           train_config(batch_size=16, epochs=2, learning_rate=0.05))


@pytest.fixture(scope="module")
def vector_sweep():
    """``(data, trainer, run, metrics)``: the images flattened to vectors (``from_arrays``) and a sweep of seeds 0, 1
    and 2 on them, on one device (the three runs in one program; on several devices they would be padded to
    four), shared by the two tests of the on-device feeder."""
    data = from_arrays(X.reshape(48, -1), Y, XT.reshape(16, -1), YT)
    trainer = make_train(VECTOR_CONFIG, data)
    return (data, trainer, *trainer.sweep([0, 1, 2], devices=jax.devices()[:1]))


def _with(**changes):
    arrays = dict(x_train=X, y_train=Y, x_test=XT, y_test=YT)
    arrays.update(changes)
    return arrays


def _nan_at(x, i):
    x = x.copy()
    x[i].flat[5] = np.nan
    return x


BAD = [
    ("nan", _with(x_train=_nan_at(X, 3)), r"x_train: example 3 has a non-finite value \(nan\)"),
    ("inf in test", _with(x_test=np.where(np.arange(16)[:, None, None, None] == 9, np.inf, XT)),
     r"x_test: example 9 has a non-finite value \(inf\)"),
    ("label too large", _with(y_test=np.where(np.arange(16) == 5, 7, YT), num_classes=4),
     r"y_test: example 5 has label 7, outside 0 \.\. 3"),
    ("negative label", _with(y_train=np.where(np.arange(48) == 2, -1, Y)), r"y_train: example 2 has label -1"),
    ("bool labels", _with(y_train=Y > 1), r"y_train: want integer class labels, got dtype bool"),
    ("2-d labels", _with(y_train=Y[:, None]), r"y_train: want \[N\] labels, got shape \(48, 1\)"),
    ("lengths", _with(y_train=Y[:47]), r"y_train: 47 labels for the 48 examples of x_train"),
    ("test lengths", _with(y_test=YT[:3]), r"y_test: 3 labels for the 16 examples of x_test"),
    ("empty", _with(x_train=X[:0], y_train=Y[:0]), r"x_train: empty"),
    ("rank 3", _with(x_train=X[..., 0]), r"x_train: want \[N, D\] feature vectors or \[N, H, W, C\] images, got shape "
                                          r"\(48, 12, 12\) \(rank 3\); add a channel axis"),
    ("rank 1", _with(x_train=Y.astype(np.float32)), r"x_train: want \[N, D\] .* \(rank 1\)"),
    ("object dtype", _with(x_train=X.astype(object)), r"x_train: want uint8 or floating inputs, got dtype object"),
    ("shapes differ", _with(x_test=XT[:, :10]),
     r"x_test: examples of shape \(10, 12, 1\), but x_train's are \(12, 12, 1\)"),
    ("kinds differ", _with(x_test=XT.astype(np.uint8)), r"x_test: dtype uint8 but x_train is float64"),
    ("half a split", _with(y_test=None), r"x_test, y_test: give both or neither"),
]


@pytest.mark.parametrize("case,arrays,match", BAD, ids=[b[0] for b in BAD])
def test_bad_arrays_are_refused_when_the_data_object_is_built(case, arrays, match):
    with pytest.raises(ValueError, match=match):
        from_arrays(**arrays)


@pytest.mark.parametrize("kw,match", [
    (dict(num_classes=3), r"y_train: example 3 has label 3, outside 0 \.\. 2 \(num_classes=3\)"),
    (dict(num_classes=0), r"num_classes: want a positive integer"),
    (dict(augment="rotate"), r"augment: unknown augmentation 'rotate'"),
    (dict(padding=-1), r"padding: want a non-negative integer"),
    (dict(std=0.0), r"std: must be finite and > 0"),
    (dict(mean=[0.0, 1.0]), r"mean: want a number or 1 values"),
    (dict(std=1e-45), r"x_train: example 0 is not finite after normalisation"),
])
def test_bad_settings_are_refused_when_the_data_object_is_built(kw, match):
    with pytest.raises(ValueError, match=match):
        from_arrays(X, Y, XT, YT, **kw)
    with pytest.raises(ValueError, match=r"augment: 'flip' needs images"):
        from_arrays(X.reshape(48, -1), Y, augment="flip")


def test_normalisation_uses_the_training_split_per_channel_or_feature():
    images = np.random.default_rng(0).uniform(0, 255, (20, 5, 5, 3)).round().astype(np.uint8)
    data = from_arrays(images, np.arange(20) % 2, images[:4], np.zeros(4, int))
    pixels = images.reshape(-1, 3) / 255.0
    np.testing.assert_allclose(data.mean, pixels.mean(0))
    np.testing.assert_allclose(data.std, pixels.std(0))
    np.testing.assert_allclose(data.x_train.reshape(-1, 3).mean(0), 0, atol=1e-6)
    np.testing.assert_allclose(data.x_train.reshape(-1, 3).std(0), 1, atol=1e-5)
    np.testing.assert_array_equal(data.x_test, data.x_train[:4])  # the test split gets the training statistics
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int32 and data.num_classes == 2

    vectors = np.random.default_rng(1).normal(3.0, 2.0, (30, 4))
    vectors[:, 2] = 5.0  # constant over the training split: std 1, as StandardScaler does
    data = from_arrays(vectors, np.arange(30) % 3)
    np.testing.assert_allclose(data.std[2], 1.0)
    np.testing.assert_allclose(data.x_train[:, 2], 0.0)
    np.testing.assert_allclose(data.x_train[:, [0, 1, 3]].std(0), 1, atol=1e-5)
    np.testing.assert_array_equal(data.x_test, data.x_train)  # no test split: evaluated on the training split

    kept = from_arrays(vectors, np.arange(30) % 3, mean=0.0, std=1.0, num_classes=5)
    np.testing.assert_array_equal(kept.x_train, vectors.astype(np.float32))
    assert kept.num_classes == 5


def test_sources_batch_like_the_tfds_sources():
    """The same order and block reads as ``ImageSource`` (one ``BatchSource``), and crop_flip's draws are
    the TFDS recipe's on the normalised arrays."""
    data = from_arrays(X, Y, XT, YT, augment="crop_flip", padding=2)
    train = data.source("train")
    assert isinstance(train, BatchSource) and len(train) == 48 and train.image_shape == (12, 12, 1)
    as_images = ImageSource.from_arrays("mnist", np.zeros((48, 28, 28, 1), np.uint8), Y)
    np.testing.assert_array_equal(train.order(3, seed=5), as_images.order(3, seed=5))
    batches = list(train.epoch(3, 16, seed=5, augment=True))
    order = train.order(3, seed=5)
    for b, (images, labels) in enumerate(batches):
        idx = order[b * 16:(b + 1) * 16]
        want = random_crop_flip(data.x_train[idx], np.random.default_rng([5, 3, 1, b]), 2)
        np.testing.assert_array_equal(images, want)
        np.testing.assert_array_equal(labels, data.y_train[idx])
    blocks = [list(train.epoch(3, 16, seed=5, augment=True, part=(p, 2))) for p in (0, 1)]
    for b, (images, _) in enumerate(batches):
        np.testing.assert_array_equal(np.concatenate([blocks[0][b][0], blocks[1][b][0]]), images)
    flipped = from_arrays(X, Y, augment="flip").source()
    (first, _), = list(flipped.epoch(0, 48, shuffle=False, augment=True))
    flips = np.random.default_rng([0, 0, 1, 0]).random(48) < 0.5
    np.testing.assert_array_equal(first[flips], flipped.read(np.flatnonzero(flips))[0][:, :, ::-1])
    np.testing.assert_array_equal(first[~flips], flipped.read(np.flatnonzero(~flips))[0])
    with pytest.raises(ValueError, match="split"):
        data.source("validation")


def test_a_resnet_trains_on_in_memory_images_through_the_host_feeder():
    data = from_arrays(X, Y, XT, YT, augment="flip")
    config = run_config(dict(kind="resnet", stage_sizes=(1,), stage_widths=(8,), stem_width=8),
                        image_train_config(batch_size=16, eval_batch_size=8, epochs=3, learning_rate=0.05,
                                           schedule="constant", augment=True))
    trainer = make_image_train(config, data)
    assert trainer.test_source.split == "test" and trainer.example_shape == (12, 12, 1)
    run, history = trainer.fit([0, 1])
    assert history["train_loss"].shape == (2, 3) and np.isfinite(history["test_loss"]).all()
    assert (history["train_loss"][:, -1] < history["train_loss"][:, 0]).all()
    assert run.state.params["head"]["kernel"].shape[-1] == 4  # num_classes inferred from the labels


def test_the_on_device_feeder_takes_the_same_object_as_its_arrays(vector_sweep):
    """``make_train(config, from_arrays(...))`` is ``make_train`` on a ``Dataset`` of the normalised arrays."""
    data, _, _, from_object = vector_sweep
    config = VECTOR_CONFIG
    _, from_dataset = make_train(config, Dataset(data.x_train, data.y_train, data.x_test, data.y_test)).sweep(
        [0, 1, 2], devices=jax.devices()[:1])
    for name in ("train_loss", "test_loss", "test_error"):
        np.testing.assert_array_equal(from_object[name], from_dataset[name])
    assert np.isfinite(from_object["train_loss"]).all()
    with pytest.raises(ValueError, match="augment: 'flip' is for the host feeder"):
        make_train(config, from_arrays(X, Y, augment="flip"))
    assert isinstance(data, ArrayData) and data.example_shape == (144,)


def test_one_run_out_of_many_is_that_run_trained_alone(vector_sweep):
    """``run.select(i)`` of a multi-seed state is seed ``i``'s whole state: evaluating it gives seed ``i``'s
    metrics, and it has no seed axis."""
    data, trainer, run, metrics = vector_sweep  # seeds 0, 1 and 2
    assert run.num_runs == 3
    one = run.select(2)
    kernel = run.state.params["head"]["kernel"]
    assert one.num_runs is None and one.state.params["head"]["kernel"].shape == kernel.shape[1:]
    ev = jax.jit(trainer.evaluate)(one, data.x_test, data.y_test)  # one program, not one per eager op
    loss, error = ev["loss"], ev["error"]
    np.testing.assert_allclose(loss, metrics["test_loss"][2, -1], rtol=1e-6)
    np.testing.assert_allclose(error, metrics["test_error"][2, -1], rtol=1e-6)
    for bad in (3, -4, 1.0, True):
        with pytest.raises(ValueError, match=r"select: want a run index in \[0, 3\)"):
            run.select(bad)
    with pytest.raises(ValueError, match="no seed axis"):
        one.select(0)
