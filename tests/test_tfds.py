"""TFDS image loaders (resjax.data.tfds), with no TensorFlow and no downloaded data.

Two ways to have "prepared" data here:

* ``tfds.testing.mock_data(policy=USE_FILES, data_dir=tests/data/tfds)``: the committed metadata
  (``<name>/<version>/dataset_info.json`` and ``features.json``, a few kilobytes, regenerated without
  TensorFlow by ``tests/data/tfds/make_metadata.py`` from tfds's builder classes with the real split sizes)
  gives ``tfds.data_source`` the real splits, while the examples are random ones drawn per index by the
  mock. The loader takes ``num_examples`` from the split info (the mock's ``len`` is its ``num_examples``
  argument for every split, so it is not used). Workaround for tfds 4.9.10: ``mock_data`` sets
  ``__getitems__`` on its MagicMock data source to ``functools.partial(_getitems, generator=...)``;
  ``__getitems__`` is not a dunder MagicMock binds, so ``self`` is never passed and every batched read
  fails with ``TypeError: _getitems() missing ... 'record_keys'``. ``tests/tfds_mock.py`` replaces
  ``mocking._getitems`` (looked up when ``data_source`` is called) with a version without ``self``.
* Real array_record files written in ``tmp_path`` (tfds serialises examples and array_record writes them
  without TensorFlow), which exercises the unmocked path including PNG/JPEG decoding.
"""

import io
import itertools
import json
import shutil

import numpy as np
import pytest

import resjax.data
from resjax.data import tfds as T
from resjax.data import (IMAGE_DATASETS, DataNotPreparedError, ImageSource, load_image_dataset,
                         synthetic_image_dataset)

from tests.tfds_mock import META, mocked_tfds

REAL_SIZES = {"mnist": {"train": 60_000, "test": 10_000}, "cifar10": {"train": 50_000, "test": 10_000},
              "cifar100": {"train": 50_000, "test": 10_000},
              "imagenet2012": {"train": 1_281_167, "validation": 50_000}}


@pytest.fixture
def mocked():
    """Inside: tfds.data_source serves random examples for the committed metadata's real splits
    (``tests.tfds_mock.mocked_tfds``, with the workaround described above)."""
    with mocked_tfds() as meta:
        yield lambda name, split: load_image_dataset(name, split, data_dir=meta)


def denormalise(x, spec):
    """Back to uint8 pixels: exact for images that went through normalise()."""
    return np.rint((x * np.float32(spec.std) + np.float32(spec.mean)) * 255).astype(np.uint8)


# ------------------------------------------------------------------------------------------ mocked TFDS


@pytest.mark.parametrize("name", list(IMAGE_DATASETS))
def test_real_split_sizes_and_batch_shapes(mocked, name):
    spec = IMAGE_DATASETS[name]
    assert spec.splits == tuple(REAL_SIZES[name])
    for split, size in REAL_SIZES[name].items():
        src = mocked(name, split)
        assert isinstance(src, ImageSource)
        assert (src.name, src.split, src.num_examples, len(src)) == (name, split, size, size)
        assert src.num_classes == spec.num_classes and src.image_shape == spec.image_shape
        assert src.num_batches(128) == size // 128 and src.num_batches(128, drop_remainder=False) == -(-size // 128)
        for augment in (False, True):
            x, y = next(src.epoch(0, 4, augment=augment))
            assert x.shape == (4, *spec.image_shape) and x.dtype == np.float32
            assert y.shape == (4,) and y.dtype == np.int32 and ((0 <= y) & (y < spec.num_classes)).all()


def test_epoch_visits_every_example_once(mocked):
    src = mocked("cifar10", "test")
    spec = src.spec
    images, labels = src.read(np.arange(src.num_examples))
    index_of = {im.tobytes(): i for i, im in enumerate(images)}
    assert len(index_of) == src.num_examples  # mock images are distinct, so they identify their index
    seen, sizes = [], []
    for x, y in src.epoch(3, 999, seed=5, drop_remainder=False):
        idx = [index_of[im.tobytes()] for im in denormalise(x, spec)]
        np.testing.assert_array_equal(y, labels[idx])
        seen += idx
        sizes.append(len(y))
    assert sizes == [999] * 10 + [10]
    assert sorted(seen) == list(range(src.num_examples)) and seen != sorted(seen)
    np.testing.assert_array_equal(seen, src.order(3, seed=5))
    in_order = np.concatenate([y for _, y in src.epoch(0, 4096, shuffle=False, drop_remainder=False)])
    np.testing.assert_array_equal(in_order, labels)
    assert sum(len(y) for _, y in src.epoch(0, 999)) == 9990  # drop_remainder drops the short batch


