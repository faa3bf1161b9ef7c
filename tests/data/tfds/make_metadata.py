"""Regenerate the TFDS metadata committed beside this script (no TensorFlow, no download).

``tfds.testing.mock_data(policy=USE_FILES, data_dir=...)`` reads ``<data_dir>/<name>/<version>/``
(``dataset_info.json``, ``features.json``, ClassLabel name files) to learn a data set's real splits;
the examples themselves are generated at random by the mock. This script builds that metadata from
tfds's own builder classes with the real split sizes filled in (one shard per split, ``num_bytes``
0: the mock never reads a byte of data) and ``file_format`` array_record, then deletes what the mock
does not need. Run from the repository root::

    /work/venv/bin/python tests/data/tfds/make_metadata.py
"""

from __future__ import annotations

import pathlib
import shutil

import tensorflow_datasets as tfds

HERE = pathlib.Path(__file__).resolve().parent

# Real split sizes of the prepared data sets (tfds catalogue).
SPLITS = {
    "mnist": {"train": 60_000, "test": 10_000},
    "cifar10": {"train": 50_000, "test": 10_000},
    "cifar100": {"train": 50_000, "test": 10_000},
    "imagenet2012": {"train": 1_281_167, "validation": 50_000, "test": 100_000},
}


def main() -> None:
    for name, sizes in SPLITS.items():
        shutil.rmtree(HERE / name, ignore_errors=True)
        builder = tfds.builder(name, data_dir=str(HERE), file_format="array_record")
        out = pathlib.Path(builder.data_dir)
        out.mkdir(parents=True)
        builder.info.set_splits(tfds.core.SplitDict([
            tfds.core.SplitInfo(name=split, shard_lengths=[n], num_bytes=0)
            for split, n in sizes.items()]))
        builder.info.write_to_directory(out)
        print(out, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
