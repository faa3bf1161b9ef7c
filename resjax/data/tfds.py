"""Image classification data sets (MNIST, CIFAR-10/100, ImageNet) read through ``tfds.data_source``.

The data are TFDS data sets prepared on disk in the ``array_record`` format; ``tfds.data_source`` gives
random access to their records with no TensorFlow at run time, and everything here is numpy on the host.
Choices:

* **Data directory**: the ``data_dir`` argument, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``
  (TFDS's own rule). Nothing is ever downloaded or prepared implicitly: a missing data set raises
  :class:`DataNotPreparedError` at once, whose message is the command that prepares it.
* **Preparing** needs TensorFlow: the ``tfds`` command line (4.9.10) imports it, and the MNIST/CIFAR/ImageNet
  builders read their sources through ``tf.io.gfile`` and encode PNG/JPEG with ``tf.image``. So prepare
  once, in any environment with ``pip install tensorflow-cpu``, e.g.
  ``tfds build cifar10 --data_dir DIR --file_format=array_record``; this package then reads the result
  without TensorFlow. ImageNet also needs ``ILSVRC2012_img_train.tar`` and ``ILSVRC2012_img_val.tar``
  (registration at image-net.org) in ``DIR/downloads/manual`` first.
* **Determinism**: an epoch is a pure function of ``(seed, epoch)``. The order is
  ``np.random.default_rng([seed, epoch, 0]).permutation(num_examples)`` and the augmentation of batch ``b``
  draws from ``np.random.default_rng([seed, epoch, 1, b])``; no loader state exists beyond the position, so
  training resumes exactly from ``(epoch, batch)`` (``start_batch`` skips the first batches without reading
  them; the epoch's iterator is Grain's, whose ``get_state``/``set_state`` hold that position).
* **Normalisation** after augmentation: ``(x / 255 - mean) / std`` per channel, float32, with the statistics in
  :data:`IMAGE_DATASETS`. CIFAR uses the true per-channel mean and standard deviation of its training pixels:
  CIFAR-10 (0.4914, 0.4822, 0.4465) / (0.2470, 0.2435, 0.2616), CIFAR-100 (0.5071, 0.4865, 0.4409) /
  (0.2673, 0.2564, 0.2762). The std (0.2023, 0.1994, 0.2010) of the Fixup and tau-ResNet repositories (and
  many others copying one early script) is not the pixel std; using it scales inputs about 1.2x larger.
  MNIST (0.1307,) / (0.3081,); ImageNet (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225).
* **Augmentation** (``augment=True``, for training): CIFAR, the standard ResNet recipe: a random 32x32 window
  of the image zero-padded (black) by 4 pixels on each side, flipped left-right with probability 1/2
  (vectorised over the batch). ImageNet: Inception-style random resized crop (area fraction uniform in
  (0.08, 1), log aspect ratio uniform in (log 3/4, log 4/3), 10 tries then a centre crop of clamped ratio)
  resized bilinearly to 224x224, then the flip. MNIST: none (``augment`` is accepted and ignored).
  ImageNet without augmentation (evaluation) always resizes the shorter side to 256 (bilinear) and takes
  the centre 224x224, so its batches have one shape; the other data sets are used as stored.
* **Splits**: ``train`` and ``test``, except ImageNet's ``train`` and ``validation`` (its ``test`` split
  has no labels). ``num_examples`` is the split size recorded in the prepared ``dataset_info.json``.
* **Throughput**: records are read with one batched ``__getitems__`` call per batch; decoding (PIL) and the
  ImageNet crops run where the epoch's Grain pipeline makes the batch (``resjax.data.source``): by default in
  the calling thread, which serves MNIST/CIFAR (a CIFAR epoch decodes in seconds) and ImageNet evaluation;
  ``source.loader(threads=N, workers=M)`` makes the batches in Grain reader threads or worker processes (the
  same batches), which full ImageNet training wants on a machine with cores to spare.

:func:`synthetic_image_dataset` gives the same interface on learnable random data for runs without data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
from typing import Callable, Sequence

import numpy as np

from resjax.data.source import BatchSource, _check_batch_size, _check_nonneg
from resjax.paths import as_path, is_url

__all__ = [
    "CIFAR_PADDING",
    "IMAGENET_RATIO",
    "IMAGENET_RESIZE",
    "IMAGENET_SCALE",
    "IMAGE_DATASETS",
    "DataNotPreparedError",
    "ImageSource",
    "ImageSpec",
    "Reader",
    "centre_crop",
    "check_read_labels",
    "load_image_dataset",
    "normalise",
    "prepare_command",
    "prepared_num_examples",
    "random_crop_flip",
    "random_resized_crop",
    "synthetic_image_dataset",
    "tfds_data_dir",
    "local_copy",
]


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What the loaders need to know about one image data set."""

    tfds_name: str
    image_shape: tuple[int, int, int]  # (H, W, C) of the batches' images (after the crop for ImageNet)
    num_classes: int
    train_split: str
    test_split: str  # the labelled evaluation split: 'test', or 'validation' for ImageNet
    mean: tuple[float, ...]  # per channel, of x / 255
    std: tuple[float, ...]
    augmentation: str  # 'none' | 'crop_flip' (CIFAR) | 'inception' (ImageNet)

    @property
    def splits(self) -> tuple[str, str]:
        """``(train_split, test_split)``."""
        return (self.train_split, self.test_split)


