"""Issue 12, experiments side: preflight before any training, CLI errors as argparse errors, a corrupt
MNIST-1D cache rebuilt, --quick's own output folder, replaced results announced, non-finite data refused."""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import batch_noise, common, degradation, reproduce, taki_cifar
from resjax.data import Dataset, check_finite, load_dataset, synthetic_image_dataset
from resjax.data import mnist1d as mnist1d_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args, out):
    """``python -m experiments.<...> --out out`` from the repository root; (returncode, stderr, seconds)."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", *args, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stderr, time.time() - start


# ---- CLI: argparse errors, exit 2, the flag named, nothing trained ---------------------------------------


@pytest.mark.parametrize("args, flag, allowed", [
    # 5000 > the 4,000 training examples: refused before the 16 trains (it used to fail after 166 s)
    (("--sweep_batch_sizes", "(16, 5000)"), "--sweep_batch_sizes", "from 1 to 4000"),
    (("--model.width", "0"), "--model.width", "integer >= 1"),
])
def test_cli_refuses_bad_settings_before_training(tmp_path, args, flag, allowed, capsys):
    """The command line's own code (``common.main``, what ``python -m experiments.degradation`` calls) in this
    process: a process of its own costs seconds, and ``test_cli_unparsable_value_is_an_argparse_error`` runs the
    real command line."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:  # anything else (a traceback) fails the test
        common.main(degradation, ["--quick", *args, "--out", str(out)])
    code, err = stopped.value.code, capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert flag in last and allowed in last, err
    assert not (out / "results.json").exists()
    assert not (out / "degradation.png").exists()


def test_cli_unparsable_value_is_an_argparse_error(tmp_path):
    code, err, _ = _cli("experiments.batch_noise", "--quick", "--num_batches", "many", out=tmp_path / "o")
    assert code == 2 and "Traceback" not in err
    assert "argument --num_batches: expected an integer, got 'many'" in err


# ---- preflight in-process ------------------------------------------------------------------------------


def _refused(module, config, out, match):
    with pytest.raises(ValueError, match=match):
        common.preflight(module, config, out)


def test_preflight_refuses_every_bad_cell(tmp_path):
    out = tmp_path / "out"
    cases = [  # (module, setting, value, the error's start)
        (degradation, "train.batch_size", -3, r"^train\.batch_size: must be an integer >= 1, got -3"),
        (degradation, "train.batch_size", 4001, r"^train\.batch_size: .*from 1 to 4000"),
        (degradation, "sweep_batch_sizes", (16, 5000), r"^sweep_batch_sizes: .*got 5000"),
        (degradation, "num_seeds", 0, r"^num_seeds: must be an integer >= 1, got 0"),
        (degradation, "model.width", 0, r"^model\.width: must be an integer >= 1, got 0"),
        (degradation, "train.learning_rate", float("nan"), r"^train\.learning_rate: must be a finite number, got nan"),
        (degradation, "train.momentum", float("inf"), r"^train\.momentum: must be a finite number, got inf"),
        (batch_noise, "sweep_batch_sizes", (4, 1), r"^sweep_batch_sizes: .*>= 2"),
        (batch_noise, "epsilon", float("nan"), r"^epsilon: must be a finite number"),
        (taki_cifar, "train.batch_size", 129, r"^train\.batch_size: .*from 1 to 128 .*got 129"),
        (taki_cifar, "variants", ("he", "xavier"), r"^variants: unknown variant 'xavier'"),
    ]
    for module, name, value, match in cases:
        config = module.get_config("quick")
        common.set_path(config, name, value)
        _refused(module, config, out, match)
    for name in reproduce.REGISTRY:  # every experiment has the hook, and its quick config passes
        module = importlib.import_module(f"experiments.{name}")
        assert callable(module.check), name
        common.preflight(module, module.get_config("quick"), tmp_path / name)


