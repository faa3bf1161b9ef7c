"""Flax-native modules (issue #33): Flax's tools work on every ``build_model`` kind, ``norm=`` takes Flax's
normalisation classes (with ``train`` as ``use_running_average``), ``param_dtype`` on every model, each model
carries only its branch kind's settings (the old spellings warn), no import circle in ``resjax.nn``, and
checkpoints described before the settings moved are recognised."""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import resjax.nn as rn
from resjax.nn import build_model
from resjax.train.checkpoint import describe_model, same_model_description

#: A small config and input shape for every kind ``build_model`` knows (checked against ``_families``).
KINDS = {
    "plain_mlp": (dict(width=8, depth=2, norm="batch"), (2, 5)),
    "residual_mlp": (dict(width=8, num_blocks=2, norm="batch"), (2, 5)),
    "residual_stack": (dict(width=8, num_blocks=2, scan=True), (2, 8)),
    "tau_resnet": (dict(variant="bn", width=8, depth=3), (2, 5)),
    "resnet": (dict(stage_sizes=(1, 1), stage_widths=(4, 8), stem_width=4, scaling="fixup"), (2, 8, 8, 3)),
    "cifar_resnet": (dict(depth=8, **rn.REPOSITORY_MODELS["tau_resnet_nobn"]), (2, 8, 8, 3)),
    "imagenet_resnet": (dict(depth=18, num_classes=5), (2, 32, 32, 3)),
    "taki_resnet": (dict(num_blocks=2, norm="batch"), (2, 8, 8, 3)),
    "densenet": (dict(block_layers=(1, 1), growth_rate=4, init_features=8, num_classes=3, stem="cifar"),
                 (2, 8, 8, 3)),
    "densenet121": (dict(num_classes=3), (2, 32, 32, 3)),
    "densenet_bc_cifar": (dict(depth=10, growth_rate=4), (2, 8, 8, 3)),
    "unet": (dict(features=(4, 8), out_channels=2), (2, 8, 8, 1)),
    "hourglass": (dict(num_stacks=2, depth=1, features=4, num_heatmaps=3), (2, 8, 8, 1)),
    "resnet1d": (dict(stage_sizes=(1, 1), stage_widths=(4, 8), stem_width=4), (2, 12)),
    "small_resnet1d": (dict(width=4), (2, 12, 2)),
    "logistic": (dict(), (2, 12)),
    "reference_mlp": (dict(width=8), (2, 12)),
    "reference_cnn": (dict(channels=4), (2, 12)),
    "reference_gru": (dict(hidden=3), (2, 12)),
}
#: Kinds whose real init is too slow for the suite: only abstract (``eval_shape``) checks.
LARGE = ("densenet121", "imagenet_resnet")


def _model(kind: str, **fields) -> tuple[nn.Module, jax.Array]:
    config, shape = KINDS[kind]
    return build_model({"kind": kind, **config, **fields}, num_classes=10), jax.random.normal(jax.random.key(1), shape)


def test_every_kind_has_a_config():
    assert set(KINDS) == set(rn._families())


@pytest.mark.parametrize("kind", list(KINDS))
def test_flax_tools_work_on_every_kind(kind):
    model, x = _model(kind)
    abstract = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0), x)
    count = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(abstract["params"]))
    table = model.tabulate(jax.random.key(0), x, train=False, console_kwargs={"width": 400})
    assert type(model).__name__ in table and f"{count:,}" in table  # the total parameter count
    assert nn.tabulate(model, jax.random.key(0), console_kwargs={"width": 400})(x, train=False) == table
    clone = model.clone()
    assert clone == model and clone is not model and describe_model(clone) == describe_model(model)
    if kind in LARGE:
        return

    @jax.jit
    def run(key):  # init, the bound call and apply in one program, not one program per eager op
        variables = model.init(key, x, train=False)
        return variables, model.bind(variables)(x, train=False), model.apply(variables, x, train=False)

    variables, out, expected = run(jax.random.key(0))
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(abstract)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make, setting", [
    (lambda: rn.ResidualMLP(width=8, num_blocks=2, num_layers=0), "num_layers"),
    (lambda: rn.ResidualMLP(width=0, num_blocks=2), "width"),
    (lambda: rn.PlainMLP(width=8, depth=2, norm="bogus"), "norm"),
    (lambda: rn.ResNet(stage_sizes=(1,), stage_widths=(4,), shortcut="C"), "shortcut"),
    (lambda: rn.cifar_resnet(8, tau=-1.0), "tau"),
    (lambda: rn.taki_resnet(2, kernel_init="bogus"), "kernel_init"),
    (lambda: rn.ResNet(stage_sizes=(1,), stage_widths=(4,), param_dtype="bf17"), "param_dtype"),
    (lambda: rn.ResidualMLP(width=8, num_blocks=2, block={"kind": "basic"}), "kind"),
])
def test_settings_are_checked_at_construction(make, setting):
    with pytest.raises(ValueError, match=f"^{setting}:"):
        make()


