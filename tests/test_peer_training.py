"""The peers' training rules as resjax presets: one and two SGD steps of resjax's own training step
(``Core.train_step``: mean cross-entropy, ``make_optimizer`` with the ``'tau_resnet'`` / ``fixup``
parameter groups) from the peers' weights, against float64 fixtures of the peers' own training step
(``tools/make_parity_fixtures.py``: the repositories' ``cifar_train.py`` optimiser, parameter groups and
step sequence, run by torch). Torch is not needed here."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from resjax import interop
from resjax.nn.resnet import REPOSITORY_MODELS, cifar_resnet
from resjax.train import image_train_config, run_config
from resjax.train.core import Core, with_hyperparams
from resjax.train.optim import PARAM_GROUP_PRESETS, fixup_param_groups, fixup_recipe, group_factors, make_optimizer
from tests.conftest import xla_optimisations

# float64 convolutions: ~20% slower to run here without XLA's optimisation passes (the test run's default)
pytestmark = pytest.mark.usefixtures("optimized_compiles")
DATA = Path(__file__).parent / "data" / "parity"
TOL = 1e-12


def _fixtures(name):
    with np.load(DATA / f"{name}_resnet20.npz") as f:
        start = {k[3:]: f[k].astype(np.float64) if f[k].dtype.kind == "f" else f[k]
                 for k in f.files if k.startswith("sd/")}
        meta = json.loads(str(f["meta"]))
    with np.load(DATA / f"{name}_sgd_steps.npz") as f:
        steps = {k: f[k] for k in f.files}
    return meta, start, steps


def _train_config(name, batch):
    """The peer's recipe from resjax's presets: He et al.'s SGD (momentum 0.9, weight decay 1e-4 on every
    parameter) at base rate 0.1; tau-ResNet's scalars at lr/10; Fixup's recipe (``fixup_recipe``: rate times
    batch/128 with its bias and scale parameters at 0.1 unscaled, Fixup's schedule)."""
    if name == "fixup":
        return image_train_config(**fixup_recipe(batch))
    return image_train_config(param_groups=("tau_resnet",))


@pytest.mark.parametrize("name", ["tau_resnet_bn", "tau_resnet_nobn", "fixup"])
def test_one_and_two_sgd_steps_match_the_peers_training_step_in_float64(name):
    meta, start, steps = _fixtures(name)
    peer = json.loads(str(steps["meta"]))
    model = cifar_resnet(meta["depth"], **meta["resjax"], **REPOSITORY_MODELS[name])
    batch = steps["x1"].shape[0]
    counts = interop.bn_counts(model, (batch, 32, 32, 3))
    config = _train_config(name, batch)
    with jax.enable_x64(True):
        variables = interop.from_torch_state_dict(model, start, bn_count=counts)
        assert_two_peer_steps(model, config, variables, steps, bn_count=counts)


def assert_two_peer_steps(model, config, variables, steps, bn_count=None) -> list[str]:
    """resjax's own ``Core.train_step`` (float64: call under ``jax.enable_x64``) from the imported ``variables``
    against the peer's two stored SGD steps (``steps``: a ``*_sgd_steps.npz``): the losses and every stored tensor
    (exported with ``bn_count``) to ``TOL``, relative. Returns the names compared at each step."""
    peer = json.loads(str(steps["meta"]))
    params = variables["params"]
    core = Core(config=run_config(train=config), model=model, tx=make_optimizer(config, params, 1),
                example_shape=(32, 32, 3), uses_tau=False, steps_per_epoch=1)
    with xla_optimisations(False):  # the run's other fields (step, key, epoch, history); the rest is replaced below
        run = jax.jit(core.init_run)(jax.random.key(0))
        opt_state = with_hyperparams(core.tx.init(params), core.default_hparams())
    assert opt_state.hyperparams["learning_rate"].dtype == np.float64
    run = run._replace(state=run.state.replace(params=params, batch_stats=variables.get("batch_stats", {}),
                                               opt_state=opt_state))
    step = jax.jit(core.train_step)
    compared = []
    for i in (1, 2):
        x = np.transpose(steps[f"x{i}"], (0, 2, 3, 1))
        run, (loss, _) = step(run, (x, steps[f"y{i}"].astype(np.int32)))
        np.testing.assert_allclose(float(loss), peer["losses"][i - 1], rtol=TOL)
        after = interop.to_torch_state_dict(run.state.variables(), model, bn_count=bn_count)
        expected = {k[len(f"step{i}/"):]: v for k, v in steps.items()
                    if k.startswith(f"step{i}/") and not k.endswith("num_batches_tracked")}
        for k, v in expected.items():
            a = np.asarray(after[k])
            assert a.dtype == np.float64, k
            err = np.max(np.abs(a - v)) / max(np.max(np.abs(v)), 1e-300)
            assert err < TOL, f"step {i}, {k}: relative error {err:.2e}"
        compared.append(sorted(expected))
    return compared


def test_the_presets_select_the_peers_groups():
    """Fixup's preset gives lr/10 to exactly the parameters whose torch name holds 'bias' or 'scale' (the
    classifier's bias included); tau-ResNet's to its scalars (biases and tau), not to the classifier's bias."""
    for name, preset in (("fixup", "fixup"), ("tau_resnet_nobn", "tau_resnet")):
        meta, start, steps = _fixtures(name)
        model = cifar_resnet(meta["depth"], **meta["resjax"], **REPOSITORY_MODELS[name])
        params = interop.from_torch_state_dict(model, start)["params"]
        lr, _ = group_factors(params, (preset,))
        names = interop.to_torch_state_dict({"params": jax.tree.map(lambda f, p: np.full(p.shape, f), lr, params)},
                                            model)
        groups = json.loads(str(steps["meta"]))["param_groups"]
        every = {n for g in groups for n in g["names"]}  # named_parameters (tau once, not its per-block aliases)
        slow = {k for k, f in names.items() if k in every and np.all(np.asarray(f) == 0.1)}
        peer_slow = {n for g in groups if g["group"] != "others" for n in g["names"]}
        assert every <= set(names)
        assert slow == peer_slow, (name, sorted(slow ^ peer_slow)[:5])
    assert PARAM_GROUP_PRESETS["fixup"] == fixup_param_groups(128)


def _leaves(tree, model):
    """A parameter tree as the peer's ``{torch name: array}``."""
    return interop.to_torch_state_dict({"params": tree}, model)


@pytest.mark.parametrize("batch", [128, 256, 1024])
def test_fixup_recipe_steps_at_the_peer_s_rate_of_every_group_at_every_epoch(batch):
    """Fixup's recipe at ``batch`` (``fixup_recipe``: the ``'fixup'`` schedule and ``fixup_param_groups``) against
    the rates the Fixup script's own ``adjust_learning_rate`` gives each parameter group at the start of each
    epoch (``fixup_lr_schedule.json``: the warm-up from 0.1 above batch 128, the milestones). Each epoch's
    first and last step of resjax's optimiser, from a fresh momentum buffer, moves every parameter as the peer's
    SGD does, ``p - lr_group(epoch) * (g + 1e-4 p)``, in float64."""
    with open(DATA / "fixup_lr_schedule.json") as f:
        peer = json.load(f)
    expected = peer["batches"][str(batch)]
    meta, start, steps = _fixtures("fixup")
    groups = {n: g["group"] for g in json.loads(str(steps["meta"]))["param_groups"] for n in g["names"]}
    model = cifar_resnet(meta["depth"], **meta["resjax"], **REPOSITORY_MODELS["fixup"])
    config = image_train_config(**fixup_recipe(batch))
    steps_per_epoch = 3
    with jax.enable_x64(True), xla_optimisations(False):  # elementwise updates: nothing for XLA's passes to speed up
        params = interop.from_torch_state_dict(model, start)["params"]
        grads = jax.tree_util.tree_map(lambda p: np.cos(np.arange(p.size).reshape(p.shape) + 1.0), params)
        tx = make_optimizer(config, params, steps_per_epoch)
        update = jax.jit(tx.update)
        fresh = tx.init(params)
        p, g = _leaves(params, model), _leaves(grads, model)
        for i, epoch in enumerate(peer["meta"]["epochs"]):
            for step in (epoch * steps_per_epoch, epoch * steps_per_epoch + steps_per_epoch - 1):
                state = jax.tree_util.tree_map_with_path(  # every step counter (the schedule's too) at `step`
                    lambda path, x: np.asarray(step, np.int32) if getattr(path[-1], "name", None) == "count" else x,
                    fresh)
                moved, _ = update(grads, state, params)
                got = _leaves(moved, model)
                for name, group in groups.items():  # the peer's step: p -= lr_group(epoch) * (g + 1e-4 p)
                    want = -expected[group][i] * (g[name] + 1e-4 * p[name])
                    np.testing.assert_allclose(got[name], want, rtol=1e-14,
                                               err_msg=f"batch {batch}, epoch {epoch}, step {step}, {name}")


def test_the_fixup_schedule_has_its_own_warm_up_and_refuses_a_second():
    from resjax.train import make_schedule

    config = image_train_config(**fixup_recipe(256))
    rate = make_schedule(config, 5)
    assert [round(float(rate(s)), 6) for s in (0, 4, 5, 45, 50, 499, 500)] == [0.1, 0.1, 0.11, 0.19, 0.2, 0.2, 0.02]
    with pytest.raises(ValueError, match="warmup_epochs"):
        make_schedule({**fixup_recipe(256), "warmup_epochs": 1.0}, 5)
