"""Image training from a host loader: schedules, the optimiser, fit, seeds, divergence, resume, sharding."""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resjax.train import checkpoint as ckpt_lib
from resjax.train import (
    distributed,
    image_train_config,
    make_image_train,
    make_optimizer,
    make_schedule,
    run_config,
)
from tests.conftest import subprocess_xla_flags


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


class FakeImages:
    """The loader interface of ``resjax.data.tfds`` on a tiny in-memory set: four noisy prototypes."""

    def __init__(self, num_examples=64, image_shape=(8, 8, 3), num_classes=4, seed=0):
        rng = np.random.default_rng(seed)
        proto_rng = np.random.default_rng(123)  # a colour per class, which survives pooling and flips
        protos = (proto_rng.normal(size=(num_classes, 1, 1, image_shape[-1]))
                  + 0.5 * proto_rng.normal(size=(num_classes, *image_shape))).astype(np.float32)
        self.labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
        self.images = (protos[self.labels] + 0.7 * rng.normal(size=(num_examples, *image_shape))).astype(np.float32)
        self.num_examples, self.num_classes, self.image_shape = num_examples, num_classes, image_shape

    def num_batches(self, batch_size, drop_remainder=True):
        return self.num_examples // batch_size if drop_remainder else -(-self.num_examples // batch_size)

    def epoch(self, epoch, batch_size, *, seed=0, shuffle=True, augment=False, drop_remainder=True):
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(self.num_examples) if shuffle else np.arange(self.num_examples)
        flips = rng.random(self.num_examples) < 0.5
        for i in range(self.num_batches(batch_size, drop_remainder)):
            idx = order[i * batch_size:(i + 1) * batch_size]
            x = self.images[idx]
            if augment:
                x = np.where(flips[idx, None, None, None], x[:, :, ::-1], x)
            yield x, self.labels[idx]

    def stacked_epoch(self, epoch, batch_size, seeds, **kw):
        for batch in zip(*(self.epoch(epoch, batch_size, seed=s, **kw) for s in seeds)):
            yield np.stack([b[0] for b in batch]), np.stack([b[1] for b in batch])


class TinyCNN(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x).mean((1, 2))
        return nn.Dense(self.num_classes)(x)


class ScalarNet(nn.Module):
    """BN-free, with Fixup-style scalar parameters."""

    num_classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool):
        bias1a = self.param("bias1a", nn.initializers.zeros, ())
        tau = self.param("tau", nn.initializers.ones, ())
        h = tau * nn.relu(nn.Conv(8, (3, 3))(x + bias1a))
        return nn.Dense(self.num_classes)(h.mean((1, 2)))


TRAIN, TEST = FakeImages(64, seed=0), FakeImages(32, seed=1)


def tiny_config(**kw):
    """A training config (``config.train``) of tiny runs."""
    c = image_train_config()
    c.batch_size, c.eval_batch_size, c.epochs = 16, 16, 3
    c.schedule, c.milestones = "step", (2,)
    c.checkpoint_every = 2
    for k, v in kw.items():
        c[k] = v
    return c


def trainer_for(train, model, source=None, test=None, **kw):
    """``make_image_train`` on the run config holding ``train``, with ``model`` passed as a module."""
    return make_image_train(run_config(train=train), TRAIN if source is None else source, test, model=model, **kw)


def leaves_equal(a, b):
    """Bitwise equality of two pytrees (typed keys by their data; NaN equals NaN)."""
    def host(t):
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                for x in jax.tree_util.tree_leaves(t)]
    xs, ys = host(a), host(b)
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f") for x, y in zip(xs, ys))


# ---- schedules and the optimiser ---------------------------------------------------------------------

