"""The image-training experiments (cifar_tau, taki_cifar) on synthetic stand-in data: the contract, the
failure rule, resuming from their checkpoints, and the report's 'not measured' path when data is missing."""

import json

import numpy as np
import pytest

from experiments import cifar_tau, common, image_runs, reproduce, taki_cifar


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


def small_cifar_tau_config():
    c = cifar_tau.get_config("quick")
    c.bn_datasets = ()
    c.tau_inv_depths = ()
    c.num_seeds = 2
    c.train.epochs = 1
    c.synthetic_examples = 128  # 2 steps of 64: unoptimised convolutions (fast_compiles) run slowly
    return c


def test_cifar_tau_quick_cells_metrics_and_resume(tmp_path):
    config = small_cifar_tau_config()
    assert cifar_tau.cells(config) == [("cifar10", "tau_sqrt", 8), ("cifar10", "fixup", 8)]
    first = common.run_experiment(cifar_tau, config, tmp_path)
    m = first["metrics"]
    assert m[image_runs.STAND_IN] == 1
    for variant in ("tau_sqrt", "fixup"):
        k = f"cifar10.{variant}.L8"
        errs = m[f"final_test_error_pct.{k}"]
        assert len(errs) == 2
        acc = [None if e is None else 1 - e / 100 for e in errs]
        failed = sum(a is None or a < 0.2 for a in acc)
        assert m[f"failed.{k}"] == failed  # the documented rule: diverged or below twice chance
        assert np.asarray(m[f"curves.{k}.test_acc"], float).shape == (2, 1)
    assert (tmp_path / "cifar_tau.png").stat().st_size > 10_000
    # every cell checkpointed; a rerun resumes from the checkpoints and trains nothing
    again = common.run_experiment(cifar_tau, config, tmp_path)
    for key, value in m.items():
        if not key.startswith("seconds"):
            assert again["metrics"][key] == value, key
    # results.json's seconds are the run's over its sessions (#53): the rerun adds less than the first run took
    assert first["seconds"] <= again["seconds"] < 2 * first["seconds"]


def test_taki_cifar_quick_records_first_epoch_statistics(tmp_path):
    config = taki_cifar.get_config("quick")
    config.variants = ("taki", "bn")
    config.num_blocks = 3
    # one epoch (the statistics are of the first) of 128 images, 2 steps: unoptimised convolutions run slowly
    config.train.epochs, config.synthetic_examples = 1, 128
    m = common.run_experiment(taki_cifar, config, tmp_path)["metrics"]
    for v in ("taki", "bn"):
        first = np.asarray(m[f"first_epoch_acc.{v}"])
        assert first.shape == (2,) and ((0 <= first) & (first <= 1)).all()
        assert m[f"first_epoch_acc_mean.{v}"] == pytest.approx(first.mean())
        assert m[f"first_epoch_acc_var.{v}"] == pytest.approx(first.var(ddof=1))
    assert (tmp_path / "taki_cifar.png").stat().st_size > 10_000


def test_bad_settings_name_the_setting(tmp_path):
    config = taki_cifar.get_config("quick")
    config.variants = ("he", "xavier")
    with pytest.raises(ValueError, match="variants"):
        taki_cifar.run(config, tmp_path)
    config = small_cifar_tau_config()
    config.data = "imagenet"
    with pytest.raises(ValueError, match="data"):
        cifar_tau.run(config, tmp_path)
    config = small_cifar_tau_config()
    config.scan = "sometimes"
    with pytest.raises(ValueError, match="scan"):
        cifar_tau.run(config, tmp_path)


def test_missing_data_runs_the_stand_in_and_marks_claims_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no_data_here"))
    config = taki_cifar.get_config("default")
    message = image_runs.missing_data(taki_cifar, config)
    assert message and "no_data_here" in message and "tfds build cifar10" in message

    real_get_config = taki_cifar.get_config

    def tiny(size="default"):
        c = real_get_config(size)
        if size == "quick":
            c.variants, c.num_blocks = ("taki",), 2
            c.train.epochs, c.synthetic_examples = 1, 128  # the report's path, not the training, is checked
        return c

    monkeypatch.setattr(taki_cifar, "get_config", tiny)
    monkeypatch.setattr(taki_cifar, "CLAIMS", taki_cifar.CLAIMS)
    report = reproduce.main(["--out", str(tmp_path / "runs"), "--only", "taki_cifar"])
    text = report.read_text()
    assert "**Not measured.**" in text and "tfds build cifar10" in text
    for claim in taki_cifar.CLAIMS:
        assert f"| {claim.text} |" in text
    assert text.count("| not measured | not measured |") == len(taki_cifar.CLAIMS)
    results = json.loads((tmp_path / "runs" / "taki_cifar" / "results.json").read_text())
    assert results["config"]["data"] == "synthetic"