def test_preflight_refuses_an_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _refused(batch_noise, batch_noise.get_config("quick"), blocker / "out", r"^out: cannot write into")
    # a folder that exists but takes no files: read-only for a normal user; root writes anywhere but /proc
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:
        locked = pathlib.Path("/proc")
    _refused(batch_noise, batch_noise.get_config("quick"), locked, r"^out: cannot write into")


def test_error_names_map_to_flags():
    leaves = common.flatten(degradation.get_config("quick"))
    assert common.flag_message(ValueError("batch_size: must be >= 1"), leaves) == \
        "argument --train.batch_size: must be >= 1"
    assert common.flag_message(ValueError("data.name: unknown"), leaves) == "argument --data: unknown"
    assert common.flag_message(ValueError("out: cannot write\ninto x"), leaves) == "argument --out: cannot write into x"


def test_reproduce_preflights_every_experiment_before_running_any(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(common, "run_experiment", lambda module, *a: ran.append(module.NAME))
    real = batch_noise.get_config

    def bad(size="default"):
        config = real(size)
        config.num_batches = 0
        return config

    monkeypatch.setattr(batch_noise, "get_config", bad)
    with pytest.raises(SystemExit) as exc:  # batch_noise comes after degradation in REGISTRY
        reproduce.main(["--quick", "--out", str(tmp_path), "--only", "degradation", "batch_noise"])
    assert exc.value.code == 2 and ran == []


# ---- outputs ---------------------------------------------------------------------------------------------


def test_quick_has_its_own_default_folder():
    _, out = common.parse_args(batch_noise, ["--quick"])
    assert out == pathlib.Path("runs/batch_noise-quick")
    assert common.parse_args(batch_noise, [])[1] == pathlib.Path("runs/batch_noise")
    assert common.parse_args(batch_noise, ["--full"])[1] == pathlib.Path("runs/batch_noise")


def test_replacing_results_says_what_it_replaces(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(batch_noise, "run", lambda config, out_dir: {"x": 1.0})
    common.run_experiment(batch_noise, batch_noise.get_config("quick"), tmp_path)
    assert "replac" not in capsys.readouterr().out
    config = batch_noise.get_config("quick")
    config.num_batches = 123
    common.run_experiment(batch_noise, config, tmp_path)
    said = capsys.readouterr().out
    path = str(tmp_path / "results.json")
    assert f"replacing {path} (experiment batch_noise, size quick" in said
    assert "written 20" in said
    common.run_experiment(batch_noise, batch_noise.get_config("quick"), tmp_path)
    assert "custom config: num_batches=123" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["config"]["num_batches"] == 400


# ---- data ------------------------------------------------------------------------------------------------


def test_corrupt_mnist1d_cache_is_named_and_rebuilt(tmp_path, monkeypatch):
    source = mnist1d_module.cache_dir() / "mnist1d_default.npz"
    good = load_dataset("mnist1d")  # fills the suite's cache if empty
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path))
    path = tmp_path / "mnist1d_default.npz"
    path.write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.warns(RuntimeWarning, match=r"MNIST-1D cache .*mnist1d_default\.npz is unreadable \(BadZipFile"):
        data = mnist1d_module.load_mnist1d()
    assert str(tmp_path) in str(mnist1d_module.cache_dir())
    np.testing.assert_array_equal(data.x_train, good.x_train)
    with np.load(path) as f:  # rewritten with the generated data
        np.testing.assert_array_equal(f["y_test"], good.y_test)
    assert source.exists()


def _nan_at_17(d):
    x = d.x_train.copy()
    x[17, 5] = np.nan
    return d._replace(x_train=x)