def test_epochs_are_pure_functions_of_seed_and_epoch(mocked):
    first = lambda src, **kw: list(itertools.islice(src.epoch(kw.pop("epoch", 1), 32, augment=True, **kw), 3))
    a, b = first(mocked("cifar10", "train"), seed=2), first(mocked("cifar10", "train"), seed=2)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    for other in (first(mocked("cifar10", "train"), seed=2, epoch=2), first(mocked("cifar10", "train"), seed=3)):
        assert not np.array_equal(np.concatenate([y for _, y in a]), np.concatenate([y for _, y in other]))
    src = mocked("cifar10", "train")
    assert not np.array_equal(src.order(1, seed=2), src.order(2, seed=2))
    # exact resume: starting at batch 2 yields what the full epoch yields from batch 2 on
    (x2, y2), = itertools.islice(src.epoch(1, 32, seed=2, augment=True, start_batch=2), 1)
    np.testing.assert_array_equal(x2, a[2][0])
    np.testing.assert_array_equal(y2, a[2][1])


def test_stacked_epoch_rows_are_the_per_seed_epochs(mocked):
    seeds = [0, 3, 7]
    for src in (mocked("cifar10", "train"), synthetic_image_dataset("cifar10", 100)):
        kw = dict(augment=True, drop_remainder=False)
        stacked = list(itertools.islice(src.stacked_epoch(4, 16, seeds, **kw), 7))
        assert stacked[0][0].shape == (3, 16, 32, 32, 3) and stacked[0][1].shape == (3, 16)
        for s, seed in enumerate(seeds):
            single = list(itertools.islice(src.epoch(4, 16, seed=seed, **kw), 7))
            assert len(single) == len(stacked)
            for (xs, ys), (x, y) in zip(stacked, single):
                np.testing.assert_array_equal(xs[s], x)
                np.testing.assert_array_equal(ys[s], y)
    assert stacked[-1][1].shape == (3, 100 - 6 * 16)  # the synthetic epoch's short final batch
    with pytest.raises(ValueError, match="seeds"):
        src.stacked_epoch(0, 16, [])


def test_imagenet_crops_variable_sized_images(mocked):
    src = mocked("imagenet2012", "validation")
    images, _ = src.read([0, 1, 2])
    assert len({im.shape for im in images}) > 1  # the mock's images have random sizes
    x, _ = next(src.epoch(0, 3, shuffle=False))
    expected = np.stack([T.centre_crop(im, 224) for im in images])
    np.testing.assert_array_equal(denormalise(x, src.spec), expected)


# ------------------------------------------------------------------------------------------ augmentation


def windows(image, padding=4):
    """Every crop_flip output an image can give: shifted windows of the zero-padded image and their flips."""
    h, w, _ = image.shape
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    for dy in range(2 * padding + 1):
        for dx in range(2 * padding + 1):
            win = padded[dy:dy + h, dx:dx + w]
            yield (dy, dx, False), win
            yield (dy, dx, True), win[:, ::-1]


def match(out, image):
    found = [k for k, win in windows(image) if np.array_equal(out, win)]
    assert found, "augmented image is no shifted/flipped window of the padded image"
    return found[0]