def test_schedules_values_and_warmup():
    c = tiny_config(learning_rate=0.1, schedule="step", milestones=(2, 3), decay_factor=0.1, warmup_epochs=0.0)
    s = make_schedule(c, 10)
    np.testing.assert_allclose([s(0), s(19), s(20), s(29), s(30)], [0.1, 0.1, 0.01, 0.01, 0.001], rtol=1e-6)
    c.warmup_epochs = 0.5  # 5 steps: (step + 1) / 5
    s = make_schedule(c, 10)
    np.testing.assert_allclose([s(0), s(2), s(4), s(5), s(20)], [0.02, 0.06, 0.1, 0.1, 0.01], rtol=1e-6)
    c = tiny_config(learning_rate=0.2, schedule="cosine", epochs=4, warmup_epochs=1.0)
    s = make_schedule(c, 10)
    np.testing.assert_allclose([s(0), s(9), s(10), s(25), s(40)], [0.02, 0.2, 0.2, 0.1, 0.0], rtol=1e-6, atol=1e-7)
    c = tiny_config(learning_rate=0.3, schedule="constant", warmup_epochs=0.0)
    assert float(make_schedule(c, 7)(1000)) == pytest.approx(0.3)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_steps_match_a_hand_computation(nesterov):
    c = tiny_config(learning_rate=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01, weight_decay_on="all",
                    scalar_lr_factor=0.1, schedule="constant")
    rng = np.random.default_rng(0)
    p = {"dense": {"kernel": rng.normal(size=(2, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)},
         "tau": np.float32(0.7)}
    g1, g2 = (jax.tree_util.tree_map(lambda x: rng.normal(size=np.shape(x)).astype(np.float32), p) for _ in range(2))
    tx = make_optimizer(c, p, 4)
    state = tx.init(p)
    u1, state = tx.update(g1, state, p)
    p1 = optax.apply_updates(p, u1)
    u2, state = tx.update(g2, state, p1)
    p2 = optax.apply_updates(p1, u2)

    def hand(w0, a, b, factor):  # torch.optim.SGD with weight_decay, momentum (no dampening), nesterov
        d1 = a + 0.01 * w0
        buf1 = d1
        w1 = w0 - 0.1 * factor * (d1 + 0.9 * buf1 if nesterov else buf1)
        d2 = b + 0.01 * w1
        buf2 = 0.9 * buf1 + d2
        return w1, w1 - 0.1 * factor * (d2 + 0.9 * buf2 if nesterov else buf2)

    for path in (("dense", "kernel"), ("dense", "bias"), ("tau",)):
        def get(t, path=path):
            return t[path[0]][path[1]] if len(path) == 2 else t[path[0]]

        w1, w2 = hand(get(p), get(g1), get(g2), 0.1 if path == ("tau",) else 1.0)
        np.testing.assert_allclose(get(p1), w1, rtol=1e-6)
        np.testing.assert_allclose(get(p2), w2, rtol=1e-6)
    # 'kernels': the bias and the scalar see no decay.
    c.weight_decay_on, c.momentum, c.nesterov = "kernels", 0.0, False
    tx = make_optimizer(c, p, 4)
    u, _ = tx.update(g1, tx.init(p), p)
    np.testing.assert_allclose(u["dense"]["bias"], -0.1 * g1["dense"]["bias"], rtol=1e-6)
    np.testing.assert_allclose(u["tau"], -0.01 * g1["tau"], rtol=1e-6)
    np.testing.assert_allclose(u["dense"]["kernel"], -0.1 * (g1["dense"]["kernel"] + 0.01 * p["dense"]["kernel"]), rtol=1e-6)


def test_gradient_clipping_and_adam():
    p = {"w": np.ones(4, np.float32)}
    g = {"w": np.full(4, 10.0, np.float32)}  # global norm 20
    c = tiny_config(learning_rate=1.0, momentum=0.0, weight_decay=0.0, grad_clip_norm=2.0, schedule="constant")
    u, _ = make_optimizer(c, p, 1).update(g, make_optimizer(c, p, 1).init(p), p)
    np.testing.assert_allclose(u["w"], -np.full(4, 1.0), rtol=1e-6)
    c = tiny_config(optimizer="adam", learning_rate=0.01, weight_decay=0.0, schedule="constant")
    tx = make_optimizer(c, p, 1)
    u, _ = tx.update(g, tx.init(p), p)
    np.testing.assert_allclose(u["w"], -0.01 * np.ones(4), rtol=1e-4)  # Adam's first step: lr * sign(g)


# ---- fitting -----------------------------------------------------------------------------------------

def test_fit_lowers_the_loss_and_updates_batch_stats():
    c = tiny_config(epochs=6, learning_rate=0.1, schedule="constant", augment=True)
    trainer = trainer_for(c, TinyCNN(), TRAIN, TEST)
    init = trainer.init(0)
    seen = []
    state, h = trainer.fit(0, progress=lambda done, m: seen.append((done, float(m["train_loss"]))))
    assert [d for d, _ in seen] == list(range(1, 7)) and seen[0][1] == pytest.approx(h["train_loss"][0])
    assert h["train_loss"].shape == (6,) and h["epochs"] == 6 and int(h["diverged_epoch"]) == -1
    assert h["train_loss"][-1] < 0.7 * h["train_loss"][0]
    assert h["test_error"][-1] < 0.5 and h["best_test_error"] == h["test_error"].min()
    assert h["final_test_error"] == h["test_error"][-1]
    assert np.isnan(h["train_error"]).all() and ((0 <= h["batch_error"]) & (h["batch_error"] <= 1)).all()
    np.testing.assert_allclose(h["lr"], 0.1)
    assert int(state.state.step) == 6 * 4
    assert not np.allclose(state.state.batch_stats["BatchNorm_0"]["mean"], init.state.batch_stats["BatchNorm_0"]["mean"])
    ev = trainer.evaluate(state, TEST, batch_size=24)  # 32 examples: a padded, masked last batch
    np.testing.assert_allclose(ev["error"], h["test_error"][-1], rtol=1e-6)
    np.testing.assert_allclose(ev["loss"], h["test_loss"][-1], rtol=1e-5)


def test_synthetic_image_dataset_if_available():
    data = pytest.importorskip("resjax.data")
    if not hasattr(data, "synthetic_image_dataset"):
        pytest.skip("resjax.data.synthetic_image_dataset is not there yet")
    source = data.synthetic_image_dataset(name="cifar10", num_examples=128, seed=0)
    c = tiny_config(epochs=2, batch_size=32, eval_batch_size=64, learning_rate=0.05, schedule="constant")
    trainer = trainer_for(c, TinyCNN(num_classes=source.num_classes), source, source)
    _, h = trainer.fit(0)
    assert np.isfinite(h["train_loss"]).all() and h["train_loss"].shape == (2,)


@pytest.fixture(scope="module")
def seed_4_alone():
    """``(run, history)``: seed 4 trained alone on ScalarNet (the seed axis setting does not apply to one seed: one
    run for the three settings of test_seeds_in_one_step_match_each_seed_alone)."""
    c = tiny_config(epochs=2, weight_decay_on="all", scalar_lr_factor=0.1)
    return trainer_for(c, ScalarNet(), TRAIN, TEST).fit(4)


@pytest.mark.parametrize("seed_axis", ["vmap", "unroll", "loop"])
def test_seeds_in_one_step_match_each_seed_alone(seed_axis, seed_4_alone):
    c = tiny_config(epochs=2, weight_decay_on="all", scalar_lr_factor=0.1, seed_axis=seed_axis)
    trainer = trainer_for(c, ScalarNet(), TRAIN, TEST)
    together, ht = trainer.fit([3, 4])
    alone, ha = seed_4_alone
    assert ht["train_loss"].shape == (2, 2)
    for name in ("train_loss", "batch_error", "test_loss", "test_error", "lr"):
        np.testing.assert_allclose(ht[name][1], ha[name], rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(together.state.params), jax.tree_util.tree_leaves(alone.state.params)):
        np.testing.assert_allclose(a[1], b, rtol=1e-4, atol=1e-6)
    assert not np.allclose(ht["train_loss"][0], ht["train_loss"][1])  # the seeds differ (init and data order)


# Broken on purpose: ImageTrainer._fit passing no divergence to its progress: the progress line of epoch 1 shows the
# diverged runs' infinite loss and never says "diverged"; this test fails.
def test_divergence_is_recorded_not_raised_and_stops_early(capsys):
    c = tiny_config(epochs=3, learning_rate=1e30, schedule="constant", momentum=0.0)
    trainer = trainer_for(c, ScalarNet(), TRAIN, TEST)
    state, h = trainer.fit([0, 1], progress="host")
    assert capsys.readouterr().out == "[host] diverged in epoch 1 (seeds 0, 1; every run has diverged)\n"  # once
    assert h["diverged_epoch"].tolist() == [1, 1]
    assert h["epochs"] == 1  # every seed diverged: no second epoch
    assert np.isnan(h["train_loss"]).all() and np.isnan(h["final_test_error"]).all()
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state.state.params))  # frozen, not NaN
    assert (h["diverged_step"] >= 1).all()


