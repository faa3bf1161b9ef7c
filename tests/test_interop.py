"""resjax.interop and the peers' models: float64 parity with fixtures made by the tau-ResNet and Fixup
repositories' own code (tools/make_parity_fixtures.py, torch not needed here), torchvision's state_dict
layout, exact round trips, and errors that name every tensor."""

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax import interop
from resjax.nn.resnet import REPOSITORY_MODELS, cifar_resnet, imagenet_resnet

DATA = Path(__file__).parent / "data" / "parity"
FIXTURES = ["tau_resnet_bn", "tau_resnet_nobn", "fixup"]
TOL = 1e-10


# XLA:CPU without its optimisation passes (the test run's default) runs float64 convolutions ~20x slower.
pytestmark = pytest.mark.usefixtures("optimized_compiles")


def _fixture(name):
    with np.load(DATA / f"{name}_resnet20.npz") as f:
        data = {k: f[k] for k in f.files}
    meta = json.loads(str(data.pop("meta")))
    group = lambda prefix: {k[len(prefix):]: v.astype(np.float64) if v.dtype.kind == "f" else v
                            for k, v in data.items() if k.startswith(prefix)}
    return meta, group("sd/"), group("after/"), group("grad/"), data


def _model(meta, **kwargs):
    return cifar_resnet(meta["depth"], **meta["resjax"], **REPOSITORY_MODELS[meta["repository_model"]], **kwargs)


def _close(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == np.float64, what
    err = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert err < TOL, f"{what}: relative error {err:.2e}"


def _run(model, variables, x_nchw, r, train):
    """logits, input gradient (NCHW), parameter gradients (train mode) and updated state of sum(logits * r)."""
    x = jnp.asarray(np.transpose(x_nchw, (0, 2, 3, 1)))

    def loss(params, others, x):
        v = {**others, "params": params}
        if train:
            logits, state = model.apply(v, x, train=True, mutable=["batch_stats"])
        else:
            logits, state = model.apply(v, x, train=False), {}
        return jnp.sum(logits * r), (logits, state)

    others = {k: v for k, v in variables.items() if k != "params"}
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2) if train else 2, has_aux=True))
    (_, (logits, state)), grads = step(variables["params"], others, x)
    g_params, g_x = grads if train else (None, grads)
    return np.asarray(logits), np.transpose(np.asarray(g_x), (0, 3, 1, 2)), g_params, state


@pytest.mark.parametrize("name", FIXTURES)
def test_repository_models_match_their_pytorch_code_in_float64(name):
    meta, sd, after, grads, data = _fixture(name)
    model = _model(meta)
    x, r = data["x"], data["r"]
    counts = interop.bn_counts(model, (x.shape[0], x.shape[2], x.shape[3], x.shape[1]))
    with jax.enable_x64(True):
        # evaluation mode: the running variance copied as it is
        variables = interop.from_torch_state_dict(model, sd)
        logits, g_x, _, _ = _run(model, variables, x, r, train=False)
        _close(logits, data["logits_eval"], "eval logits")
        _close(g_x, data["grad_x_eval"], "eval input gradient")
        # training mode: the running variance as flax's biased estimate, so the update matches torch's
        variables = interop.from_torch_state_dict(model, sd, bn_count=counts)
        logits, g_x, g_params, state = _run(model, variables, x, r, train=True)
        _close(logits, data["logits_train"], "train logits")
        _close(g_x, data["grad_x_train"], "train input gradient")
        g_torch = interop.to_torch_state_dict({**variables, "params": g_params}, model, bn_count=counts)
        assert set(grads) <= set(g_torch)
        for k, g in grads.items():  # tau: the repository's gradient after scale_tau_grad (the block average)
            _close(g_torch[k], g, f"gradient of {k}")
        if "batch_stats" in variables:
            new = interop.to_torch_state_dict({**variables, **state}, model, bn_count=counts)
            assert set(after) == {k for k in new if k.endswith(("running_mean", "running_var"))}
            for k, v in after.items():
                _close(new[k], v, f"updated {k}")
    assert ("batch_stats" in variables) == (name == "tau_resnet_bn")