#: The image data sets that ``load_image_dataset`` reads through TFDS, by name (``'mnist'``, ``'cifar10'``,
#: ``'cifar100'``, ``'imagenet2012'``), each with its ``ImageSpec`` (TFDS name, image shape, classes, splits,
#: normalisation, augmentation).
#:
#: :meta hide-value:
IMAGE_DATASETS: dict[str, ImageSpec] = {
    "mnist": ImageSpec("mnist", (28, 28, 1), 10, "train", "test", (0.1307,), (0.3081,), "none"),
    "cifar10": ImageSpec("cifar10", (32, 32, 3), 10, "train", "test",
                         (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), "crop_flip"),
    "cifar100": ImageSpec("cifar100", (32, 32, 3), 100, "train", "test",
                          (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), "crop_flip"),
    "imagenet2012": ImageSpec("imagenet2012", (224, 224, 3), 1000, "train", "validation",
                              (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "inception"),
}

CIFAR_PADDING = 4
IMAGENET_RESIZE = 256  # evaluation: shorter side resized to this, then the centre image_shape crop
IMAGENET_SCALE = (0.08, 1.0)
IMAGENET_RATIO = (3 / 4, 4 / 3)


class DataNotPreparedError(FileNotFoundError):
    """A TFDS data set is not prepared (as array_record) in the data directory searched.

    The message names the data set, the directory searched (``data_dir`` argument, else ``$TFDS_DATA_DIR``,
    else ``~/tensorflow_datasets``) and the commands that prepare it: ``pip install tensorflow-cpu`` (the
    ``tfds`` command line and these builders need TensorFlow; reading afterwards does not), then
    ``tfds build NAME --data_dir DIR --file_format=array_record`` (ImageNet: after placing its tar files in
    ``DIR/downloads/manual``).
    """


def _spec(name: str) -> ImageSpec:
    if name not in IMAGE_DATASETS:
        raise ValueError(f"dataset: unknown image data set {name!r}; choose one of {tuple(IMAGE_DATASETS)}")
    return IMAGE_DATASETS[name]


def _check_split(name: str, split: str) -> None:
    spec = _spec(name)
    if split not in spec.splits:
        raise ValueError(f"split: {name} has no split {split!r}; choose one of {spec.splits}")


def tfds_data_dir(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory searched: ``data_dir``, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``; a bucket
    URL (``gs://``, ``s3://``: ``resjax.paths``) is an ``etils.epath`` path (see :func:`local_copy`)."""
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets")
    if is_url(data_dir):
        return as_path(data_dir, "data_dir")
    return pathlib.Path(os.path.expanduser(os.fspath(data_dir)))


def local_copy(root: str | os.PathLike, tfds_name: str, version: str, progress: bool = True) -> pathlib.Path:
    """A data set prepared in a bucket (``root``: a URL), copied once into the local cache and read there.

    ArrayRecord's reader (what ``tfds.data_source`` reads) opens local files, so the version folder
    ``root/<tfds_name>/<version>`` is copied to ``$RESJAX_CACHE/tfds/<digest of root>/`` (default
    ``~/.cache/resjax``), file by file with a progress bar, each file first to a temporary name and checked against
    the size the bucket lists (and its MD5 where the store gives one) before it is renamed into place; a file already
    there with the listed size is not copied again, so an interrupted copy goes on where it stopped. Returns the
    local data directory to read."""
    import base64
    import hashlib

    from resjax.paths import cache_dir, filesystem

    fs, inner = filesystem(os.fspath(root))
    source = f"{inner.rstrip('/')}/{tfds_name}/{version}"
    listed = {p: info for p, info in fs.find(source, detail=True).items() if info.get("type", "file") == "file"}
    local_root = cache_dir() / "tfds" / hashlib.sha256(os.fspath(root).encode()).hexdigest()[:12]
    target = local_root / tfds_name / version
    todo = []
    for path, info in sorted(listed.items()):
        local = target / path[len(source):].lstrip("/")
        if not (local.is_file() and local.stat().st_size == int(info["size"])):
            todo.append((path, local, info))
    if todo:
        from tqdm.auto import tqdm

        total = sum(int(info["size"]) for _, _, info in todo)
        with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                  desc=f"copying {os.fspath(root)}/{tfds_name}/{version} to {target}") as bar:
            for path, local, info in todo:
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = local.with_name(f".{local.name}.{os.getpid()}.part")
                fs.get_file(path, str(tmp))
                data_ok = tmp.stat().st_size == int(info["size"])
                md5 = info.get("md5Hash")  # GCS: base64 of the MD5 of the object
                if data_ok and md5:
                    data_ok = base64.b64encode(hashlib.md5(tmp.read_bytes()).digest()).decode() == md5
                if not data_ok:
                    tmp.unlink()
                    raise ValueError(f"data_dir: {os.fspath(root)}: the copy of {path} does not match its size or "
                                     "checksum in the bucket (a partial upload?); prepare the data set again")
                os.replace(tmp, local)
                bar.update(int(info["size"]))
    return local_root


def prepare_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """The shell commands that prepare data set ``name`` in the searched directory (see the module doc)."""
    spec = _spec(name)
    root = tfds_data_dir(data_dir)
    lines = ["pip install tensorflow-cpu  # the tfds command line and builder need TensorFlow; loading does not"]
    if spec.tfds_name == "imagenet2012":
        manual = root / "downloads" / "manual"
        lines.append(f"mkdir -p {shlex.quote(str(manual))}  # then put ILSVRC2012_img_train.tar and "
                     "ILSVRC2012_img_val.tar there (register at https://image-net.org/download-images)")
    lines.append(f"tfds build {spec.tfds_name} --data_dir {shlex.quote(str(root))} --file_format=array_record")
    return "\n".join(lines)


def _version_key(path: pathlib.Path) -> tuple[int, ...]:
    return tuple(int(p) for p in path.name.split("."))


def _prepared_info(name: str, split: str, data_dir) -> tuple[pathlib.Path, str, dict]:
    """(data dir, version, dataset_info.json) of the newest prepared version; DataNotPreparedError else.

    Only reads the directory listing and one small JSON file, so a missing data set fails at once.
    """
    spec = _spec(name)
    root = tfds_data_dir(data_dir)
    base = root / spec.tfds_name
    versions = sorted((p for p in base.glob("*") if re.fullmatch(r"\d+\.\d+\.\d+", p.name)
                       and (p / "dataset_info.json").is_file()), key=_version_key) if base.is_dir() else []

    def fail(problem: str) -> DataNotPreparedError:
        return DataNotPreparedError(
            f"{name}: TFDS data set {spec.tfds_name!r} {problem}. Searched data directory {root} "
            f"(the data_dir argument, else $TFDS_DATA_DIR, else ~/tensorflow_datasets). Prepare it with:\n"
            f"{prepare_command(name, root)}")

    if not versions:
        raise fail(f"is not prepared (no {base / '<version>' / 'dataset_info.json'})")
    version_dir = versions[-1]
    info = json.loads((version_dir / "dataset_info.json").read_text())
    formats = {info.get("fileFormat", "tfrecord"), *info.get("alternativeFileFormats", [])}
    if "array_record" not in formats:
        raise fail(f"is prepared in {version_dir} as {sorted(formats)}, not array_record (random access "
                   "needs array_record; rebuild it)")
    split_names = [s.get("name") for s in info.get("splits", [])]
    if split not in split_names:
        raise fail(f"in {version_dir} has no split {split!r} (it has {split_names})")
    return root, version_dir.name, info


def prepared_num_examples(name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None) -> int:
    """How many examples split ``split`` of the prepared data set ``name`` holds, from its
    ``dataset_info.json`` alone (no TFDS import); :class:`DataNotPreparedError` when it is not prepared."""
    _check_split(name, split)
    _, _, info = _prepared_info(name, split, data_dir)
    for s in info.get("splits", []):
        if s.get("name") == split:
            return int(sum(int(n) for n in s.get("shardLengths", [])) or s.get("numExamples", 0))
    raise DataNotPreparedError(f"{name}: split {split!r} is missing from dataset_info.json")


# ---------------------------------------------------------------------------------------------- transforms


def normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(images / 255 - mean) / std`` per channel (last axis), float32."""
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    return ((np.asarray(images, np.float32) / np.float32(255) - mean) / std).astype(np.float32)


def random_crop_flip(images: np.ndarray, rng: np.random.Generator, padding: int = CIFAR_PADDING, *,
                     batch_length: int | None = None, rows: slice | None = None) -> np.ndarray:
    """Random ``H x W`` windows of ``images`` ``[B, H, W, C]`` zero-padded by ``padding`` on each side, each
    flipped left-right with probability 1/2; vectorised over the batch. Draws ``B`` row offsets, ``B`` column
    offsets (uniform on ``0..2*padding``) and ``B`` flips from ``rng``, in that order. When ``images`` are
    rows ``rows`` of a batch of ``batch_length``, the draws are made for the whole batch and those rows'
    used, so a block is augmented exactly as inside the whole batch."""
    images = np.asarray(images)
    b, h, w, _ = images.shape
    n = b if batch_length is None else batch_length
    rows = slice(0, b) if rows is None else rows
    padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    dy = rng.integers(0, 2 * padding + 1, size=n)[rows]
    dx = rng.integers(0, 2 * padding + 1, size=n)[rows]
    flip = (rng.random(n) < 0.5)[rows]
    rows = dy[:, None] + np.arange(h)  # [B, H]
    cols = dx[:, None] + np.arange(w)  # [B, W]
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _pil():
    from PIL import Image

    return Image


def random_resized_crop(image: np.ndarray, rng: np.random.Generator, size: int = 224,
                        scale: tuple[float, float] = IMAGENET_SCALE,
                        ratio: tuple[float, float] = IMAGENET_RATIO) -> np.ndarray:
    """Inception-style crop of one ``[H, W, C]`` uint8 image, resized bilinearly to ``size x size``.

    Up to 10 tries draw an area fraction uniform in ``scale`` and a log aspect ratio (width / height)
    uniform in ``log(ratio)``; the first box that fits is placed uniformly. If none fits, the centre crop
    of the whole image with its aspect ratio clamped to ``ratio``.
    """
    height, width = image.shape[:2]
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            break
    else:
        in_ratio = width / height
        if in_ratio < ratio[0]:
            w, h = width, int(round(width / ratio[0]))
        elif in_ratio > ratio[1]:
            h, w = height, int(round(height * ratio[1]))
        else:
            w, h = width, height
        top, left = (height - h) // 2, (width - w) // 2
    return _resize(image[top:top + h, left:left + w], (size, size))


def _resize(image: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Bilinear (antialiased, PIL) resize of one ``[H, W, C]`` uint8 image to ``hw``."""
    channels = image.shape[-1]
    pil = _pil().fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((hw[1], hw[0]), _pil().Resampling.BILINEAR))
    return out.reshape(hw + (channels,))


def centre_crop(image: np.ndarray, size: int = 224, resize: int = IMAGENET_RESIZE) -> np.ndarray:
    """Evaluation transform: shorter side resized (bilinear) to ``resize``, then the centre ``size x size``."""
    height, width = image.shape[:2]
    s = resize / min(height, width)
    h, w = max(size, int(round(height * s))), max(size, int(round(width * s)))
    resized = _resize(image, (h, w))
    top, left = (h - size) // 2, (w - size) // 2
    return resized[top:top + size, left:left + size]


# ---------------------------------------------------------------------------------------------- sources

#: ``read(indices) -> (images, labels)``: what an ``ImageSource`` reads its records with (uint8 HWC images,
#: a sequence or an array, and their int labels).
Reader = Callable[[np.ndarray], tuple[Sequence[np.ndarray], np.ndarray]]


class ImageSource(BatchSource):
    """A split of an image data set: random access to (image uint8 HWC, label int).

    Attributes: ``name`` (key of :data:`IMAGE_DATASETS`), ``split``, ``num_examples``, ``num_classes``,
    ``image_shape`` (``(H, W, C)`` of the batches' images, after the crop for ImageNet), ``spec``.
    Built by :func:`load_image_dataset`, :func:`synthetic_image_dataset` or :meth:`from_arrays`.
    """

    def __init__(self, name: str, split: str, num_examples: int, read: Reader, *,
                 spec: ImageSpec | None = None) -> None:
        self.spec = spec if spec is not None else _spec(name)
        for setting in ("mean", "std"):
            values = np.asarray(getattr(self.spec, setting), np.float64)
            if not np.isfinite(values).all() or (setting == "std" and (values <= 0).any()):
                raise ValueError(f"{name}: normalisation {setting} {getattr(self.spec, setting)} must be finite"
                                 f"{' and > 0' if setting == 'std' else ''}; refusing to train on its batches")
        self.name = name
        self.split = split
        self.num_examples = int(num_examples)
        self.num_classes = self.spec.num_classes
        self.image_shape = tuple(self.spec.image_shape)
        self._read = read

    @classmethod
    def from_arrays(cls, name: str, images: np.ndarray, labels: np.ndarray, *, split: str = "train") -> ImageSource:
        """An in-memory source of uint8 ``images`` ``[N, H, W, C]`` and int ``labels`` ``[N]``, batched as
        data set ``name`` (its normalisation, augmentation and batch image shape)."""
        _check_split(name, split)
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError(f"images: want uint8 [N, H, W, C] matching labels [N]; got {images.dtype} "
                             f"{images.shape} and labels {labels.shape}")
        labels = check_read_labels(labels, np.arange(len(labels)), _spec(name).num_classes, f"{name}/{split}")
        return cls(name, split, len(images), lambda idx: (images[idx], labels[idx]))

    def __repr__(self) -> str:
        return (f"ImageSource({self.name!r}, split={self.split!r}, num_examples={self.num_examples}, "
                f"image_shape={self.image_shape}, num_classes={self.num_classes})")

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[list[np.ndarray] | np.ndarray, np.ndarray]:
        """The stored uint8 images (HWC; a list when their sizes differ) and int32 labels at ``indices``."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise IndexError(f"indices outside 0..{self.num_examples - 1}")
        images, labels = self._read(indices)
        return images, check_read_labels(labels, indices, self.num_classes, f"{self.name}/{self.split}")

    def preprocess(self, images: Sequence[np.ndarray] | np.ndarray, rng: np.random.Generator | None,
                   augment: bool, rows: slice | None = None, batch_length: int | None = None) -> np.ndarray:
        """Stored uint8 images -> normalised float32 ``[B, *image_shape]`` (augmented when ``augment``).

        ``rows``/``batch_length``: the images are rows ``rows`` of a batch of ``batch_length`` (one process's
        block); the augmentation is then exactly what those rows get when the whole batch is preprocessed."""
        kind = self.spec.augmentation
        rows = slice(0, len(images)) if rows is None else rows
        if kind == "inception":
            size = self.image_shape[0]
            if augment:  # one generator per example (spawned from rng), so a block's crops need no other rows
                gens = rng.spawn(batch_length if batch_length is not None else len(images))[rows]
                out = []
                for image, g in zip(images, gens):
                    crop = random_resized_crop(np.asarray(image), g, size)
                    out.append(crop[:, ::-1] if g.random() < 0.5 else crop)
                batch = np.stack(out) if out else np.zeros((0, size, size, self.image_shape[2]), np.uint8)
            else:
                batch = np.stack([centre_crop(np.asarray(image), size) for image in images]) if len(images) else \
                    np.zeros((0, *self.image_shape), np.uint8)
        else:
            batch = np.stack(images) if isinstance(images, (list, tuple)) else np.asarray(images)
            if augment and kind == "crop_flip":
                batch = random_crop_flip(batch, rng, batch_length=batch_length, rows=rows)
        if batch.shape[1:] != self.image_shape:
            raise ValueError(f"{self.name}: images of shape {batch.shape[1:]}, want {self.image_shape}")
        return normalise(batch, self.spec.mean, self.spec.std)

    def check_finite(self, batch: np.ndarray, indices: Sequence[int] | np.ndarray, epoch: int,
                     batch_index: int) -> None:
        """Refuse a batch with a NaN or infinite value, naming the split, epoch, batch and example index."""
        bad = ~np.isfinite(batch.reshape(len(batch), -1)).all(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            value = batch[i][~np.isfinite(batch[i])].reshape(-1)[0]
            raise ValueError(f"{self.name}/{self.split}: epoch {epoch}, batch {batch_index}: example "
                             f"{int(np.asarray(indices)[i])} (row {i} of the batch) has a non-finite value "
                             f"({value}); refusing to train on it")

def check_read_labels(labels: Sequence[int] | np.ndarray, indices: Sequence[int] | np.ndarray, num_classes: int,
                      where: str) -> np.ndarray:
    """``labels`` read for the records ``indices`` as int32 ``[N]`` if they are integers (any integer dtype)
    in ``0 .. num_classes - 1``, one per record; else ``ValueError`` naming ``where`` (data set/split) and the
    first bad record. A label 10 of a 10-class data set (a damaged or foreign record, a wrong data set) would
    otherwise train a 10-class model on a class it does not have, and a float label would be truncated."""
    y, rows = np.asarray(labels), np.asarray(indices).reshape(-1)
    if y.size and (y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"{where}: labels of dtype {y.dtype} read (records {rows[:3].tolist()}...); want integer "
                         "class labels")
    y = y.reshape(-1)
    if len(y) != len(rows):
        raise ValueError(f"{where}: {len(y)} labels read for {len(rows)} records")
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{where}: record {int(rows[i])} has label {int(y[i])}, outside 0 .. {num_classes - 1} "
                         f"({num_classes} classes); refusing to train on it")
    return y.astype(np.int32)


def load_image_dataset(name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None) -> ImageSource:
    """Split ``split`` of the TFDS data set ``name`` (a key of :data:`IMAGE_DATASETS`) prepared as array_record.

    Raises ValueError naming ``dataset`` or ``split`` for unknown names, and :class:`DataNotPreparedError`
    (after reading only the directory and its ``dataset_info.json``) when the data set, that split or the
    array_record files are missing from the data directory (``data_dir``, else ``$TFDS_DATA_DIR``, else
    ``~/tensorflow_datasets``).
    """
    spec = _spec(name)
    _check_split(name, split)
    root, version, info = _prepared_info(name, split, data_dir)
    if is_url(root):  # ArrayRecord reads local files: the version folder copied once into the local cache
        root = local_copy(root, spec.tfds_name, version)

    import tensorflow_datasets as tfds  # slow import, only once the data are known to exist

    source = tfds.data_source(f"{spec.tfds_name}:{version}", split=split, data_dir=str(root), download=False)
    num_examples = source.dataset_info.splits[split].num_examples

    def read(indices: np.ndarray):
        records = source.__getitems__(indices.tolist()) if len(indices) else []
        images = [np.asarray(r["image"]) for r in records]
        labels = np.array([r["label"] for r in records]) if records else np.zeros(0, np.int32)
        return images, labels  # as stored: ImageSource.read checks them (check_read_labels, #22)

    return ImageSource(name, split, num_examples, read, spec=spec)


def synthetic_image_dataset(name: str = "cifar10", num_examples: int = 512, *, seed: int = 0,
                            split: str = "train") -> ImageSource:
    """In-memory random data of data set ``name``'s shape and classes, with the same interface.

    Learnable by construction, also under augmentation: class ``c`` has a fixed prototype image, drawn from
    ``default_rng([seed, 0])`` and shared by the splits: grey 128, plus a class colour (uniform in
    [-32, 32] per channel), plus a smooth pattern (a 4x4 grid uniform in [-48, 48] per channel, made
    left-right symmetric so flips keep it, bilinearly interpolated to the image size so 4-pixel shifts
    keep most of it). An example is its class prototype plus independent Gaussian pixel noise of standard
    deviation 48 (``default_rng([seed, 1, split index])``), rounded and clipped to uint8. Labels cycle
    through the classes in a random order, so classes are balanced to within one. A nearest-class-mean
    classifier, even with means of augmented images, is far above chance, and a short training run visibly
    lowers the loss. ImageNet images are stored at 64x64 (memory) and go through the usual crops to 224.
    """
    spec = _spec(name)
    _check_split(name, split)
    if not isinstance(num_examples, (int, np.integer)) or num_examples < 1:
        raise ValueError(f"num_examples: want a positive integer, got {num_examples!r}")
    _check_nonneg("seed", seed)
    h, w, c = (64, 64, 3) if spec.augmentation == "inception" else spec.image_shape
    proto_rng = np.random.default_rng([seed, 0])
    colour = proto_rng.uniform(-32, 32, size=(spec.num_classes, 1, 1, c))
    grid = proto_rng.uniform(-48, 48, size=(spec.num_classes, 4, 4, c))
    grid = (grid + grid[:, :, ::-1]) / 2
    pattern = np.einsum("hi,kijc,wj->khwc", _interpolation_matrix(h, 4), grid, _interpolation_matrix(w, 4))
    prototypes = 128.0 + colour + pattern
    rng = np.random.default_rng([seed, 1, spec.splits.index(split)])
    labels = rng.permutation(np.arange(num_examples) % spec.num_classes).astype(np.int32)
    images = np.empty((num_examples, h, w, c), np.uint8)
    for start in range(0, num_examples, 256):  # bounded float64 temporaries
        sl = slice(start, start + 256)
        noisy = prototypes[labels[sl]] + rng.normal(0.0, 48.0, size=(len(labels[sl]), h, w, c))
        images[sl] = np.clip(np.rint(noisy), 0, 255)
    return ImageSource.from_arrays(name, images, labels, split=split)


def _interpolation_matrix(size: int, knots: int) -> np.ndarray:
    """``[size, knots]`` weights of linear interpolation from ``knots`` evenly spread points to ``size``."""
    pos = np.linspace(0, knots - 1, size)
    lower = np.minimum(np.floor(pos).astype(int), knots - 2)
    frac = pos - lower
    m = np.zeros((size, knots))
    m[np.arange(size), lower] = 1 - frac
    m[np.arange(size), lower + 1] = frac
    return m