def test_resume_from_a_checkpoint_is_bit_identical(tmp_path):
    c = tiny_config(epochs=4, checkpoint_every=2, milestones=(3,), augment=True, scalar_lr_factor=0.1)
    trainer = trainer_for(c, TinyCNN(), TRAIN, TEST)
    full, hf = trainer.fit([0, 1])
    d = tmp_path / "ckpt"
    trainer.fit([0, 1], epochs=2, checkpoint_dir=d)
    step = ckpt_lib.latest(d)  # checkpoint steps count training steps: 4 minibatches per epoch here
    assert step == 2 * 4 and {"meta", "state"} <= set(os.listdir(d / str(step)))
    # a new trainer (as in a new process) finds the checkpoint and goes on from epoch 2
    resumed, hr = trainer_for(c, TinyCNN(), TRAIN, TEST).fit([0, 1], checkpoint_dir=d)
    assert ckpt_lib.latest(d) == 4 * 4
    assert leaves_equal(full, resumed)  # parameters, batch_stats, optimiser state, step, key, history
    for name in ("train_loss", "test_error", "lr"):
        np.testing.assert_array_equal(hf[name], hr[name])
    with ckpt_lib.Checkpoints(d) as ck:
        assert ck.meta()["epoch"] == 4 and ck.meta()["config"]["train"]["batch_size"] == 16
    with pytest.raises(ValueError, match="checkpoint_dir"):  # other seeds than the checkpoint's
        trainer_for(c, TinyCNN(), TRAIN, TEST).fit([0, 2], checkpoint_dir=d)


