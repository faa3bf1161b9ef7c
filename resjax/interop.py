"""Weights between resjax's convolutional ResNets and the peers' PyTorch models, without torch.

``from_torch_state_dict(model, state_dict)`` returns flax variables (``{'params': ..., 'batch_stats': ...}``
of numpy arrays) for a ``resjax.nn.resnet.ResNet``; ``to_torch_state_dict(variables, model)`` returns the
PyTorch ``state_dict`` (a dict of numpy arrays, ready for ``torch.from_numpy`` and ``load_state_dict``).
Supported peers, each with the resjax model that computes what it computes (``tests/test_interop.py``
checks the numbers against fixtures made with the peers' code, ``tools/make_parity_fixtures.py``):

==========================================================  ====================================================
PyTorch model                                               resjax model
==========================================================  ====================================================
torchvision ``resnet18/34/50/101/152``                      ``imagenet_resnet(depth)``
dayu11/tau-ResNet ``resnet20..1202(tau)`` (with BN)         ``cifar_resnet(depth, tau=tau, **REPOSITORY_MODELS['tau_resnet_bn'])``
dayu11/tau-ResNet ``resnet20_nobn..resnet1202_nobn(tau)``   ``cifar_resnet(depth, tau=tau, **REPOSITORY_MODELS['tau_resnet_nobn'])``
hongyi-zhang/Fixup ``fixup_resnet20..1202()``               ``cifar_resnet(depth, **REPOSITORY_MODELS['fixup'])``
==========================================================  ====================================================

(``REPOSITORY_MODELS`` is in ``resjax.nn.resnet``.) Any post-activation ``ResNet`` converts with the same
names (``order='pre'`` has no peer here and raises ``ValueError``); ``scan=True`` models get and give
the scanned layout (each stage's blocks after the first stacked on a leading axis).

Names and layouts:

- ``stem_conv`` / ``stem_norm`` / ``head`` <-> ``conv1`` / ``bn1`` / ``fc``; block ``j`` of stage ``s``
  (``stage{s}_first``, ``stage{s}_{j-1}``) <-> ``layer{s}.{j}``; in a block ``conv_i`` / ``norm_i`` <->
  ``conv{i+1}`` / ``bn{i+1}``, ``shortcut_conv`` / ``shortcut_norm`` <-> ``downsample.0`` /
  ``downsample.1`` (for option A with ``option_a_norm`` the 0 is the tau-ResNet repository's parameter-free
  ``AvgPool2d``);
- scalar biases (Fixup, tau-ResNet without BN): ``bias_in_i`` / ``bias_act_i`` <-> ``bias{i+1}a`` /
  ``bias{i+1}b``, ``bias_out`` <-> ``bias{m}b`` (m convs), ``fixup_scale`` <-> ``scale``, ``stem_bias`` /
  ``head_bias`` <-> ``bias1`` / ``bias2``, ``tau`` <-> ``tau``. Torch keeps these as shape ``(1,)``,
  resjax as ``()``. The tau-ResNet model without BN registers its one shared tau in every block as well
  (``layer1.0.tau`` ...: the same tensor); ``to_torch_state_dict`` writes those copies,
  ``from_torch_state_dict`` checks they equal ``tau``;
- conv kernels OIHW <-> HWIO, linear weights ``(out, in)`` <-> ``(in, out)``; BatchNorm ``weight`` /
  ``bias`` <-> ``scale`` / ``bias``, ``running_mean`` / ``running_var`` <-> ``batch_stats`` ``mean`` /
  ``var``. ``num_batches_tracked`` is accepted and ignored on the way in and written (``0`` unless
  ``num_batches_tracked=`` says otherwise) on the way out.

BatchNorm's running variance. PyTorch averages the *unbiased* batch variance (times n/(n-1), n = the
values per channel in the batch: batch size x height x width at that layer), flax the biased one; the
normalisation itself uses the stored value in both. A model built with resjax's BatchNorm option
``running_variance='unbiased'`` (``norm=resjax.nn.norms.UnbiasedBatchNorm``;
``repository_settings(name, running_variance='unbiased')`` for the peers' presets) averages PyTorch's
unbiased variance, so with it the running variance is copied as it is both ways and the imported weights
give PyTorch's evaluation outputs *and* its next training update at once (to float64 rounding;
``bn_count`` is then refused). With flax's default (biased) convention there are two correct conversions,
each exact for one of the two, chosen by ``bn_count``:

- ``bn_count=None`` (default): the running variance is copied as it is. Evaluation-mode outputs are then
  identical (what a pretrained model's user wants); the next training-mode update differs from PyTorch's
  by ``rho * var / (n - 1)`` (relative 2e-5 for n = 4096).
- ``bn_count=n`` (an int: one n for every layer), a dict ``{torch BN name: n}``, or
  ``bn_counts(model, input_shape)`` (each layer's n for a batch of that NHWC shape): the variance is
  rescaled, ``var_flax = var_torch * (n - 1) / n`` in and ``var_torch = var_flax * n / (n - 1)`` out, the
  estimate flax would hold had it trained on batches of that size. Then a training step updates the two
  identically (rescaled back, to float64 rounding), while evaluation outputs differ by about 1/(2n)
  relative. Use it to continue training a converted model where the difference matters.

Inputs are plain arrays: a ``dict`` of numpy arrays (torch tensors are converted with ``.detach().cpu()
.numpy()`` if passed, but torch is never imported), or a path to ``.npz`` or ``.safetensors`` (needs the
``safetensors`` package); ``load_state_dict`` reads those. A ``module.`` prefix on every key (a model
saved from ``nn.DataParallel``) is stripped. Anything that does not fit raises one short ``WeightsMismatchError``
(a ``ValueError``): how many tensors it could not place, resjax variables it left without a source and shapes
that differ, with the first few of each named (the error's ``unplaced``, ``missing`` and ``mismatched`` hold
them all). Weights of another depth are named as such first: the blocks per stage (and depths) of both
sides, and the first missing and the first unexpected key.

Several runs. ``to_torch_state_dict`` exports one run. The variables of a multi-seed state (a leading run axis
on every leaf: ``Trainer.sweep``, ``ImageTrainer.fit`` of several seeds) are refused with a message that names
the run axis and how to take run ``i``: ``run.select(i)`` (a ``RunState`` of one run, which
``to_torch_state_dict`` also takes as it is, as it takes a ``ModelState``) or ``run.select(i).state.variables()``.
Values keep their dtype unless ``dtype=`` is given (float64 in, float64 out: run the model under
``jax.enable_x64(True)`` to compute in float64).
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from resjax.nn.resnet import ResNet

__all__ = ["WeightsMismatchError", "bn_counts", "from_torch_state_dict", "load_state_dict", "repository_settings",
           "to_torch_state_dict", "torch_layout"]

_NBT = "num_batches_tracked"
_TOP = {"stem_conv": "conv1", "stem_norm": "bn1", "stem_bias": "bias1", "head_bias": "bias2", "head": "fc",
        "tau": "tau"}
_BLOCK_FIXED = {"shortcut_conv": "downsample.0", "shortcut_norm": "downsample.1", "fixup_scale": "scale"}
_LEAF = {("params", "kernel"): "weight", ("params", "bias"): "bias", ("params", "scale"): "weight",
         ("batch_stats", "mean"): "running_mean", ("batch_stats", "var"): "running_var"}


# ----------------------------------------------------------------------------------------------- errors


class WeightsMismatchError(ValueError):
    """Weights that do not fit the model. The message is short: the blocks per stage of both sides when they
    differ, else how many of each kind with the first few named; the attributes list them all: ``unplaced``
    (the source's tensors with no place in the model), ``missing`` (the model's variables without a source),
    ``mismatched`` (shapes that differ)."""

    def __init__(self, message: str, unplaced: Sequence[str] = (), missing: Sequence[str] = (),
                 mismatched: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unplaced, self.missing, self.mismatched = list(unplaced), list(missing), list(mismatched)


#: Names of each kind that a ``WeightsMismatchError`` message shows (the rest are counted).
SHOWN = 3


# ----------------------------------------------------------------------------------------------- layout


def _check_model(model):
    from resjax.nn.resnet import ResNet

    if not isinstance(model, ResNet):
        raise ValueError(f"model: resjax.interop converts resjax.nn.resnet.ResNet models (cifar_resnet, "
                         f"imagenet_resnet), got {type(model).__name__}")
    if model.order != "post":
        raise ValueError("order: only post-activation ResNets (order='post') have a PyTorch peer here "
                         f"(torchvision, tau-ResNet, Fixup); got order={model.order!r}")


@functools.lru_cache(maxsize=16)
def _cached_plan(model, in_channels: int):
    return _plan(model, _template(model, in_channels))


def _template(model, in_channels: int = 3):
    """Shapes and dtypes of the unrolled model's variables (nothing is computed)."""
    import jax
    import jax.numpy as jnp

    unrolled = model.clone(scan=False, remat=False)
    x = jax.ShapeDtypeStruct((1, 32, 32, in_channels), jnp.float32)
    shapes = jax.eval_shape(lambda x: unrolled.init(jax.random.PRNGKey(0), x, train=False), x)
    return {c: _to_dict(v) for c, v in shapes.items() if c in ("params", "batch_stats")}