# Mutations caught (#22 item 8): resjax/data/mnist1d.py `_read_cache`: `return check_finite(data)` -> `return data`
# (the cache's finiteness check removed: the "NaN" case returns the damaged data); the shape check
# (`if shapes != [(4000, 40), ...]`) removed (the "length 20" case returns inputs of length 20).
@pytest.mark.parametrize("damage, what", [
    (lambda d: d._replace(y_train=d.y_train - 1), r"y_train holds labels -1 \.\. 8"),
    (lambda d: d._replace(y_test=d.y_test * 11), r"y_test holds labels 0 \.\. 99"),
    (lambda d: d._replace(y_train=d.y_train.astype(np.float32)), "not float32 inputs and int32 labels"),
    (lambda d: d._replace(x_train=d.x_train[:, :20], x_test=d.x_test[:, :20]), "are not the MNIST-1D data set of these arguments"),
    (_nan_at_17, r"data\.x_train: example 17 has a non-finite value \(nan\)"),
], ids=["labels -1", "labels 0..99", "float labels", "length 20", "NaN"])
def test_a_readable_mnist1d_cache_with_wrong_content_is_rebuilt(tmp_path, monkeypatch, damage, what):
    """Issue #22 item 7: a valid .npz whose labels are -1 or 0..99, float, or whose inputs have length 20 was
    accepted. Mutation: drop the shape/dtype/label checks of _read_cache -> the damaged data are returned."""
    good = load_dataset("mnist1d")
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path))
    np.savez(tmp_path / "mnist1d_default.npz", **damage(good)._asdict())
    with pytest.warns(RuntimeWarning, match=what):
        data = mnist1d_module.load_mnist1d()
    for a, b in zip(data, good):
        np.testing.assert_array_equal(a, b)


def test_a_mnist1d_cache_path_that_is_a_directory_is_a_warning(tmp_path, monkeypatch):
    good = load_dataset("mnist1d")
    monkeypatch.setenv("RESJAX_CACHE", str(tmp_path))
    (tmp_path / "mnist1d_default.npz").mkdir()
    with pytest.warns(Warning):  # unreadable, then not writable: the data are generated and used
        data = mnist1d_module.load_mnist1d()
    np.testing.assert_array_equal(data.y_test, good.y_test)


def test_non_finite_data_is_refused_naming_split_and_index():
    data = load_dataset("mnist1d")
    assert check_finite(data) is data
    x = data.x_train.copy()
    x[17, 5] = np.nan
    with pytest.raises(ValueError, match=r"^data\.x_train: example 17 has a non-finite value \(nan\); refusing"):
        check_finite(data._replace(x_train=x))
    x = data.x_test.copy()
    x[3, 0], x[9, 1] = np.inf, np.nan
    with pytest.raises(ValueError, match=r"^data\.x_test: example 3 has a non-finite value \(inf\)"):
        check_finite(Dataset(data.x_train, data.y_train, x, data.y_test))


def test_streamed_image_batches_with_non_finite_values_are_refused():
    source = synthetic_image_dataset("cifar10", 16)
    batches = list(source.epoch(1, 8, seed=3))  # finite: no complaint
    assert len(batches) == 2
    order = source.order(1, seed=3)
    read = source._read
    bad = int(order[8 + 2])  # the third example of batch 1

    def read_with_nan(indices):
        images, labels = read(indices)
        images = images.astype(np.float32)
        images[indices == bad] = np.nan
        return images, labels

    source._read = read_with_nan
    with pytest.raises(ValueError, match=rf"^cifar10/train: epoch 1, batch 1: example {bad} \(row 2 of the batch\) "
                                         r"has a non-finite value \(nan\); refusing to train on it"):
        list(source.epoch(1, 8, seed=3))


# ---- issue #22 item 5: results before figures, each written whole ---------------------------------------------