@pytest.mark.parametrize("label, problem", [
    (10, r"cifar10/train: record 3 has label 10, outside 0 \.\. 9 \(10 classes\)"),
    (-1, r"cifar10/train: record 3 has label -1, outside 0 \.\. 9"),
    (0.5, r"cifar10/train: labels of dtype float64 read"),
], ids=["label 10", "label -1", "float label"])
def test_labels_read_from_tfds_are_checked_naming_the_split_and_record(label, problem):
    """Labels enter through the TFDS reader (#22 item 7): a record whose label is outside the data set's classes
    or not an integer is refused when it is read, naming the data set, the split and the record; before, label
    10 of CIFAR-10 went on into a 10-class model and 0.5 was truncated to 0. The mocked ``data_source`` serves
    record 3 with the bad label."""
    from tensorflow_datasets.testing import mocking

    with mocked_tfds() as meta, pytest.MonkeyPatch.context() as mp:
        served = mocking._getitems

        def getitems(record_keys, generator, serialized=False):
            records = served(record_keys, generator, serialized)
            return [{**r, "label": label} if k == 3 else r for k, r in zip(record_keys, records)]

        mp.setattr(mocking, "_getitems", getitems)
        src = load_image_dataset("cifar10", "train", data_dir=meta)
        images, labels = src.read([0, 1, 2])  # good records read as before
        assert labels.dtype == np.int32 and ((0 <= labels) & (labels < 10)).all()
        with pytest.raises(ValueError, match=problem):
            src.read([0, 3, 5])
        with pytest.raises(ValueError, match=problem):
            for _ in src.epoch(0, 8, shuffle=False):  # the batch holding record 3
                pass
    with pytest.raises(ValueError, match=r"mnist/test: record 1 has label 10, outside 0 \.\. 9"):
        ImageSource.from_arrays("mnist", np.zeros((2, 28, 28, 1), np.uint8), np.array([0, 10]), split="test")


def test_crop_flip_gives_windows_of_the_padded_image():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (64, 32, 32, 3), dtype=np.uint8)  # no zero pixel: padding is visible
    out = T.random_crop_flip(images, np.random.default_rng(1))
    assert out.shape == images.shape and out.dtype == np.uint8
    keys = [match(o, im) for o, im in zip(out, images)]
    flips = [k[2] for k in keys]
    assert 15 < sum(flips) < 49 and len({k[:2] for k in keys}) > 30


def test_crop_flip_through_the_pipeline_and_no_augmentation_is_identity():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (40, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(40) % 10
    src = ImageSource.from_arrays("cifar10", images, labels)
    xs = np.concatenate([x for x, _ in src.epoch(0, 8, seed=1, shuffle=False, augment=True)])
    for o, im in zip(denormalise(xs, src.spec), images):
        match(o, im)
    assert not np.array_equal(denormalise(xs, src.spec), images)
    plain = np.concatenate([x for x, _ in src.epoch(0, 8, shuffle=False)])
    np.testing.assert_array_equal(denormalise(plain, src.spec), images)
    mnist = ImageSource.from_arrays("mnist", images[:8, :28, :28, :1], labels[:8])
    x, _ = next(mnist.epoch(0, 8, shuffle=False, augment=True))  # MNIST: augment is a no-op
    np.testing.assert_array_equal(denormalise(x, mnist.spec), images[:8, :28, :28, :1])


def test_imagenet_transforms():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (256, 320, 3), dtype=np.uint8)
    np.testing.assert_array_equal(T.centre_crop(image), image[16:240, 48:272])  # shorter side already 256
    big = rng.integers(0, 256, (300, 500, 3), dtype=np.uint8)
    assert T.centre_crop(big).shape == (224, 224, 3)
    square = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    whole = T.random_resized_crop(square, np.random.default_rng(0), 224, scale=(1, 1), ratio=(1, 1))
    np.testing.assert_array_equal(whole, square)
    strip = rng.integers(0, 256, (10, 1000, 3), dtype=np.uint8)  # no box fits: centre crop, ratio 4/3
    fallback = T.random_resized_crop(strip, np.random.default_rng(0), 224)
    np.testing.assert_array_equal(fallback, T._resize(strip[:, 493:506], (224, 224)))
    crops = [T.random_resized_crop(big, np.random.default_rng(i), 224) for i in range(5)]
    assert all(c.shape == (224, 224, 3) and c.dtype == np.uint8 for c in crops)
    assert len({c.tobytes() for c in crops}) == 5


# ------------------------------------------------------------------------------------------ normalisation


def test_documented_statistics():
    assert IMAGE_DATASETS["cifar10"].mean == (0.4914, 0.4822, 0.4465)
    assert IMAGE_DATASETS["cifar10"].std == (0.2470, 0.2435, 0.2616)
    assert IMAGE_DATASETS["mnist"].mean == (0.1307,) and IMAGE_DATASETS["mnist"].std == (0.3081,)
    assert IMAGE_DATASETS["imagenet2012"].mean == (0.485, 0.456, 0.406)
    assert IMAGE_DATASETS["imagenet2012"].std == (0.229, 0.224, 0.225)
    assert IMAGE_DATASETS["imagenet2012"].test_split == "validation"