@functools.lru_cache(maxsize=16)
def _cached_layout(model, in_channels: int) -> dict:
    """{(collection, *path): shape} of ``model``'s own variables (scanned when ``model.scan``)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((1, 32, 32, in_channels), jnp.float32)
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False), x)
    return {(c,) + p: tuple(v.shape) for c, tree in shapes.items() if c in ("params", "batch_stats")
            for p, v in _flatten(_to_dict(tree)).items()}


def _to_dict(tree):
    if isinstance(tree, Mapping):
        return {k: _to_dict(v) for k, v in tree.items()}
    return tree


def _flatten(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat):
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def _module_name(path: tuple, m: int) -> str | None:
    """The torch module (or parameter) name of a resjax module path (unrolled), or None."""
    head, rest = path[0], path[1:]
    if head in _TOP and not rest:
        return _TOP[head]
    match = re.fullmatch(r"stage(\d+)_(first|\d+)", head)
    if not match or len(rest) != 1:
        return None
    block = 0 if match.group(2) == "first" else int(match.group(2)) + 1
    prefix = f"layer{match.group(1)}.{block}"
    name = rest[0]
    if name in _BLOCK_FIXED:
        return f"{prefix}.{_BLOCK_FIXED[name]}"
    for pattern, fmt in ((r"conv_(\d+)", "conv{}"), (r"norm_(\d+)", "bn{}"), (r"bias_in_(\d+)", "bias{}a"),
                         (r"bias_act_(\d+)", "bias{}b")):
        hit = re.fullmatch(pattern, name)
        if hit:
            return f"{prefix}.{fmt.format(int(hit.group(1)) + 1)}"
    if name == "bias_out":
        return f"{prefix}.bias{m}b"
    return None


def _plan(model, template) -> tuple[dict, list]:
    """{(collection, *resjax path): (torch name, kind)} and the resjax variables with no torch name."""
    m = 2 if model.kind == "basic" else 3
    plan, unnamed = {}, []
    for collection, tree in template.items():
        for path, leaf in _flatten(tree).items():
            shape = tuple(leaf.shape)
            if collection == "params" and path in (("tau",), ("stem_bias",), ("head_bias",)) or (
                    collection == "params" and len(path) == 2 and len(shape) == 0):
                module = _module_name(path, m)
                kind = "scalar"
                name = module
            else:
                module = _module_name(path[:-1], m)
                leaf_name = _LEAF.get((collection, path[-1]))
                name = None if module is None or leaf_name is None else f"{module}.{leaf_name}"
                if path[-1] == "kernel":
                    kind = "conv" if len(shape) == 4 else "dense"
                elif collection == "batch_stats":
                    kind = path[-1]
                else:
                    kind = "copy"
            if name is None:
                unnamed.append("/".join((collection,) + path))
            else:
                plan[(collection,) + path] = (name, kind, shape)
    return plan, unnamed


def _torch_shape(kind: str, shape: tuple) -> tuple:
    if kind == "conv":
        return (shape[3], shape[2], shape[0], shape[1])
    if kind == "dense":
        return (shape[1], shape[0])
    if kind == "scalar":
        return (1,)
    return shape


def _bn_modules(plan) -> list[str]:
    return sorted({name.rsplit(".", 1)[0] for name, kind, _ in plan.values() if kind == "var"})


def _tau_copies(model, plan) -> list[str]:
    """The per-block copies of the shared tau that the tau-ResNet model without BN registers."""
    if not any(name == "tau" for name, _, _ in plan.values()):
        return []
    blocks = sorted({hit.group(1) for name, _, _ in plan.values() if (hit := re.match(r"(layer\d+\.\d+)\.", name))},
                    key=_natural)
    return [f"{b}.tau" for b in blocks]


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _torch_blocks(names) -> tuple[int, ...]:
    """Blocks per stage of a torch ``state_dict``'s names (``layer{s}.{j}.``)."""
    found: dict[int, int] = {}
    for name in names:
        hit = re.match(r"layer(\d+)\.(\d+)\.", name)
        if hit:
            found[int(hit.group(1))] = max(found.get(int(hit.group(1)), 0), int(hit.group(2)) + 1)
    return tuple(found.get(s, 0) for s in range(1, max(found) + 1)) if found else ()