def test_a_figure_that_cannot_be_written_loses_no_results(tmp_path, monkeypatch, capsys):
    """A full disk at the figure (savefig raising ENOSPC): results.json is already written, whole; no 0-byte PNG
    and no temporary file is left, and the failure is named. Mutation: write the figure inside run() before the
    results (as before) -> results.json is never written."""
    import errno
    import types

    import matplotlib.figure

    plt = common.pyplot()

    def run(config, out_dir):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        common.save_figure(fig, out_dir / "fake.png")
        return {"answer": 42}

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    module = types.SimpleNamespace(NAME="fake", run=run, get_config=lambda size="default": None)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    results = common.run_experiment(module, {}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["metrics"] == {"answer": 42} == results["metrics"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no fake.png, no .tmp
    assert "could not write the figure" in capsys.readouterr().err
    monkeypatch.undo()
    common.run_experiment(module, {}, tmp_path)  # with room: the figure is written after the results
    assert (tmp_path / "fake.png").stat().st_size > 0


# Mutations caught: resjax/train/core.py `Core.open_checkpoints`: the `check_free_space(...)` call removed (a
# full checkpoint disk found only at the first save, after training); experiments/preflight.py `check_out_dir`:
# its `check_free_space(...)` call removed (a full output disk found when the results are written).
def test_too_little_free_space_is_a_warning_naming_the_folder_before_training(tmp_path, monkeypatch):
    """#22 item 5: the disks of the checkpoint directory and of the output folder are asked for their free space
    (``shutil.disk_usage``, here reporting 2 kB free) before anything trains: a warning names the folder, the
    space free and what it should hold. With room, no warning."""
    import shutil
    import warnings

    from resjax.train import checkpoint as ckpt_lib
    from resjax.train import make_train
    from tests.test_training import DATA, tiny_config

    real = shutil.disk_usage
    little = lambda path: real(path)._replace(free=2000)  # noqa: E731
    trainer = make_train(tiny_config(), DATA)
    trained = []
    with monkeypatch.context() as mp:
        mp.setattr(ckpt_lib.shutil, "disk_usage", little)
        with pytest.warns(RuntimeWarning, match=rf"^checkpoint_dir: only 2 kB free on the disk of {tmp_path / 'ckpt'}, "
                                                r"less than one checkpoint of this run \(about \d+ kB\)"):
            trainer.sweep([0, 1], checkpoint_dir=tmp_path / "ckpt", callback=lambda *a: trained.append(a))
        with pytest.warns(RuntimeWarning, match=rf"^out: only 2 kB free on the disk of {tmp_path / 'out'}, less than "
                                                r"a run's results, figures and metrics\.jsonl \(about 16\.0 MB\)"):
            common.preflight(batch_noise, batch_noise.get_config("quick"), tmp_path / "out")
    assert trained  # a warning: the run goes on
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with room (this disk's own answer), nothing is said
        trainer.sweep([0, 1], checkpoint_dir=tmp_path / "ckpt2")
        common.preflight(batch_noise, batch_noise.get_config("quick"), tmp_path / "out")


# ---- issue #22 item 6: settings that used to pass the preflight and fail later (or hang) ---------------------


@pytest.mark.parametrize("name, argv, message", [
    ("degradation", ["--train.schedule", "bogus"], "argument --train.schedule: unknown schedule 'bogus'"),
    ("degradation", ["--seed", "-1"], "argument --seed: must be an integer in [0, 2**31), got -1"),
    ("degradation", ["--seed", "2147483648"], "argument --seed: must be an integer in [0, 2**31)"),
    ("degradation", ["--train.epochs", "1000000000000"], "more than the int32 step counter holds"),
    ("variance_growth", ["--kernel_init", "bogus"], "argument --kernel_init: unknown initialiser 'bogus'"),
    ("taki_init", ["--input_variance", "-1"], "argument --input_variance: must be a finite number > 0"),
    ("batchnorm_example", ["--minibatch", "()"], "argument --minibatch: a list of at least 2 numbers"),
    ("tau_training", ["--depths", "(100000000000,)"], "argument --depths: 100000000000 is more than any array"),
])
def test_settings_are_refused_by_the_preflight_with_exit_2(name, argv, message, capsys, tmp_path):
    # mutation: drop the matching check (check_schedule in check_train_config, check_seeds, check_step_count,
    # the experiment's own check, the 2**31 bound of check_counts) -> a traceback seconds in, or a hang
    module = importlib.import_module(f"experiments.{name}")
    with pytest.raises(SystemExit) as stopped:
        common.parse_args(module, ["--quick", *argv, "--out", str(tmp_path)], check=True)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
