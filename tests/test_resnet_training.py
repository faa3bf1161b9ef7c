"""One training step of every ResNet block type and scaling option on mocked CIFAR-10.

The data: 8 examples of ``tfds.testing.mock_data``'s CIFAR-10 read through ``load_image_dataset``
(``tests/tfds_mock.py``), one batch of 8, so ``fit(epochs=1)`` is exactly one SGD step (momentum 0.9, whose
first step is plain SGD; no weight decay, so a parameter moves only where its gradient is non-zero;
``scalar_lr_factor=0.1``). Each model is tiny (two stages of one block), and each is compiled once; the
models cover every value of every option (``test_the_models_cover_every_option``), not their product.
Nothing is timed; XLA's optimisation passes are off while this module compiles (``fast_compiles``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resjax.nn.resnet import ResNet, taki_resnet
from resjax.train import image_train_config, make_image_train, run_config
from tests.tfds_mock import mocked_examples

BATCH = 8
LR = 0.1
SCALAR_LR_FACTOR = 0.1

FIELDS = ("kind", "order", "shortcut", "scaling", "norm")
# every value of every field appears at least once (tau both fixed, the rule 1/sqrt(K), and learnable)
MODELS = {"-".join(row[:5]) + ("-learnable" if row[5:] else ""): {**dict(zip(FIELDS, row[:5])), **dict(*row[5:])}
          for row in [
              ("basic", "post", "A", "none", "batch"),  # He et al.'s CIFAR ResNet
              ("basic", "pre", "B", "none", "batch"),  # wide ResNet
              ("bottleneck", "post", "B", "none", "batch"),  # ImageNet ResNet-50
              ("bottleneck", "pre", "A", "rescale", "batch"),
              ("basic", "post", "A", "tau", "batch"),
              ("basic", "pre", "A", "tau", "none", {"learnable_tau": True, "scalar_biases": True}),  # tau-ResNet repo
              ("basic", "post", "B", "rescale", "none"),
              ("basic", "pre", "B", "skipinit", "none"),
              ("basic", "post", "A", "fixup", "none"),
              ("bottleneck", "post", "B", "fixup", "none"),  # Fixup's ImageNet model
          ]}
TAKI = {"taki_init": {"norm": "none", "kernel_init": "taki"}, "he_init": {"norm": "none", "kernel_init": "he_normal"},
        "he_init-batch": {"norm": "batch", "kernel_init": "he_normal"}}


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


@pytest.fixture(scope="module")
def cifar10():
    return mocked_examples("cifar10", "train", BATCH)


def tiny_resnet(kind, **kwargs):
    widths = (16, 32) if kind == "bottleneck" else (8, 16)
    return ResNet(stage_sizes=(1, 1), stage_widths=widths, stem_width=8, kind=kind, **kwargs)


def one_step(model, source):
    """``fit`` for one epoch of one batch: (trainer, initial state on the host, state, history)."""
    c = image_train_config()
    c.batch_size = c.eval_batch_size = BATCH
    c.epochs = 1
    c.schedule = "constant"
    c.learning_rate = LR
    c.weight_decay = 0.0
    c.scalar_lr_factor = SCALAR_LR_FACTOR
    trainer = make_image_train(run_config(train=c), source, model=model)
    before = jax.device_get(trainer.init(0).state)
    state, hist = trainer.fit(0)
    return trainer, before, state, hist


def the_batch(source):
    """The batch ``fit`` trained on: epoch 0 of data seed 0, shuffled and augmented (a pure function)."""
    images, labels = next(source.epoch(0, BATCH, seed=0, shuffle=True, augment=True))
    return jnp.asarray(images), jnp.asarray(labels)


def leaves(tree) -> dict:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def moved(before, after) -> dict:
    """Leaf path -> whether any entry changed."""
    b, a = leaves(before), leaves(after)
    assert b.keys() == a.keys()
    return {k: not np.array_equal(b[k], a[k]) for k in b}


def check_step(before, state, hist, norm):
    """Finite loss, one step, no divergence; BatchNorm's running statistics all moved (or none exist)."""
    assert hist["epochs"] == 1 and int(state.state.step) == 1 and int(hist["diverged_epoch"]) == -1
    assert np.isfinite(hist["train_loss"]).all() and hist["train_loss"][0] > 0
    stats = moved(before.batch_stats, state.state.batch_stats)
    if norm == "batch":
        assert stats and all(stats.values()), stats
    else:
        assert not stats


