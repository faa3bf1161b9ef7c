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
from resjax.train.optim import PARAM_GROUP_PRESETS, fixup_param_groups, group_factors, make_optimizer

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
    parameter) at base rate 0.1; tau-ResNet's scalars at lr/10; Fixup's rate times batch/128 with its bias and
    scale parameters at 0.1 unscaled (``fixup_param_groups``)."""
    if name == "fixup":
        return image_train_config(learning_rate=0.1 * batch / 128, param_groups=fixup_param_groups(batch))
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
    run = core.init_run(jax.random.key(0))
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