def test_scanned_layout_gives_the_same_numbers():
    meta, sd, _, _, data = _fixture("fixup")
    model = _model(meta, scan=True)
    with jax.enable_x64(True):
        variables = interop.from_torch_state_dict(model, sd)
        assert variables["params"]["stage2"]["block"]["conv_0"]["kernel"].shape == (2, 3, 3, 32, 32)
        x = np.transpose(data["x"], (0, 2, 3, 1))
        logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
        _close(logits, data["logits_eval"], "eval logits (scan=True)")


@pytest.mark.parametrize("name,depth,count", [
    ("tau_resnet_bn", 20, 269_818), ("tau_resnet_bn", 56, 853_114), ("tau_resnet_bn", 110, 1_728_058),
    ("tau_resnet_nobn", 20, 268_383), ("tau_resnet_nobn", 110, 1_720_083),
    ("fixup", 20, 268_393), ("fixup", 110, 1_720_138)])
def test_repository_parameter_counts(name, depth, count):
    model = cifar_resnet(depth, scan=True, **REPOSITORY_MODELS[name])
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
    assert sum(x.size for x in jax.tree_util.tree_leaves(shapes["params"])) == count
    if depth == 20:  # the fixture's state_dict has exactly the repository's parameters (buffers aside)
        meta, sd, _, _, _ = _fixture(name)
        assert meta["params"] == count
        assert set(interop.torch_layout(model)) == set(sd)


def _torchvision_layouts():
    layouts: dict = {}
    for line in (DATA / "torchvision_resnet_layouts.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        model, name, shape = line.split(" ")
        layouts.setdefault(int(model[len("resnet"):]), {})[name] = tuple(int(d) for d in shape.split(",") if d)
    return layouts


@pytest.mark.parametrize("depth", [18, 34, 50, 101, 152])
def test_torchvision_state_dict_layout(depth):
    expected = _torchvision_layouts()[depth]
    model = imagenet_resnet(depth, scan=True)
    layout = interop.torch_layout(model)
    assert layout == expected
    assert len(layout) == {18: 122, 34: 218, 50: 320, 101: 626, 152: 932}[depth]


@pytest.mark.parametrize("name", FIXTURES)
def test_exporter_writes_torchs_key_order(name):
    """The fixtures' state_dicts keep torch's order (each module's parameters and buffers as registered, then
    its children): the exporter and torch_layout write exactly that order."""
    meta, sd, _, _, _ = _fixture(name)
    model = _model(meta)
    assert list(interop.to_torch_state_dict(interop.from_torch_state_dict(model, sd), model)) == list(sd)
    assert list(interop.torch_layout(model)) == list(interop.torch_layout(_model(meta, scan=True))) == list(sd)


@pytest.mark.parametrize("depth", [18, 50])
def test_torchvision_key_order(depth):
    expected = [line.split(" ")[1] for line in (DATA / "torchvision_resnet_layouts.txt").read_text().splitlines()
                if line.startswith(f"resnet{depth} ")]
    model = imagenet_resnet(depth, scan=True)
    assert list(interop.torch_layout(model)) == expected
    rng = np.random.default_rng(0)
    template = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
    variables = {c: _random_like(dict(v), rng) for c, v in template.items()}
    assert list(interop.to_torch_state_dict(variables, model)) == expected


def _zero_variables(model):
    """``model``'s variables (on a CIFAR image) as numpy zeros, in ``init``'s order (collections and modules as
    created; messages name the first key that does not fit), for checks that only read their names and shapes:
    ``init`` traced, not compiled (its eager initialisers cost seconds here)."""
    def zeros(tree):
        return {k: zeros(v) for k, v in tree.items()} if isinstance(tree, Mapping) else np.zeros(tree.shape, tree.dtype)

    variables = {}
    jax.eval_shape(lambda: variables.update(zeros(model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)),
                                                             train=False))))
    return variables


def _random_like(template, rng):
    return jax.tree_util.tree_map(lambda s: rng.random(s.shape, dtype=np.float32), template)