def _resjax_blocks(paths) -> tuple[int, ...]:
    """Blocks per stage of unrolled resjax variable paths (``(collection, 'stage{s}_first' | 'stage{s}_{k}', ...)``)."""
    found: dict[int, int] = {}
    for path in paths:
        hit = re.fullmatch(r"stage(\d+)_(first|\d+)", path[1]) if len(path) > 1 else None
        if hit:
            k = 1 if hit.group(2) == "first" else int(hit.group(2)) + 2
            found[int(hit.group(1))] = max(found.get(int(hit.group(1)), 0), k)
    return tuple(found.get(s, 0) for s in range(1, max(found) + 1)) if found else ()


def _depth(blocks: Sequence[int], convs: int) -> int:
    return 2 + sum(blocks) * convs


_LEAF_ORDER = {"weight": 0, "bias": 1, "running_mean": 2, "running_var": 3, _NBT: 4}


def _part_rank(part: str, depth: int, leaf: bool, m: int) -> tuple:
    """Where one part of a torch name comes among its siblings in ``state_dict`` order (``m``: convs per
    block)."""
    if leaf:  # a module's own parameters and buffers, in the order the peers register them
        if depth > 0 and part in _LEAF_ORDER:
            return (_LEAF_ORDER[part],)
        if part == "tau":
            return (-1,)
        hit = re.fullmatch(r"bias(\d+)([ab]?)", part)
        if hit:  # bias1a, bias1b, bias2a, (Fixup's scale,) bias2b; the model's bias1, bias2
            return (int(hit.group(1)), {"": 0, "a": 0, "b": 2}[hit.group(2)])
        if part == "scale":  # Fixup registers it just before the last branch bias (bias{m}b)
            return (m, 1)
        return (100, part)
    if depth == 0:  # the model's children: conv1, bn1, layer1..layer4, fc
        hit = re.fullmatch(r"layer(\d+)", part)
        return {"conv1": (0,), "bn1": (1,)}.get(part, (2, int(hit.group(1))) if hit else (3, part))
    hit = re.fullmatch(r"(conv|bn)(\d+)", part)
    if hit:  # a block's children: conv1, bn1, conv2, bn2, (conv3, bn3,) downsample
        return (int(hit.group(2)), 0 if hit.group(1) == "conv" else 1)
    return (100, int(part)) if part.isdigit() else (101, part)