def test_resume_refuses_a_checkpoint_made_with_other_settings(tmp_path):
    c = tiny_config(epochs=2, checkpoint_every=1)
    trainer_for(c, TinyCNN(), TRAIN, TEST).fit(0, epochs=1, checkpoint_dir=tmp_path)
    longer = tiny_config(epochs=3, checkpoint_every=1)
    with pytest.raises(ValueError, match=r"checkpoint_dir: .*other settings \(train.epochs\)"):
        trainer_for(longer, TinyCNN(), TRAIN, TEST).fit(0, checkpoint_dir=tmp_path)
    # checkpoint cadence is free to change: the same run resumes
    c.checkpoint_every = 2
    _, h = trainer_for(c, TinyCNN(), TRAIN, TEST).fit(0, checkpoint_dir=tmp_path)
    assert h["epochs"] == 2


def test_checkpoint_round_trip_of_a_bn_free_state(tmp_path):
    trainer = trainer_for(tiny_config(), ScalarNet(), TRAIN)
    state = trainer.init(7)
    assert state.state.batch_stats == {}
    ckpt_lib.save(tmp_path, 0, state)
    back = ckpt_lib.restore(tmp_path, state)
    assert leaves_equal(back, state) and back.state.batch_stats == {}
    assert jax.dtypes.issubdtype(back.key.dtype, jax.dtypes.prng_key)


# ---- data parallelism and multi-host -----------------------------------------------------------------

SHARDED = textwrap.dedent("""
    import jax, numpy as np, pytest
    from tests.test_image_train import TRAIN, TEST, TinyCNN, tiny_config, trainer_for
    from resjax.train import make_data_mesh
    from tests.test_image_train import trainer_for
    assert jax.device_count() == 4, jax.devices()
    mesh = make_data_mesh()
    c = tiny_config(epochs=1)  # 4 steps and an evaluation
    for seeds in (0, [0, 1]):
        with jax.default_matmul_precision("highest"):
            s4, h4 = trainer_for(c, TinyCNN(), TRAIN, TEST, mesh=mesh).fit(seeds)
            s1, h1 = trainer_for(c, TinyCNN(), TRAIN, TEST).fit(seeds)
        leaf = jax.tree_util.tree_leaves(s4.state.params)[0]
        assert len(leaf.sharding.device_set) == 4 and leaf.sharding.is_fully_replicated, leaf.sharding
        for a, b in zip(jax.tree_util.tree_leaves((s4.state.params, s4.state.batch_stats)),
                        jax.tree_util.tree_leaves((s1.state.params, s1.state.batch_stats))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        for name in ("train_loss", "test_loss", "test_error"):
            np.testing.assert_allclose(h4[name], h1[name], rtol=1e-5, atol=1e-6)
    # A loop of one's own under shard_map: BatchNorm normalises by each device's examples unless given the axis
    import functools
    from jax.sharding import PartitionSpec as P
    from resjax.nn import BatchNorm, build_model
    x = jax.numpy.asarray(TRAIN.images[:16])

    def train_mode(norm, mapped):  # one training-mode call: the logits and the new running estimates
        model = build_model(dict(kind="resnet", stage_sizes=(1,), stage_widths=(4,), stem_width=4, num_classes=4,
                                 norm=norm))
        v = model.init(jax.random.key(0), x[:1], train=False)
        apply = lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])
        call = apply
        if mapped:
            call = jax.shard_map(lambda v, x: (lambda out, new: (out, jax.lax.pmean(new, "data")))(*apply(v, x)),
                                 mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()), check_vma=False)
        return jax.tree_util.tree_leaves(jax.jit(call)(v, x))

    one = train_mode("batch", False)
    own = train_mode("batch", True)
    named = train_mode(functools.partial(BatchNorm, axis_name="data"), True)
    for a, b in zip(named, one):  # the axis named: the global batch's statistics
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(own, one)) > 1e-3  # each device's
    with pytest.raises(ValueError, match="batch_size"):
        trainer_for(tiny_config(batch_size=6), TinyCNN(), TRAIN, TEST, mesh=mesh)
    with pytest.raises(ValueError, match="eval_batch_size"):
        trainer_for(tiny_config(eval_batch_size=10), TinyCNN(), TRAIN, TEST, mesh=mesh)
    print("SHARDED OK")
""")


