"""The one training core: checkpointed on-device sweeps resume bit-identically, measurement hooks, build_model."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.data import load_dataset
from resjax.nn import build_model
from resjax.train import make_train, run_config, train_config
from resjax.train import checkpoint as ckpt_lib
from resjax.train.preemption import Preempted
from tests.test_image_train import leaves_equal
from tests.test_training import DATA, tiny_config


def test_a_preempted_mnist1d_sweep_of_3_seeds_resumes_bit_identically(tmp_path):
    """The sweeps on one device: the three seeds in one program, every chunk the same program (on several devices 3
    seeds are padded to 4)."""
    data = load_dataset("mnist1d")
    config = run_config(dict(kind="residual_mlp", width=16, num_blocks=3, norm="batch", order="pre"),
                        train_config(batch_size=500, epochs=4, momentum=0.9, checkpoint_every=2), "mnist1d")
    keys = jax.random.split(jax.random.key(0), 3)
    one = jax.devices()[:1]
    full, mf = make_train(config, data).sweep(keys, chunk_epochs=1, devices=one)

    def sigterm_after_one(done, summary):
        assert summary["train_loss"].shape == (3,)
        if done == 1:  # as a scheduler preempting the job would; epoch 1 is not a checkpoint_every epoch
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        make_train(config, data).sweep(keys, chunk_epochs=1, checkpoint_dir=tmp_path, callback=sigterm_after_one,
                                       devices=one)
    assert stopped.value.code == 128 + signal.SIGTERM and "python" in str(stopped.value)  # prints the command
    assert signal.getsignal(signal.SIGTERM) is handler  # the handler is restored
    assert ckpt_lib.latest(tmp_path) == 1 * 8  # checkpoint steps count training steps: 8 an epoch
    resumed, mr = make_train(config, data).sweep(keys, chunk_epochs=1, checkpoint_dir=tmp_path,
                                                 devices=one)  # a new trainer, as a new process would
    assert ckpt_lib.latest(tmp_path) == 4 * 8
    assert leaves_equal(full, resumed)  # parameters, batch_stats, optimiser state, step, key, history
    for name in ("train_loss", "train_error", "test_error", "diverged_epoch"):
        np.testing.assert_array_equal(mf[name], mr[name])
    # a checkpoint of other seeds, or of other settings, is refused
    with pytest.raises(ValueError, match="checkpoint_dir: .*other seeds"):
        make_train(config, data).sweep(jax.random.split(jax.random.key(1), 3), checkpoint_dir=tmp_path, devices=one)
    config.train.learning_rate = 0.01
    with pytest.raises(ValueError, match=r"checkpoint_dir: .*other settings \(train.learning_rate\)"):
        make_train(config, data).sweep(keys, checkpoint_dir=tmp_path, devices=one)


# Broken on purpose: the initial runs placed as the initialiser's program chose (Trainer._init_fn without
# out_shardings): the chunked run compiles one program more than the run in one chunk (5 against 4), and this test
# fails.
def test_seeds_sharded_over_the_devices_run_every_chunk_in_the_first_chunks_compiled_program():
    """2 seeds over 2 devices, 3 epochs in chunks of 1: the initial runs are placed as a chunk places its output,
    so the first chunk's program is every chunk's (one compilation, not two); the run ends bit-identical to the
    run in one chunk."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (conftest: one per CPU core)")
    keys = jax.random.split(jax.random.key(0), 2)
    compiles = []  # XLA compilations, and programs read from the run's compilation cache instead

    def counted(event, *args, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
            compiles.append(event)

    make_train(tiny_config(), DATA).sweep(keys, chunk_epochs=3)  # what any sweep compiles once (its small programs)
    jax.monitoring.register_event_duration_secs_listener(counted)
    jax.monitoring.register_event_listener(counted)
    try:
        whole, mw = make_train(tiny_config(), DATA).sweep(keys, chunk_epochs=3)  # a new trainer: its own programs
        in_one = len(compiles)
        chunked, mc = make_train(tiny_config(), DATA).sweep(keys, chunk_epochs=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(counted)
        jax.monitoring.unregister_event_listener(counted)
    assert in_one >= 2 and len(compiles) - in_one == in_one  # the chunked run's programs: the whole run's, no more
    assert leaves_equal(chunked, whole)
    np.testing.assert_array_equal(mc["train_loss"], mw["train_loss"])


def test_hooks_record_from_inside_the_compiled_run():
    """4 epochs in two chunks of 2 on one device: the records of two calls of one chunk program (with hooks each
    chunk length is a program of its own), put together, and those of the whole run as one program."""
    c = tiny_config(kind="plain_mlp", width=8, depth=2)
    c.train.epochs = 4
    steps = len(DATA.y_train) // c.train.batch_size

    def step_hook(before, after, hparams):
        return {"step": after.state.step, "moved": jnp.linalg.norm(after.state.params["head"]["kernel"]
                                                                   - before.state.params["head"]["kernel"]),
                "lr": hparams["learning_rate"]}

    def epoch_hook(run, hparams):
        return {"epoch": run.epoch, "head": run.state.params["head"]["kernel"]}

    trainer = make_train(c, DATA, step_hook=step_hook, epoch_hook=epoch_hook)
    keys = jax.random.split(jax.random.key(0), 2)
    lrs = np.array([0.05, 0.0], np.float32)
    run, m = trainer.sweep(keys, {"learning_rate": lrs}, chunk_epochs=2, devices=jax.devices()[:1])
    s, e = m["step_records"], m["epoch_records"]
    assert s["step"].shape == (2, 4, steps) and e["head"].shape == (2, 4, 8, 3)
    np.testing.assert_array_equal(s["step"][0].reshape(-1), np.arange(1, 4 * steps + 1))
    np.testing.assert_array_equal(e["epoch"], [[1, 2, 3, 4]] * 2)
    np.testing.assert_array_equal(s["lr"][:, 0, 0], lrs)
    assert (s["moved"][0] > 0).all() and (s["moved"][1] == 0).all()  # learning rate 0 does not move
    np.testing.assert_array_equal(e["head"][:, -1], run.state.params["head"]["kernel"])
    # the same records from the whole run as one program
    _, one = jax.jit(jax.vmap(trainer))(keys, {"learning_rate": jnp.asarray(lrs), "weight_decay": jnp.zeros(2)})
    np.testing.assert_allclose(one["step_records"]["moved"], s["moved"], rtol=1e-5)


def test_the_metric_vocabulary_is_the_same_for_both_feeders():
    from resjax.train.core import METRICS
    from tests.test_image_train import TRAIN, TinyCNN, tiny_config as image_config, trainer_for

    _, on_device = make_train(tiny_config(), DATA).sweep(jax.random.split(jax.random.key(0), 1),
                                                         devices=jax.devices()[:1])  # (no padding run)
    _, host = trainer_for(image_config(epochs=1), TinyCNN()).fit(0)
    assert set(METRICS) <= set(on_device) and set(METRICS) <= set(host)
    assert set(on_device) == set(host)
    assert np.isfinite(on_device["train_error"]).all() and np.isnan(host["train_error"]).all()


@pytest.mark.parametrize("config, shape, classes", [
    (dict(kind="plain_mlp", width=8, depth=2), (4, 10), 3),
    (dict(kind="tau_resnet", variant="tau", width=8, depth=3), (4, 10), 3),
    (dict(kind="cifar_resnet", depth=8), (2, 8, 8, 3), 10),
    (dict(kind="taki_resnet", num_blocks=2, scan=False), (2, 8, 8, 3), 10),
    (dict(kind="densenet_bc_cifar", depth=10, growth_rate=4), (2, 8, 8, 3), 10),
])
def test_build_model_builds_every_family_by_name(config, shape, classes, fast_compiles):
    model = build_model(config, num_classes=classes)
    # init and apply jitted: one program each (eagerly, every op with new shapes compiles a program of its own)
    v = jax.jit(lambda k, x: model.init(k, x, train=False))(jax.random.key(0), jnp.zeros(shape))
    assert jax.jit(lambda v, x: model.apply(v, x, train=False))(v, jnp.zeros(shape)).shape == (shape[0], classes)


def test_build_model_builds_the_dense_prediction_families(fast_compiles):
    x = jnp.zeros((1, 8, 8, 1))

    def run(model):  # init, then apply: one program each (see test_build_model_builds_every_family_by_name)
        v = jax.jit(lambda k, x: model.init(k, x, train=False))(jax.random.key(0), x)
        return jax.jit(lambda v, x: model.apply(v, x, train=False))(v, x)

    unet = build_model({"kind": "unet", "features": (4, 8), "out_channels": 2}, num_classes=10)  # not a classifier
    assert run(unet).shape == (1, 8, 8, 2)
    hg = build_model("hourglass", num_stacks=2, depth=1, features=4, num_heatmaps=3)
    assert [o.shape for o in run(hg)] == [(1, 8, 8, 3)] * 2


def test_build_model_names_bad_settings():
    with pytest.raises(ValueError, match="model.kind"):
        build_model({"kind": "resnet9000"})
    with pytest.raises(ValueError, match="model.variant"):
        build_model({"kind": "tau_resnet", "width": 8, "depth": 2})
    with pytest.raises(ValueError, match="model"):
        build_model({"kind": "cifar_resnet", "depht": 20})
    with pytest.raises(ValueError, match="train.epoch"):
        train_config(epoch=3)