# ---- norms the Flax way ----

def _conv(norm):
    return rn.ResNet(stage_sizes=(1, 1), stage_widths=(16, 32), stem_width=16, norm=norm)


def _mlp(norm):
    return rn.ResidualMLP(width=16, num_blocks=2, order="post", norm=norm)


#: Each flax class (or partial) and the resjax spelling that must give the same model.
FLAX_NORMS = {
    "BatchNorm": (nn.BatchNorm, functools.partial(rn.BatchNorm, momentum=0.99, epsilon=1e-5)),
    "BatchNorm_partial": (functools.partial(nn.BatchNorm, momentum=0.9), "batch"),
    "LayerNorm": (functools.partial(nn.LayerNorm, epsilon=1e-5), "layer"),
    "GroupNorm": (functools.partial(nn.GroupNorm, epsilon=1e-5), "group"),  # 32 groups refitted to 16 channels
    "RMSNorm": (nn.RMSNorm, None),
}


@pytest.mark.parametrize("make, shape", [(_conv, (4, 8, 8, 3)), (_mlp, (4, 5))], ids=["conv", "mlp"])
@pytest.mark.parametrize("name", list(FLAX_NORMS))
def test_flax_norm_classes(name, make, shape):
    norm, resjax_norm = FLAX_NORMS[name]
    x = jax.random.normal(jax.random.key(1), shape)
    model = make(norm)
    v = model.init(jax.random.key(0), x)  # init needs no train
    y_train, updates = model.apply(v, x, train=True, mutable=["batch_stats"])
    y_eval = model.apply(v, x, train=False)
    assert np.isfinite(y_train).all() and np.isfinite(y_eval).all()
    if rn.is_batch_norm(norm):
        # train=True normalises by the batch and moves the running estimates; train=False uses them
        assert not np.allclose(y_train, y_eval)
        moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), v["batch_stats"],
                                       updates["batch_stats"])
        assert min(jax.tree_util.tree_leaves(moved)) > 0
        with pytest.raises(ValueError, match="^train:"):
            model.apply(v, x)
    else:
        assert "batch_stats" not in v and not updates
        np.testing.assert_array_equal(y_train, y_eval)
    if resjax_norm is None:  # RMSNorm: per example, so one example's output ignores the others
        np.testing.assert_allclose(model.apply(v, x[:1], train=False), y_eval[:1], rtol=1e-5, atol=1e-6)
        return
    twin = make(resjax_norm)
    w = twin.init(jax.random.key(0), x)
    assert jax.tree_util.tree_structure(w) == jax.tree_util.tree_structure(v)
    twin_train, twin_updates = twin.apply(w, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(y_train, twin_train, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y_eval, twin.apply(w, x, train=False), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(twin_updates)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_group_norm_default_groups_fit_the_channels():
    assert [rn.default_groups(c) for c in (16, 48, 64, 7, 1)] == [16, 24, 32, 7, 1]
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    model = rn.cifar_resnet(8, norm="group")  # 16, 32, 64 channels: 16, 32, 32 groups
    v = model.init(jax.random.key(0), x)
    assert np.isfinite(model.apply(v, x, train=False)).all()
    # 16 groups of one channel on 16 channels: each channel normalised over its positions alone
    h = jax.random.normal(jax.random.key(2), (2, 4, 4, 16)) * 3 + 1

    class One(nn.Module):
        @nn.compact
        def __call__(self, h):
            return rn.make_norm("group", train=None, name="norm")(h)

    y, _ = One().init_with_output(jax.random.key(0), h)
    np.testing.assert_allclose(y.mean(axis=(1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(y.var(axis=(1, 2)), 1, atol=1e-3)


def test_names_shared_with_flax_and_their_defaults_are_documented():
    """resjax.nn exports BatchNorm and GroupNorm, flax.linen's names: a star import of both keeps the later one.
    Every shared name is documented where a user meets it (models guide, the classes' docstrings), with the
    defaults that differ stated as they are."""
    shared = {name for name in rn.__all__ if hasattr(nn, name)}
    assert shared == {"BatchNorm", "GroupNorm"}, shared  # a new shared name needs its paragraph too
    guide = (pathlib.Path(__file__).parent.parent / "docs" / "guide" / "models.md").read_text()
    section = guide[guide.index("**Names shared with Flax.**"):].split("\n\n")[0]
    for name in shared:
        assert f"`resjax.nn.{name}`" in section and "Names shared with flax" in rn.norms.__doc__, name
        assert "star import" in getattr(rn, name).__doc__ and f"``{name}``" in rn.__doc__
    assert (rn.BatchNorm.momentum, nn.BatchNorm.momentum) == (0.9, 0.99)  # what the docs say
    assert "`momentum=0.9`" in section and "Flax's default is 0.99" in section
    fields = lambda cls: {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}  # noqa: E731
    assert fields(rn.GroupNorm) == fields(nn.GroupNorm)  # "keeps Flax's defaults"
    stated = re.search(r"keeps Flax's defaults \(`num_groups=(\d+)`, `epsilon=([0-9.e-]+)`\)", section)
    assert (int(stated[1]), float(stated[2])) == (nn.GroupNorm.num_groups, nn.GroupNorm.epsilon), stated


# ---- param_dtype ----

@pytest.mark.parametrize("kind", list(KINDS))
def test_param_dtype_on_every_kind(kind):
    x = jax.random.normal(jax.random.key(1), KINDS[kind][1])
    for param_dtype, expected in ((None, jnp.float32), ("bfloat16", jnp.bfloat16), (jnp.float16, jnp.float16)):
        model, _ = _model(kind, param_dtype=param_dtype)
        v = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0), x)
        dtypes = {a.dtype for a in jax.tree_util.tree_leaves(v["params"])}
        assert dtypes == {jnp.dtype(expected)}, (param_dtype, dtypes)
        assert {a.dtype for a in jax.tree_util.tree_leaves(v.get("batch_stats", {}))} <= {jnp.dtype(jnp.float32)}
    if kind not in LARGE:
        model, _ = _model(kind, param_dtype="bfloat16")
        float32, _ = _model(kind)

        @jax.jit
        def run(key):  # one program
            v = model.init(key, x, train=False)
            return model.apply(v, x, train=False), v["params"], float32.init(key, x, train=False)["params"]

        out, params, params32 = run(jax.random.key(0))
        assert all(np.isfinite(np.asarray(o, np.float32)).all() for o in jax.tree_util.tree_leaves(out))
        # the initial draws do not depend on param_dtype: the bfloat16 parameters are the float32 draws, rounded
        for p, q in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params32)):
            np.testing.assert_array_equal(np.asarray(p), np.asarray(q.astype(jnp.bfloat16)))


# ---- each model carries only its own settings ----

MLP_ONLY = {"num_layers", "bias_init"}
CONV_ONLY = {"kind", "expansion", "shortcut", "option_a_norm", "option_a_input", "kernel_size"}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}