SUPPORTED = [(lambda d=d, **k: imagenet_resnet(d, **k), f"imagenet_resnet({d})") for d in (18, 34, 50, 101, 152)] + [
    (lambda name=name, **k: cifar_resnet(20, **REPOSITORY_MODELS[name], **k), name) for name in FIXTURES] + [
    (lambda **k: cifar_resnet(20, **k), "cifar_resnet(20)")]


@pytest.mark.parametrize("make,label", SUPPORTED, ids=[label for _, label in SUPPORTED])
def test_round_trip_is_exact(make, label):
    rng = np.random.default_rng(0)
    for scan in (True, False) if "cifar" in label or label in FIXTURES else (True,):
        model = make(scan=scan)
        template = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
        variables = {c: _random_like(dict(v), rng) for c, v in template.items()}
        if "batch_stats" in variables:  # variances are positive
            variables["batch_stats"] = jax.tree_util.tree_map(np.abs, variables["batch_stats"])
        sd = interop.to_torch_state_dict(variables, model)
        assert set(sd) == set(interop.torch_layout(model))
        back = interop.from_torch_state_dict(model, sd)
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(variables)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree_util.tree_leaves(variables)):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), jax.tree_util.keystr(path)
        again = interop.to_torch_state_dict(back, model)  # torch -> resjax -> torch
        assert all(np.array_equal(again[k], sd[k]) for k in sd)


def test_bn_count_rescales_the_running_variance_both_ways():
    model = cifar_resnet(20, **REPOSITORY_MODELS["tau_resnet_bn"])
    _, sd, _, _, _ = _fixture("tau_resnet_bn")
    counts = interop.bn_counts(model, (4, 32, 32, 3))
    assert counts["bn1"] == 4 * 32 * 32 and counts["layer2.0.downsample.1"] == 4 * 16 * 16
    assert counts["layer3.2.bn2"] == 4 * 8 * 8 and len(counts) == 21
    v = interop.from_torch_state_dict(model, sd, bn_count=counts)
    n = counts["layer3.2.bn2"]
    np.testing.assert_allclose(v["batch_stats"]["stage3_1"]["norm_1"]["var"],
                               sd["layer3.2.bn2.running_var"] * (n - 1) / n, rtol=1e-15)
    back = interop.to_torch_state_dict(v, model, bn_count=counts)
    for k in sd:
        np.testing.assert_allclose(back[k], sd[k] if "num_batches" not in k else 0, rtol=1e-15)
    single = interop.from_torch_state_dict(model, sd, bn_count=1000)
    np.testing.assert_allclose(single["batch_stats"]["stem_norm"]["var"], sd["bn1.running_var"] * 0.999, rtol=1e-15)
    with pytest.raises(ValueError, match="bn_count"):
        interop.from_torch_state_dict(model, sd, bn_count={"bn1": 10})


def test_loads_npz_and_dataparallel_prefixes(tmp_path):
    meta, sd, _, _, _ = _fixture("fixup")
    model = _model(meta)
    np.savez(tmp_path / "sd.npz", **{f"module.{k}": v for k, v in sd.items()})
    variables = interop.from_torch_state_dict(model, tmp_path / "sd.npz", dtype=np.float32)
    assert variables["params"]["stem_bias"].dtype == np.float32 and variables["params"]["stem_bias"].shape == ()
    np.testing.assert_array_equal(variables["params"]["stage1_first"]["conv_0"]["kernel"],
                                  sd["layer1.0.conv1.weight"].transpose(2, 3, 1, 0).astype(np.float32))
    assert "batch_stats" not in variables