def test_batch_sharded_over_4_devices_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags(4), "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", SHARDED], check=False, env=env, cwd=root, capture_output=True, text=True)
    assert out.returncode == 0 and "SHARDED OK" in out.stdout, out.stderr[-3000:]


def test_initialize_if_needed_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    for name in ("RESJAX_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "RESJAX_HEARTBEAT_TIMEOUT", "RESJAX_INIT_TIMEOUT", "RESJAX_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize_if_needed() is False and calls == []
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert distributed.initialize_if_needed() is True
    timeouts = {"heartbeat_timeout_seconds": 100, "initialization_timeout": 300, "shutdown_timeout_seconds": 300}
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1, **timeouts}]
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("RESJAX_DISTRIBUTED", "1")
    monkeypatch.setenv("RESJAX_HEARTBEAT_TIMEOUT", "7")
    assert distributed.initialize_if_needed() is True
    assert calls[-1] == {**timeouts, "heartbeat_timeout_seconds": 7}
    monkeypatch.setenv("RESJAX_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RESJAX_HEARTBEAT_TIMEOUT"):
        distributed.initialize_if_needed()


# ---- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, value", [
    ("schedule", "linear"), ("warmup_epochs", -1.0), ("milestones", (-1,)), ("milestones", (3, 2)),
    ("decay_factor", -0.1), ("optimizer", "rmsprops"), ("weight_decay_on", "biases"), ("scalar_lr_factor", -1.0),
    ("momentum", 1.0), ("batch_size", 0), ("batch_size", 1000), ("eval_batch_size", 0), ("checkpoint_every", -1),
    ("learning_rate", -0.1), ("epochs", 0), ("weight_decay", -1.0), ("grad_clip_norm", -1.0), ("seed", -3),
    ("seed_axis", "pmap"),
])
def test_bad_settings_name_the_setting(setting, value):
    c = tiny_config()
    c[setting] = value
    with pytest.raises(ValueError, match=setting):
        trainer_for(c, TinyCNN(), TRAIN, TEST)


def test_bad_call_arguments_name_the_argument():
    trainer = trainer_for(tiny_config(), TinyCNN(), TRAIN, TEST)
    for epochs in (0, 1.5, True):  # (more than config.train.epochs extends the run: tests/test_grid.py)
        with pytest.raises(ValueError, match="epochs"):
            trainer.fit(0, epochs=epochs)
    with pytest.raises(ValueError, match="num_seeds"):
        trainer.init(0, num_seeds=0)
    with pytest.raises(ValueError, match="mesh"):
        trainer_for(tiny_config(), TinyCNN(), TRAIN, TEST, mesh=jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",)))
    with pytest.raises(ValueError, match="batch_size"):
        trainer.evaluate(trainer.init(0), TEST, batch_size=0)
    with pytest.raises(ValueError, match="weight_decay_on"):
        make_optimizer(tiny_config(weight_decay_on="kernels"), {"tau": jnp.float32(1.0)}, 1)