def test_each_model_has_its_kinds_fields():
    common = {"order", "norm", "scaling", "tau", "scalar_biases", "kernel_init", "use_bias", "activation", "dtype",
              "param_dtype"}
    assert _fields(rn.CommonSettings) == common
    assert _fields(rn.ResNet) == common | CONV_ONLY - {"kernel_size"} | {
        "stage_sizes", "stage_widths", "num_classes", "tau_blocks", "learnable_tau", "stem", "stem_width", "scan",
        "remat", "stem_head_biases", "stem_init", "block"}
    mlp = common | MLP_ONLY | {"scan", "remat", "block"}
    assert _fields(rn.ResidualMLP) == mlp | {"width", "num_blocks", "num_classes", "stem_init", "head_init"}
    assert _fields(rn.PlainMLP) == mlp | {"width", "depth", "num_classes", "stem_init", "head_init"}
    assert _fields(rn.ResidualStack) == mlp | {"width", "num_blocks"}
    assert not _fields(rn.ResNet) & MLP_ONLY
    for cls in (rn.ResidualMLP, rn.PlainMLP, rn.ResidualStack):
        assert not _fields(cls) & CONV_ONLY
    assert _fields(rn.ResidualBlock) >= common | MLP_ONLY | CONV_ONLY  # the one block has every kind's