@pytest.mark.parametrize("name", list(IMAGE_DATASETS))
def test_normalisation_of_constant_images(name):
    spec = IMAGE_DATASETS[name]
    shape = (64, 64, 3) if name == "imagenet2012" else spec.image_shape
    values = np.array([0, 37, 128, 255], np.uint8)
    images = np.broadcast_to(values[:, None, None, None], (4, *shape)).copy()
    src = ImageSource.from_arrays(name, images, np.zeros(4, int))
    for augment in (False, True):
        x, _ = next(src.epoch(0, 4, shuffle=False, augment=augment))
        expected = (values[:, None] / 255 - np.array(spec.mean)) / np.array(spec.std)  # [4, C]
        centre = x[:, spec.image_shape[0] // 2, spec.image_shape[1] // 2]  # padding can't reach the centre
        np.testing.assert_allclose(centre, expected, rtol=1e-6, atol=1e-6)
    # pixels at the documented mean map to 0 and one std above to 1
    mean_px = np.array(spec.mean, np.float32) * 255
    np.testing.assert_allclose(T.normalise(mean_px, spec.mean, spec.std), 0, atol=1e-6)
    np.testing.assert_allclose(T.normalise(mean_px + np.float32(spec.std) * 255, spec.mean, spec.std), 1, atol=1e-6)


# ------------------------------------------------------------------------------------------ errors


def test_missing_data_raises_one_clear_error(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    def never(*a, **k):
        raise AssertionError("reached tfds.data_source although the data are missing")

    monkeypatch.setattr(tfds, "data_source", never)
    with pytest.raises(DataNotPreparedError) as err:
        load_image_dataset("cifar10", "train", data_dir=tmp_path)
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert str(tmp_path) in msg and "cifar10" in msg and "TFDS_DATA_DIR" in msg
    assert f"tfds build cifar10 --data_dir {tmp_path} --file_format=array_record" in msg
    assert "pip install tensorflow-cpu" in msg
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataNotPreparedError, match="downloads/manual") as err:
        load_image_dataset("imagenet2012", "validation")
    assert str(tmp_path / "env") in str(err.value) and "ILSVRC2012_img_train.tar" in str(err.value)
    # prepared as tfrecord only, or without the split: still the same error, saying so
    prepared = tmp_path / "tf" / "cifar10" / "3.0.2"
    prepared.mkdir(parents=True)
    info = json.loads((META / "cifar10" / "3.0.2" / "dataset_info.json").read_text())
    (prepared / "dataset_info.json").write_text(json.dumps({**info, "fileFormat": "tfrecord"}))
    with pytest.raises(DataNotPreparedError, match="not array_record"):
        load_image_dataset("cifar10", data_dir=tmp_path / "tf")
    info["splits"] = info["splits"][:1]
    (prepared / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataNotPreparedError, match="no split 'test'"):
        load_image_dataset("cifar10", "test", data_dir=tmp_path / "tf")


def test_unknown_settings_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="dataset.*cifar11.*cifar10"):
        load_image_dataset("cifar11")
    with pytest.raises(ValueError, match="dataset"):
        synthetic_image_dataset("svhn")
    with pytest.raises(ValueError, match="split.*validation"):
        load_image_dataset("cifar10", "validation")
    with pytest.raises(ValueError, match="split"):
        load_image_dataset("imagenet2012", "test")
    src = synthetic_image_dataset("mnist", 20)
    with pytest.raises(ValueError, match="batch_size"):
        src.epoch(0, 0)
    with pytest.raises(ValueError, match="batch_size"):
        src.epoch(0, 21)
    with pytest.raises(ValueError, match="seed"):
        src.epoch(0, 4, seed=-1)


# ------------------------------------------------------------------------------------------ synthetic