def test_safetensors_files(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    meta, sd, _, _, _ = _fixture("tau_resnet_nobn")
    model = _model(meta)
    safetensors.save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(tmp_path / "sd.safetensors"))
    a = interop.from_torch_state_dict(model, tmp_path / "sd.safetensors")
    b = interop.from_torch_state_dict(model, sd)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def test_errors_are_short_and_name_what_does_not_fit():
    meta, sd, _, _, _ = _fixture("fixup")
    model = _model(meta)
    bad = dict(sd)
    bad["layer9.0.conv1.weight"] = np.zeros((1,))
    del bad["fc.bias"], bad["layer2.1.bias1b"]
    bad["layer1.0.conv2.weight"] = np.zeros((16, 16, 1, 1))
    with pytest.raises(interop.WeightsMismatchError) as err:
        interop.from_torch_state_dict(model, bad)
    message = str(err.value)
    for name in ("layer9.0.conv1.weight", "head/bias", "'fc.bias'", "stage2_0/bias_act_0", "'layer2.1.bias1b'",
                 "layer1.0.conv2.weight: torch shape (16, 16, 1, 1), expected (16, 16, 3, 3)"):
        assert name in message
    assert isinstance(err.value, ValueError)
    # the Fixup weights do not fit the tau-ResNet model without BN: Fixup's scalars have no place there. The
    # message counts them and names the first few; the error lists them all
    other = cifar_resnet(20, **REPOSITORY_MODELS["tau_resnet_nobn"])
    with pytest.raises(interop.WeightsMismatchError) as err:
        interop.from_torch_state_dict(other, sd)
    message = str(err.value)
    assert len(message) < 800, len(message)
    assert "11 torch tensors with no place in the model: bias1, bias2, layer1.0.scale, ... (8 more)" in message
    assert "layer3.2.scale" in err.value.unplaced and len(err.value.unplaced) == 11
    assert "without a source: params/tau (torch 'tau')" in message and err.value.missing == ["params/tau (torch 'tau')"]
    nobn_meta, nobn, _, _, _ = _fixture("tau_resnet_nobn")
    nobn["layer2.1.tau"] = nobn["tau"] + 1
    with pytest.raises(ValueError, match="layer2.1.tau"):
        interop.from_torch_state_dict(_model(nobn_meta), nobn)
    variables = interop.from_torch_state_dict(model, sd)
    variables["params"]["extra"] = np.zeros(3)
    with pytest.raises(ValueError, match="params/extra"):
        interop.to_torch_state_dict(variables, model)
    with pytest.raises(ValueError, match="order"):
        interop.torch_layout(cifar_resnet(20, order="pre", shortcut="B"))


def test_stacked_weights_of_several_runs_are_named_as_a_seed_axis():
    """A multi-seed state's variables (a leading seed axis on every leaf) get one short error that names the
    run axis and ``run.select(i)``, whatever the layout (scanned too) and whichever collections are given; one run
    of them exports exactly as the single-run variables do."""
    meta, sd, _, _, _ = _fixture("fixup")
    model = _model(meta)
    variables = interop.from_torch_state_dict(model, sd)
    stacked = jax.tree_util.tree_map(lambda a: np.stack([a, a, a]), variables)
    with pytest.raises(ValueError, match=r"leading seed axis of 3 runs .* run\.select\(i\)\.state\.variables\(\)"):
        interop.to_torch_state_dict(stacked, model)
    one = interop.to_torch_state_dict(jax.tree_util.tree_map(lambda a: a[1], stacked), model)
    assert all(np.array_equal(one[k], v) for k, v in interop.to_torch_state_dict(variables, model).items())
    # with BatchNorm: the parameters alone, and the scanned layout (whose unrolling would take the seed axis for
    # the blocks': 37 and more shape mismatches before)
    # (the values play no part: the variables' shapes as zeros, stacked into jax arrays)
    bn = cifar_resnet(20, tau=0.3, **REPOSITORY_MODELS["tau_resnet_bn"])
    for m in (bn, bn.clone(scan=True)):
        v = _zero_variables(m)
        for given in (dict(v), {"params": v["params"]}):
            with pytest.raises(ValueError) as err:
                interop.to_torch_state_dict(jax.tree_util.tree_map(lambda a: jax.device_put(np.stack([a, a])), given),
                                            m)
            assert "leading seed axis of 2 runs" in str(err.value) and "run.select(i)" in str(err.value)
            assert len(str(err.value)) < 400 and not isinstance(err.value, interop.WeightsMismatchError)


