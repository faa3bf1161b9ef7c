"""``resjax.train.ModelState`` (named ``TrainState`` until #33, which is Flax's name for another class): the old
name still imports, with a ``DeprecationWarning`` naming the new one, and checkpoints written with the old
class restore into the new one (Orbax stores a pytree by its keys, the field names, not by class names).

``tests/data/state_before_rename`` is a ``Checkpoints`` step written at commit 765ce82 (before the rename) by
``Checkpoints(dir, keep=None).save(7, example_run(TrainState), meta=...)``, with ``TrainState`` that commit's
``resjax.train.state.TrainState``."""

import importlib
import shutil
import warnings
from pathlib import Path

import flax.training.train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import resjax.train
import resjax.train.state
from resjax.train import ModelState, RunState
from resjax.train.checkpoint import Checkpoints

OLD = Path(__file__).parent / "data" / "state_before_rename"


def example_run(cls) -> RunState:
    """A small run state of a model with BatchNorm statistics and SGD with momentum after one step, every
    value distinct (what the fixture holds)."""
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3) / 7, "bias": jnp.arange(3.0) - 1}}
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(p + 1), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    state = cls(step=jnp.int32(1), params=optax.apply_updates(params, updates),
                batch_stats={"norm": {"mean": jnp.arange(3.0) / 3, "var": jnp.arange(3.0) + 0.5}},
                opt_state=opt_state)
    return RunState(state=state, key=jax.random.key(5), data_seed=jnp.int32(11), epoch=jnp.int32(1),
                    diverged_epoch=jnp.int32(-1),
                    history={"train_loss": jnp.array([0.75, jnp.nan]), "lr": jnp.array([0.1, jnp.nan])})


def _same(a, b):
    def data(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(data(x)), np.asarray(data(y)))


def test_the_state_class_does_not_share_flax_s_name():
    assert ModelState.__name__ == "ModelState"
    assert ModelState is not flax.training.train_state.TrainState
    assert "TrainState" not in resjax.train.__all__ and "ModelState" in resjax.train.__all__
    assert "TrainState" not in resjax.train.state.__all__


@pytest.mark.parametrize("module", ["resjax.train", "resjax.train.state"])
def test_the_old_name_imports_with_a_deprecation_warning_naming_the_new_one(module):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=r"TrainState.*ModelState"):
        old = mod.TrainState
    assert old is ModelState
    with pytest.warns(DeprecationWarning, match="ModelState"):
        exec(f"from {module} import TrainState", {})
    with pytest.raises(AttributeError, match="NoSuchName"):
        mod.NoSuchName  # noqa: B018  (other names are still an AttributeError)


def test_the_new_name_imports_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from resjax.train import ModelState, RunState\nfrom resjax.train.state import ModelState", {})


def test_a_checkpoint_written_with_the_old_class_restores_into_the_new_one(tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(OLD, folder)
    template = example_run(ModelState)
    with Checkpoints(folder) as ckpt:
        assert ckpt.meta(7)["written_by"].startswith("resjax 765ce82")
        restored = ckpt.restore(jax.tree.map(jnp.zeros_like, template))  # verified against its SHA-256s
    assert isinstance(restored.state, ModelState)
    _same(restored, template)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(template)