def test_the_models_cover_every_option():
    seen = {field: {m[field] for m in MODELS.values()} for field in FIELDS}
    assert seen == {"kind": {"basic", "bottleneck"}, "order": {"post", "pre"}, "shortcut": {"A", "B"},
                    "scaling": {"none", "tau", "rescale", "skipinit", "fixup"}, "norm": {"batch", "none"}}
    tau = [m for m in MODELS.values() if m["scaling"] == "tau"]
    assert {m.get("learnable_tau", False) for m in tau} == {False, True}


@pytest.mark.parametrize("name", list(MODELS))
def test_one_step_of_every_block_type_and_scaling(cifar10, name):
    spec = dict(MODELS[name])
    model = tiny_resnet(**spec)
    trainer, before, state, hist = one_step(model, cifar10)
    check_step(before, state, hist, spec["norm"])
    change = moved(before.params, state.state.params)
    scaling = spec["scaling"]

    if scaling == "skipinit":  # alpha = 0 cuts every branch from the loss: only the branch convs stay put
        still = {k for k, m in change.items() if not m}
        assert still == {k for k in change if "/conv_" in k}, still
        assert all(change[k] for k in change if k.endswith("skipinit_alpha"))
    elif scaling == "fixup":
        check_fixup(trainer, model, cifar10, before, state, change)
    else:
        assert all(change.values()), [k for k, m in change.items() if not m]

    if spec.get("learnable_tau"):  # one plain SGD step: w - lr * f * g, f = scalar_lr_factor for 0-d leaves
        images, labels = the_batch(cifar10)

        def loss(params):
            logits, _ = model.apply({"params": params}, images, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        grads = leaves(jax.jit(jax.grad(loss))(before.params))  # one program (op by op: one per op)
        b, a = leaves(before.params), leaves(state.state.params)
        for k, g in grads.items():
            f = SCALAR_LR_FACTOR if g.ndim == 0 else 1.0
            np.testing.assert_allclose(a[k] - b[k], -LR * f * g, rtol=1e-4, atol=1e-7, err_msg=k)
        assert "tau" in grads and grads["tau"] != 0
        np.testing.assert_allclose(a["tau"] - b["tau"], -LR * SCALAR_LR_FACTOR * grads["tau"], rtol=1e-4)


def check_fixup(trainer, model, source, before, state, change):
    """Fixup zero-initialises the head and every block's last conv. Step 1: the zero head passes no
    gradient back, so only the head moves. Step 2: the last convs get a gradient (non-zero input, non-zero
    head) and become non-zero, while what reaches the loss only through a still-zero last conv (the
    first conv, the multiplier) gets none and stays put."""
    assert {k for k, m in change.items() if m} == {"head/kernel", "head/bias"}
    last = "conv_1" if model.kind == "basic" else "conv_2"
    lasts = [k for k in change if f"/{last}/" in k]
    assert len(lasts) == 2
    after1 = leaves(state.state.params)
    assert all(not after1[k].any() for k in lasts)
    state2, (loss2, _) = trainer.step(state, *the_batch(source))
    assert np.isfinite(float(loss2)) and int(state2.state.step) == 2
    after2 = leaves(state2.state.params)
    init = leaves(before.params)
    for k in lasts:
        assert after2[k].any(), k
    for k in after2:
        if "/conv_0/" in k or k.endswith("fixup_scale"):
            np.testing.assert_array_equal(after2[k], init[k], err_msg=k)


@pytest.mark.parametrize("name", list(TAKI))
def test_one_step_of_taki_models(cifar10, name):
    """Unrolled (``scan=False``): without XLA's optimisations a scanned 8x8 conv runs ~100x slower on the
    CPU (10 s for this step); ``test_resnet.py`` checks scan == unrolled, BatchNorm statistics included."""
    spec = TAKI[name]
    _, before, state, hist = one_step(taki_resnet(num_blocks=3, scan=False, **spec), cifar10)
    check_step(before, state, hist, spec["norm"])
    change = moved(before.params, state.state.params)
    assert all(change.values()), [k for k, m in change.items() if not m]
    assert {f"blocks_{i}/conv/kernel" for i in range(3)} <= change.keys()