def test_a_run_state_exports_one_run_and_names_the_run_axis_of_several(tmp_path):
    """``to_torch_state_dict`` takes a ``RunState`` of one run (``run.select(i)``) and a ``ModelState``, and
    refuses a ``RunState`` of several runs with a message naming the run axis and ``run.select(i)`` (it was a bare
    ``TypeError``); anything else is a ``ValueError`` naming ``variables``."""
    from resjax.train import ModelState, RunState

    meta, sd, _, _, _ = _fixture("tau_resnet_bn")
    model = _model(meta)
    variables = interop.from_torch_state_dict(model, sd, dtype=np.float32)  # float32, as jnp.stack below keeps it
    state = ModelState(step=np.int32(0), params=variables["params"], batch_stats=variables["batch_stats"],
                       opt_state=())
    run = RunState(state=state, key=jax.random.key(0), data_seed=np.int32(0), epoch=np.int32(0),
                   diverged_epoch=np.int32(-1), history={})
    runs = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 2 if jnp.issubdtype(a.dtype, jnp.floating) else a]), run)
    with pytest.raises(ValueError, match=r"RunState with a leading run axis of 2 runs.*to_torch_state_dict\("
                                         r"run\.select\(i\), model\)"):
        interop.to_torch_state_dict(runs, model)
    expected = interop.to_torch_state_dict(variables, model)
    for given in (run, state, runs.select(0)):
        got = interop.to_torch_state_dict(given, model)
        assert list(got) == list(expected) and all(np.array_equal(got[k], v) for k, v in expected.items())
    doubled = interop.to_torch_state_dict(runs.select(1), model)
    np.testing.assert_array_equal(doubled["conv1.weight"], 2 * expected["conv1.weight"])
    with pytest.raises(ValueError, match="variables: want flax variables"):
        interop.to_torch_state_dict([variables], model)


@pytest.mark.parametrize("direction", ["in", "out"])
def test_weights_of_another_depth_get_one_short_message_naming_both_depths(direction):
    """ResNet-32 weights into a ResNet-20 (and back; torch and resjax sides): one message under 500 characters
    with both block counts, both depths, the first missing and the first unexpected key (it was a 5,602-character
    list of 216 tensors); the error keeps the full lists."""
    small, big = (cifar_resnet(d, **REPOSITORY_MODELS["tau_resnet_bn"], tau=0.3) for d in (20, 32))
    for given, model, missing, unexpected in ((big, small, "nothing missing", "first unexpected: layer1.3.conv1"),
                                              (small, big, "first missing: params/stage1_2/conv_0/kernel (torch "
                                                           "'layer1.3.conv1.weight')", "nothing unexpected")):
        v = _zero_variables(given)  # names and shapes are what count here
        with pytest.raises(interop.WeightsMismatchError) as err:
            if direction == "in":
                interop.from_torch_state_dict(model, interop.to_torch_state_dict(v, given))
            else:
                interop.to_torch_state_dict(v, model)
                missing = missing.replace("first unexpected", "")
        message = str(err.value)
        assert len(message) < 500, (len(message), message)
        d_given, d_model = (20, 32) if given is small else (32, 20)
        s_given, s_model = ((3, 3, 3), (5, 5, 5)) if given is small else ((5, 5, 5), (3, 3, 3))
        assert f"weights have {s_given} blocks per stage (depth {d_given})" in message
        assert f"has {s_model} (depth {d_model})" in message
        if direction == "in":
            assert missing in message and unexpected in message, message
            # 6 more blocks of 2 convs and 2 BatchNorms: 12 torch tensors each, 10 resjax variables
            assert len(err.value.missing) == (60 if given is small else 0)
            assert len(err.value.unplaced) == (0 if given is small else 72)
        else:
            first = "first missing: params/stage1_2" if given is small else "first unexpected: params/stage1_2"
            assert first in message, message


def test_torchvision_weights_of_another_depth_name_imagenet_resnet():
    """torchvision ResNet-34 weights offered to an imagenet_resnet(18): the hint names the builder of the weights'
    own family and depth (imagenet_resnet(34), not cifar_resnet)."""
    small, big = imagenet_resnet(18, scan=True), imagenet_resnet(34, scan=True)
    with pytest.raises(interop.WeightsMismatchError) as err:
        interop.to_torch_state_dict(_zero_variables(big), small)
    message = str(err.value)
    assert "stage_sizes=(3, 4, 6, 3) (imagenet_resnet(34), as torchvision's resnet34)" in message, message
    assert "cifar_resnet" not in message