def test_synthetic_is_learnable_and_deterministic():
    train = synthetic_image_dataset("cifar10", 512, seed=0)
    test = synthetic_image_dataset("cifar10", 256, seed=0, split="test")
    assert (train.num_examples, test.num_examples, train.image_shape, train.num_classes) == (512, 256, (32, 32, 3), 10)
    x, y = next(train.epoch(0, 512, augment=True))
    np.testing.assert_array_equal(np.bincount(y), np.full(10, 51.2).astype(int) + (np.arange(10) < 2))
    means = np.stack([x[y == c].mean(0) for c in range(10)]).reshape(10, -1)
    xt, yt = next(test.epoch(0, 256, shuffle=False))
    dist = ((xt.reshape(256, 1, -1) - means[None]) ** 2).sum(-1)
    accuracy = (dist.argmin(1) == yt).mean()
    assert accuracy > 0.9, accuracy  # chance is 0.1; means of augmented images
    again = synthetic_image_dataset("cifar10", 512, seed=0)
    np.testing.assert_array_equal(next(again.epoch(0, 512, augment=True))[0], x)
    other = synthetic_image_dataset("cifar10", 512, seed=1)
    assert not np.array_equal(other.read(np.arange(512))[0], train.read(np.arange(512))[0])
    assert not np.array_equal(test.read(np.arange(256))[0], train.read(np.arange(256))[0])
    for name, spec in IMAGE_DATASETS.items():
        xb, yb = next(synthetic_image_dataset(name, 8, split=spec.test_split).epoch(0, 4, augment=True))
        assert xb.shape == (4, *spec.image_shape) and yb.dtype == np.int32


def test_exports():
    for attr in ("load_image_dataset", "synthetic_image_dataset", "ImageSource", "DataNotPreparedError",
                 "IMAGE_DATASETS", "load_dataset", "load_mnist1d"):
        assert attr in resjax.data.__all__ and hasattr(resjax.data, attr)


# ------------------------------------------------------------------------------------------ real files


def write_prepared(root, name, examples_per_split, encode):
    """A tiny prepared data set: committed metadata with our split sizes, array_record shards of real
    tfds-serialised examples."""
    import tensorflow_datasets as tfds
    from array_record.python.array_record_module import ArrayRecordWriter

    (meta,) = (META / name).iterdir()
    out = root / name / meta.name
    shutil.copytree(meta, out)
    info = json.loads((out / "dataset_info.json").read_text())
    info["splits"] = [{**s, "shardLengths": [str(len(examples_per_split[s["name"]][1]))]}
                      for s in info["splits"] if s["name"] in examples_per_split]
    (out / "dataset_info.json").write_text(json.dumps(info))
    features = tfds.features.FeaturesDict.from_config(str(out))
    for split, (images, labels) in examples_per_split.items():
        writer = ArrayRecordWriter(str(out / f"{name}-{split}.array_record-00000-of-00001"), "group_size:1")
        for i, (image, label) in enumerate(zip(images, labels)):
            extra = {"id": f"{split}_{i}"} if name.startswith("cifar") else {"file_name": f"{i}.JPEG"}
            writer.write(features.serialize_example({"image": encode(image), "label": int(label), **extra}))
        writer.close()


def test_unmocked_read_of_real_array_record_files(tmp_path):
    from PIL import Image

    def encode(image, fmt):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format=fmt)
        return buf.getvalue()

    rng = np.random.default_rng(0)
    cifar = {s: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n))
             for s, n in (("train", 13), ("test", 5))}
    write_prepared(tmp_path, "cifar10", cifar, lambda im: encode(im, "png"))
    src = load_image_dataset("cifar10", "train", data_dir=tmp_path)
    assert src.num_examples == 13
    images, labels = src.read(np.arange(13))
    np.testing.assert_array_equal(np.stack(images), cifar["train"][0])  # PNG is lossless
    np.testing.assert_array_equal(labels, cifar["train"][1])
    xs, ys = zip(*src.epoch(0, 4, seed=1, drop_remainder=False))
    np.testing.assert_array_equal(np.concatenate(ys), cifar["train"][1][src.order(0, seed=1)])
    np.testing.assert_array_equal(denormalise(np.concatenate(xs), src.spec), cifar["train"][0][src.order(0, seed=1)])

    sizes = [(300, 200), (180, 260), (256, 256)]
    imnet = {"validation": ([rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for hw in sizes], np.array([1, 500, 999]))}
    write_prepared(tmp_path, "imagenet2012", imnet, lambda im: encode(im, "jpeg"))
    val = load_image_dataset("imagenet2012", "validation", data_dir=tmp_path)
    images, labels = val.read([0, 1, 2])
    assert [im.shape[:2] for im in images] == sizes and list(labels) == [1, 500, 999]
    x, y = next(val.epoch(0, 3, shuffle=False))
    assert x.shape == (3, 224, 224, 3) and list(y) == [1, 500, 999]