def _torch_order(name: str, m: int = 2):
    """The key that sorts a peer's ``state_dict`` names as torch writes them: each module's own parameters
    and buffers (in the peers' registration order), then its children, depth first (``conv1``, ``bn1``,
    ``layer1.0.conv1.weight``, ... ``fc``). ``m``: the convs per block, whose ``bias{m}b`` follows ``scale``."""
    parts = name.split(".")
    key = []
    for depth, part in enumerate(parts):
        leaf = depth == len(parts) - 1
        key.append((0 if leaf else 1, _part_rank(part, depth, leaf, m)))
    return tuple(key)


def _in_torch_order(out: dict, model) -> dict:
    m = 2 if model.kind == "basic" else 3
    return {k: out[k] for k in sorted(out, key=lambda k: _torch_order(k, m))}


def torch_layout(model: ResNet, in_channels: int = 3) -> dict[str, tuple[int, ...]]:
    """The PyTorch ``state_dict`` names and shapes of ``model``'s peer (buffers included), in the order torch
    writes them (each module's parameters and buffers, then its children, as registered)."""
    _check_model(model)
    plan, unnamed = _cached_plan(model, in_channels)
    if unnamed:
        raise ValueError(f"model: these resjax variables have no PyTorch name: {unnamed}")
    out = {name: _torch_shape(kind, shape) for name, kind, shape in plan.values()}
    out.update({f"{bn}.{_NBT}": () for bn in _bn_modules(plan)})
    out.update({name: (1,) for name in _tau_copies(model, plan)})
    return _in_torch_order(out, model)


# ----------------------------------------------------------------------------------------------- bn counts