@pytest.mark.parametrize("make, old, x", [
    (lambda **kw: rn.cifar_resnet(8, **kw), {"num_layers": 3, "bias_init": "fan_in"}, (2, 8, 8, 3)),
    (lambda **kw: rn.ResidualMLP(width=8, num_blocks=2, **kw), {"shortcut": "B", "option_a_norm": True}, (2, 5)),
], ids=["resnet", "mlp"])
def test_old_spellings_warn_and_build_the_same_model(make, old, x):
    x = jax.random.normal(jax.random.key(1), x)
    with pytest.warns(DeprecationWarning, match=r"block=\{") as record:
        model = make(**old)
    assert all(name in str(record[0].message) for name in old)
    assert model.block == old  # routed to the block, which ignores another kind's settings
    reference = make()
    v, w = model.init(jax.random.key(0), x, train=False), reference.init(jax.random.key(0), x, train=False)
    for a, b in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(w)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree_util.tree_structure(v) == jax.tree_util.tree_structure(w)


def test_build_model_routes_flat_block_settings_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = build_model({"kind": "cifar_resnet", "depth": 8, "num_layers": 2, "shortcut": "B"})
        mlp = build_model({"kind": "residual_mlp", "width": 8, "num_blocks": 2, "option_a_input": "x"})
    assert model.block == {"num_layers": 2} and model.shortcut == "B"
    assert mlp.block == {"option_a_input": "x"}
    assert hash(model) == hash(model.clone()) and hash(mlp) == hash(mlp.clone())  # still hashable, by content


# ---- no import circle; old checkpoints ----

def test_no_import_circle_in_resjax_nn():
    package = pathlib.Path(rn.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("resjax.nn."):
                names.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "resjax.nn":
                names.update(a.name for a in node.names if (package / f"{a.name}.py").exists())
        graph[path.stem] = names

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    circles = sorted(m for m in graph if m != "__init__" and reaches(m, m))
    assert not circles, circles


#: ``describe_model(ResidualMLP(width=8, num_blocks=3, norm='batch', num_layers=2))`` before the MLP took only
#: an MLP block's settings (commit 7c755f1).
OLD_MLP = """ResidualMLP(
    # attributes
    kind = 'mlp'
    num_layers = 2
    kernel_size = 3
    expansion = 4
    order = 'pre'
    shortcut = 'A'
    norm = 'batch'
    scaling = 'none'
    tau = '1/sqrt(K)'
    scalar_biases = None
    kernel_init = 'he_uniform'
    bias_init = 'zeros'
    use_bias = True
    activation = relu
    option_a_norm = False
    option_a_input = 'x'
    dtype = None
    scan = False
    block = None
    num_classes = 10
    stem_init = None
    head_init = None
    width = 8
    num_blocks = 3
)"""


def test_descriptions_from_before_the_change_are_recognised():
    same = rn.ResidualMLP(width=8, num_blocks=3, norm="batch", num_layers=2)
    assert describe_model(same) != OLD_MLP and same_model_description(OLD_MLP, describe_model(same))
    for other in (rn.ResidualMLP(width=8, num_blocks=3, norm="batch"), rn.PlainMLP(width=8, depth=3),
                  rn.ResidualMLP(width=8, num_blocks=3, norm="batch", num_layers=2, param_dtype="bfloat16")):
        assert not same_model_description(OLD_MLP, describe_model(other))