def bn_counts(model: ResNet, input_shape: Sequence[int]) -> dict[str, int]:
    """``{torch BN name: n}``: the values per channel each BatchNorm of ``model`` normalises for an NHWC
    batch of ``input_shape`` (batch x height x width at that layer), for ``bn_count=``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    _check_model(model)
    unrolled = model.clone(scan=False, remat=False)
    x = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)

    def run(x):
        variables = unrolled.init(jax.random.PRNGKey(0), x, train=False)
        _, state = unrolled.apply(variables, x, train=True, mutable=["batch_stats", "intermediates"],
                                  capture_intermediates=lambda mdl, method: isinstance(mdl, nn.BatchNorm)
                                  and method == "__call__")
        return state["intermediates"]

    inter = _flatten(_to_dict(jax.eval_shape(run, x)))
    m = 2 if model.kind == "basic" else 3
    out = {}
    for path, leaf in inter.items():
        if path[-1] != "__call__":
            continue
        name = _module_name(path[:-1], m)
        if name is not None:
            out[name] = int(math.prod(leaf[0].shape[:-1]))
    return out


def _check_bn_count(model, bn_count) -> None:
    from resjax.nn.norms import running_variance_of

    if bn_count is not None and running_variance_of(model.norm) == "unbiased":
        raise ValueError("bn_count: this model's BatchNorm keeps PyTorch's unbiased running variance "
                         "(running_variance='unbiased'), so the running variance is copied as it is and gives "
                         "both PyTorch's evaluation outputs and its training updates; bn_count is for flax's "
                         "default (biased) convention. Leave bn_count=None")


def repository_settings(name: str, *, running_variance: str = "biased") -> dict[str, Any]:
    """The ``cifar_resnet`` settings of a peer's model, ``REPOSITORY_MODELS[name]``, with BatchNorm's
    running-variance convention: ``'biased'`` (flax's, the default: exactly ``REPOSITORY_MODELS[name]``) or
    ``'unbiased'`` (PyTorch's: ``norm=UnbiasedBatchNorm``, same parameter names and counts, so that
    ``from_torch_state_dict`` gives PyTorch's evaluation outputs and training updates at once). The peers
    without BatchNorm (``'tau_resnet_nobn'``, ``'fixup'``) are the same either way. Use as
    ``cifar_resnet(20, tau=1/3, **repository_settings('tau_resnet_bn', running_variance='unbiased'))``."""
    from resjax.nn.norms import RUNNING_VARIANCES, UnbiasedBatchNorm, is_batch_norm
    from resjax.nn.resnet import REPOSITORY_MODELS

    if name not in REPOSITORY_MODELS:
        raise ValueError(f"name: unknown repository model {name!r}; choose one of {tuple(REPOSITORY_MODELS)}")
    if running_variance not in RUNNING_VARIANCES:
        raise ValueError(f"running_variance: {' or '.join(map(repr, RUNNING_VARIANCES))}, got {running_variance!r}")
    settings = dict(REPOSITORY_MODELS[name])
    if running_variance == "unbiased" and is_batch_norm(settings["norm"]):
        settings["norm"] = UnbiasedBatchNorm
    return settings


def _var_factor(bn_count, module: str) -> float | None:
    """n / (n - 1) for this BN, or None for no correction."""
    if bn_count is None:
        return None
    n = bn_count if isinstance(bn_count, int) else bn_count.get(module) if isinstance(bn_count, Mapping) else None
    if isinstance(bn_count, Mapping) and n is None:
        raise ValueError(f"bn_count: no count for BatchNorm {module!r}; bn_counts(model, input_shape) gives one "
                         "for every BatchNorm")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"bn_count: the values per channel n must be an integer >= 2 (or None for no "
                         f"variance correction), got {n!r} for {module!r}")
    return n / (n - 1)


# ----------------------------------------------------------------------------------------------- conversion


def load_state_dict(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, np.ndarray]:
    """A state_dict as ``{name: numpy array}`` from a mapping, an ``.npz`` or a ``.safetensors`` file (a
    ``module.`` prefix on every name, as ``nn.DataParallel`` saves, is removed)."""
    out = _read_state_dict(source)
    if out and all(k.startswith("module.") for k in out):
        out = {k[len("module."):]: v for k, v in out.items()}
    return out


def _read_state_dict(source) -> dict[str, np.ndarray]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".npz"):
            with np.load(path) as data:
                return {k: np.asarray(data[k]) for k in data.files}
        if path.endswith(".safetensors"):
            try:
                from safetensors.numpy import load_file
            except ImportError as err:
                raise ValueError("state_dict: reading .safetensors needs the safetensors package "
                                 "(pip install safetensors)") from err
            return dict(load_file(path))
        raise ValueError(f"state_dict: expected a .npz or .safetensors file (save a torch state_dict with "
                         f"numpy values: {{k: v.numpy() for k, v in sd.items()}}), got {path!r}")
    if not isinstance(source, Mapping):
        raise ValueError(f"state_dict: expected a mapping of names to arrays or a file path, got "
                         f"{type(source).__name__}")
    out = {}
    for k, v in source.items():
        if hasattr(v, "detach"):  # a torch tensor, without importing torch
            v = v.detach().cpu().numpy()
        out[str(k)] = np.asarray(v)
    return out


def _cast(a: np.ndarray, dtype):
    if dtype is None or not np.issubdtype(a.dtype, np.floating):
        return a
    return a.astype(dtype)


def from_torch_state_dict(model: ResNet, state_dict: Mapping[str, Any] | str | os.PathLike, *,
                          bn_count: int | Mapping[str, int] | None = None, dtype: DTypeLike | None = None) -> dict:
    """Flax variables of ``model`` (a resjax ``ResNet``) from a PyTorch ``state_dict`` of its peer (see the
    module docstring: names, layouts, ``bn_count``). Returns ``{'params': ..., 'batch_stats': ...}`` (the
    latter only when the model has BatchNorm), nested dicts of numpy arrays in ``model``'s layout
    (scanned when ``model.scan``). Raises one ``ValueError`` naming every tensor it cannot place, every
    variable left without a source and every shape mismatch."""
    _check_model(model)
    _check_bn_count(model, bn_count)
    sd = load_state_dict(state_dict)
    stem = sd.get("conv1.weight")
    in_channels = int(stem.shape[1]) if stem is not None and stem.ndim == 4 else 3
    plan, unnamed = _cached_plan(model, in_channels)
    used, missing, mismatched, flat = set(), list(unnamed), [], {}
    for path, (name, kind, shape) in plan.items():
        if name not in sd:
            missing.append(f"{'/'.join(path)} (torch {name!r})")
            continue
        used.add(name)
        a = sd[name]
        if tuple(a.shape) != _torch_shape(kind, shape):
            mismatched.append(f"{name}: torch shape {tuple(a.shape)}, expected {_torch_shape(kind, shape)} "
                              f"for {'/'.join(path)} {shape}")
            continue
        if kind == "conv":
            a = a.transpose(2, 3, 1, 0)
        elif kind == "dense":
            a = a.T
        elif kind == "scalar":
            a = a.reshape(())
        elif kind == "var":
            factor = _var_factor(bn_count, name.rsplit(".", 1)[0])
            a = a if factor is None else a / factor
        flat[path] = np.array(_cast(a, dtype), order="C")
    for bn in _bn_modules(plan):
        if f"{bn}.{_NBT}" in sd:
            used.add(f"{bn}.{_NBT}")
    if "tau" in sd and "tau" in used:
        for copy in _tau_copies(model, plan):
            if copy in sd:
                used.add(copy)
                if not np.array_equal(np.reshape(sd[copy], -1), np.reshape(sd["tau"], -1)):
                    mismatched.append(f"{copy}: {sd[copy]!r} differs from tau {sd['tau']!r} (the tau-ResNet model "
                                      "shares one tau between its blocks)")
    unplaced = [k for k in sd if k not in used]
    _raise_if(unplaced, missing, mismatched, "from_torch_state_dict", model,
              blocks=(_torch_blocks(sd), tuple(model.stage_sizes)))
    variables = {c: v for c, v in _unflatten(flat).items()}
    if model.scan:
        variables = {c: _stack_stages(v, model) for c, v in variables.items()}
    return variables


def to_torch_state_dict(variables: Mapping[str, Any] | Any, model: ResNet, *,
                        bn_count: int | Mapping[str, int] | None = None, dtype: DTypeLike | None = None,
                        num_batches_tracked: int = 0) -> dict:
    """The PyTorch ``state_dict`` (``{name: numpy array}``, in torch's order: each module's parameters and
    buffers, then its children, as the peer registers them) of ``model``'s peer from flax
    ``variables`` (``'params'`` and, with BatchNorm, ``'batch_stats'``; scanned when ``model.scan``), or from
    one run's ``RunState`` or ``ModelState`` (``run.select(i)``: their ``variables()``).
    ``torch.nn.Module.load_state_dict({k: torch.from_numpy(v) ...})`` takes it with ``strict=True``.

    One run only: a state of several runs (a ``RunState`` with ``num_runs``, or variables with a leading run
    axis on every leaf) is a ``ValueError`` that names the run axis and ``run.select(i)``. Weights that do not
    fit raise a ``WeightsMismatchError`` as ``from_torch_state_dict`` does."""
    _check_model(model)
    _check_bn_count(model, bn_count)
    variables = {c: _to_numpy_tree(v) for c, v in _one_run_variables(variables).items()
                 if c in ("params", "batch_stats")}
    flat_in = {(c,) + p: v for c, tree in variables.items() for p, v in _flatten(tree).items()}
    stem = flat_in.get(("params", "stem_conv", "kernel"))
    in_channels = int(stem.shape[-2]) if stem is not None and stem.ndim >= 4 else 3
    runs = _run_axis(flat_in, _cached_layout(model, in_channels))
    if runs is not None:
        raise ValueError(_runs_message(runs, "variables with a leading seed axis"))
    if model.scan:
        variables = {c: _unstack_stages(v, model) for c, v in variables.items()}
        flat_in = {(c,) + p: v for c, tree in variables.items() for p, v in _flatten(tree).items()}
    plan, unnamed = _cached_plan(model, in_channels)
    out, missing, mismatched = {}, list(unnamed), []
    for path, (name, kind, shape) in plan.items():
        if path not in flat_in:
            missing.append(f"{'/'.join(path)} (torch {name!r})")
            continue
        a = flat_in[path]
        if tuple(a.shape) != shape:
            mismatched.append(f"{'/'.join(path)}: shape {tuple(a.shape)}, expected {shape} (torch {name!r})")
            continue
        if kind == "conv":
            a = a.transpose(3, 2, 0, 1)
        elif kind == "dense":
            a = a.T
        elif kind == "scalar":
            a = a.reshape((1,))
        elif kind == "var":
            factor = _var_factor(bn_count, name.rsplit(".", 1)[0])
            a = a if factor is None else a * factor
        out[name] = np.array(_cast(a, dtype), order="C")
    extra = ["/".join(p) for p in flat_in if p not in plan]
    _raise_if(extra, missing, mismatched, "to_torch_state_dict", model, source="resjax",
              blocks=(_resjax_blocks(flat_in), tuple(model.stage_sizes)))
    for bn in _bn_modules(plan):
        out[f"{bn}.{_NBT}"] = np.asarray(num_batches_tracked, np.int64)
    for copy in _tau_copies(model, plan):
        out[copy] = out["tau"].copy()
    return _in_torch_order(out, model)


def _convs(model) -> int:
    return 2 if model.kind == "basic" else 3


def _shown(items: Sequence[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f", ... ({more} more)" if more > 0 else "")


def _builder_hint(model, blocks: Sequence[int], convs: int) -> str:
    """The resjax builder of the weights' depth, in the model's own family: ``imagenet_resnet(d)`` for an ImageNet
    stem (torchvision's layout), ``cifar_resnet(d, ...)`` for a CIFAR one, when that builder makes those blocks."""
    from resjax.nn.resnet import IMAGENET_STAGES

    depth = _depth(blocks, convs)
    if getattr(model, "stem", "cifar") == "imagenet":
        kind = "basic" if convs == 2 else "bottleneck"
        if IMAGENET_STAGES.get(depth) == (kind, tuple(blocks)):
            return f" (imagenet_resnet({depth}), as torchvision's resnet{depth})"
        return ""
    if len(set(blocks)) == 1 and convs == 2:
        return f" (cifar_resnet({depth}, ...) for a CIFAR ResNet)"
    return ""


def _raise_if(unplaced, missing, mismatched, where, model, source="torch", blocks=None):
    """One short ``WeightsMismatchError``: another depth first (``blocks``: the source's and the model's blocks
    per stage), else each kind's count and first names."""
    if not (unplaced or missing or mismatched):
        return
    m = _convs(model)
    what = "tensors" if source == "torch" else "variables"
    # the model's variables without a source in the order torch lists their names (those named ``(torch '...')``)
    missing = sorted(missing, key=lambda v: _torch_order(v.split("'")[1], m) if "(torch '" in v else ((2, ()),))
    if (blocks is not None and len(blocks[0]) == len(blocks[1]) and all(blocks[0]) and blocks[0] != blocks[1]):
        # the same stages with other block counts: another depth (not a stray name such as 'layer9.0.x')
        given, want = blocks
        first = [f"first missing: {missing[0]}" if missing else "nothing missing",
                 f"first unexpected: {unplaced[0]}" if unplaced else "nothing unexpected"]
        message = (f"{where}: the {source} weights have {given} blocks per stage (depth {_depth(given, m)}), "
                   f"this resjax {type(model).__name__} has {want} (depth {_depth(want, m)}): build the model "
                   f"with stage_sizes={given}{_builder_hint(model, given, m)}; "
                   f"{'; '.join(first)} ({len(missing)} missing, {len(unplaced)} unexpected, {len(mismatched)} "
                   "shapes differ: the error's .missing, .unplaced, .mismatched)")
        raise WeightsMismatchError(message, unplaced, missing, mismatched)
    lines = [f"{where}: the {source} weights do not fit this resjax {type(model).__name__} "
             f"(depth {_depth(model.stage_sizes, m)}, norm={model.norm!r}, scaling={model.scaling!r}; see "
             "resjax.interop for each peer's settings; the error's .unplaced, .missing, .mismatched list all)"]
    if unplaced:
        lines.append(f"  {len(unplaced)} {source} {what} with no place in the model: {_shown(unplaced)}")
    if missing:
        lines.append(f"  {len(missing)} model variables without a source: {_shown(missing)}")
    if mismatched:
        lines.append(f"  {len(mismatched)} shape mismatches: {'; '.join(mismatched[:SHOWN])}"
                     + (f"; ... ({len(mismatched) - SHOWN} more)" if len(mismatched) > SHOWN else ""))
    raise WeightsMismatchError("\n".join(lines), unplaced, missing, mismatched)


def _runs_message(n: int, what: str) -> str:
    return (f"to_torch_state_dict: {what} of {n} runs (a multi-seed state: Trainer.sweep, ImageTrainer.fit of "
            f"several seeds), and a state_dict holds one run. Take run i first: to_torch_state_dict(run.select(i), "
            f"model), or run.select(i).state.variables() (of variables alone: jax.tree.map(lambda a: a[i], "
            f"variables))")


def _one_run_variables(variables) -> Mapping:
    """``variables`` as a mapping of collections: a ``RunState`` of one run or a ``ModelState`` gives its
    ``variables()``; a ``RunState`` of several runs is refused, naming its run axis."""
    if hasattr(variables, "select") and hasattr(variables, "num_runs") and hasattr(variables, "state"):  # RunState
        n = variables.num_runs
        if n is not None:
            raise ValueError(_runs_message(n, "a RunState with a leading run axis"))
        variables = variables.state
    if not isinstance(variables, Mapping) and callable(getattr(variables, "variables", None)):  # ModelState
        variables = variables.variables()
    if not isinstance(variables, Mapping):
        raise ValueError(f"variables: want flax variables ({{'params': ..., 'batch_stats': ...}}), a RunState or "
                         f"a ModelState, got {type(variables).__name__}")
    return variables


def _run_axis(flat: dict, layout: dict) -> int | None:
    """The length of a leading axis that every variable found in the model's layout has on top of its shape
    there (the run axis of a multi-seed state), or None."""
    shapes = [(tuple(np.shape(v)), layout[p]) for p, v in flat.items() if p in layout]
    if shapes and all(len(got) == len(want) + 1 and got[1:] == want for got, want in shapes):
        lengths = {got[0] for got, _ in shapes}
        if len(lengths) == 1:
            return lengths.pop()
    return None


def _to_numpy_tree(tree):
    if isinstance(tree, Mapping):
        return {k: _to_numpy_tree(v) for k, v in tree.items()}
    return np.asarray(tree)


def _stack_stages(collection: dict, model) -> dict:
    """Unrolled ``stage{s}_{k}`` -> scanned ``stage{s}/block`` (leading axis k), numpy (dtype kept)."""
    out = dict(collection)
    for s, size in enumerate(model.stage_sizes):
        name = f"stage{s + 1}"
        blocks = [out.pop(f"{name}_{k}") for k in range(size - 1) if f"{name}_{k}" in out]
        if blocks:
            flat = [_flatten(b) for b in blocks]
            out[name] = {"block": _unflatten({p: np.stack([f[p] for f in flat]) for p in flat[0]})}
    return out


def _unstack_stages(collection: dict, model) -> dict:
    """Scanned ``stage{s}/block`` -> unrolled ``stage{s}_{k}``, as many as the leading axis holds."""
    out = dict(collection)
    for s in range(len(model.stage_sizes)):
        name = f"stage{s + 1}"
        if isinstance(out.get(name), Mapping) and isinstance(out[name].get("block"), Mapping):
            flat = _flatten(out.pop(name)["block"])
            count = min((np.shape(v)[0] for v in flat.values() if np.ndim(v)), default=0)
            for k in range(count):
                out[f"{name}_{k}"] = _unflatten({p: v[k] for p, v in flat.items()})
    return out
