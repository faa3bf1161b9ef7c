"""Parity fixtures from the peers' PyTorch models, and a parity report (needs torch; CI never runs this).

    python tools/make_parity_fixtures.py --tau-resnet PATH --fixup PATH [--out tests/data/parity] [--check]

``--tau-resnet`` / ``--fixup``: a checkout of dayu11/tau-ResNet / hongyi-zhang/Fixup (or their
``cifar/models`` folder). The peers' model files are imported from there (``resnet_cifar.py``,
``resnet_cifar_nobn.py``, ``fixup_resnet_cifar.py``); no peer code is copied into resjax.

Writes, under ``--out``:

- ``{tau_resnet_bn,tau_resnet_nobn,fixup}_resnet20.npz``: the repository's ResNet-20 in float64 with
  random weights (conv and linear weights drawn He-like and rounded to float16 values, stored as float16 so
  the files stay small; every other tensor float64), random BatchNorm affine parameters and running
  statistics, random scalar biases / multipliers / tau; a batch of 4 random 32x32 images (NCHW), random
  loss weights ``r`` (the loss is ``sum(logits * r)``), and the model's outputs: logits in train and eval
  mode, the input gradient in both modes, the gradients of the small parameters and of ``conv1.weight``,
  ``layer1.0.conv1.weight`` and ``fc.*`` (train mode; tau's after the repository's ``scale_tau_grad``) and
  the BatchNorm running statistics after the one training-mode forward pass. Keys: ``sd/<name>``,
  ``after/<name>``, ``grad/<name>``, ``x``, ``r``, ``logits_train``, ``logits_eval``, ``grad_x_train``,
  ``grad_x_eval``, ``meta`` (JSON: the resjax model settings and the torch version).
- ``torchvision_resnet_layouts.txt`` (when torchvision is installed): ``<model> <state_dict name> <shape>``
  for torchvision's ResNet-18/34/50/101/152, buffers included.

``--check`` (needs jax, flax and resjax importable as well: run from the repository root) prints, for
each repository model and torchvision's ResNet-18 and -50 (random weights and BN statistics, batch of 2
at 224x224), the largest difference between PyTorch and resjax in float32 and float64: logits (train and
eval), input gradients, BN running statistics after one training step (converted with
``resjax.interop.bn_counts``), relative to the largest reference value; and each model's parameter count
in both libraries.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys

import numpy as np

PEERS = {
    # name: (repository, file, constructor, constructor args, resjax settings)
    "tau_resnet_bn": ("tau-resnet", "resnet_cifar.py", "resnet20", (1 / 3,), {"tau": 1 / 3}),
    "tau_resnet_nobn": ("tau-resnet", "resnet_cifar_nobn.py", "resnet20_nobn", (1 / 3,), {"tau": 1 / 3}),
    "fixup": ("fixup", "fixup_resnet_cifar.py", "fixup_resnet20", (), {}),
}
BATCH = 4


def _import_peer(root: str, filename: str):
    for candidate in (os.path.join(root, filename), os.path.join(root, "cifar", "models", filename)):
        if os.path.exists(candidate):
            spec = importlib.util.spec_from_file_location(f"peer_{filename[:-3]}", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"{filename} not found under {root} (pass the repository checkout or its cifar/models)")


def _randomise(net, torch, generator, round_weights: bool):
    """Random weights, BN affine parameters and running statistics, scalars (in place, float64)."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.ndim == 4:  # conv: He fan-out normal, as the peers draw
                value = torch.randn(p.shape, generator=generator, dtype=torch.float64) * math.sqrt(
                    2.0 / (p.shape[0] * p.shape[2] * p.shape[3]))
            elif p.ndim == 2:  # linear
                value = torch.randn(p.shape, generator=generator, dtype=torch.float64) / math.sqrt(p.shape[1])
            elif name.endswith("tau"):
                value = 1 / 3 + 0.05 * torch.randn(p.shape, generator=generator, dtype=torch.float64)
            elif name.endswith("scale") or name.endswith("weight"):  # Fixup multiplier, BN scale
                value = 1 + 0.2 * torch.randn(p.shape, generator=generator, dtype=torch.float64)
            else:  # biases: BN shift, scalar biases, fc bias
                value = 0.1 * torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if round_weights and p.ndim in (2, 4):
                value = value.to(torch.float16).to(torch.float64)
            p.copy_(value.to(p.dtype))
        for name, b in net.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator, dtype=torch.float64))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=generator, dtype=torch.float64))
            elif name.endswith("num_batches_tracked"):
                b.fill_(7)


def _torch_run(net, x, r, train: bool, torch, scale_tau: bool):
    """logits, input gradient, parameter gradients, state_dict after one forward pass (train or eval)."""
    net = copy.deepcopy(net)
    net.train(train)
    x = x.clone().requires_grad_(True)
    logits = net(x)
    (logits * r).sum().backward()
    if scale_tau and hasattr(net, "scale_tau_grad"):
        net.scale_tau_grad()
    grads = {k: p.grad.detach().numpy().copy() for k, p in net.named_parameters() if p.grad is not None}
    state = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    return logits.detach().numpy(), x.grad.detach().numpy(), grads, state


def write_fixtures(args, torch) -> None:
    os.makedirs(args.out, exist_ok=True)
    roots = {"tau-resnet": args.tau_resnet, "fixup": args.fixup}
    for i, (name, (repo, filename, ctor, ctor_args, settings)) in enumerate(PEERS.items()):
        module = _import_peer(roots[repo], filename)
        net = getattr(module, ctor)(*ctor_args).double()
        gen = torch.Generator().manual_seed(1000 + i)
        _randomise(net, torch, gen, round_weights=True)
        x = torch.randn((BATCH, 3, 32, 32), generator=gen, dtype=torch.float64)
        r = torch.randn((BATCH, 10), generator=gen, dtype=torch.float64)
        logits_e, gx_e, _, _ = _torch_run(net, x, r, False, torch, True)
        logits_t, gx_t, grads, after = _torch_run(net, x, r, True, torch, True)
        sd = net.state_dict()
        out = {"x": x.numpy(), "r": r.numpy(), "logits_train": logits_t, "logits_eval": logits_e,
               "grad_x_train": gx_t, "grad_x_eval": gx_e}
        for k, v in sd.items():
            v = v.numpy()
            out[f"sd/{k}"] = v.astype(np.float16) if v.ndim in (2, 4) else v
            if k.endswith("running_mean") or k.endswith("running_var"):
                out[f"after/{k}"] = after[k]
        small = {"conv1.weight", "layer1.0.conv1.weight", "fc.weight", "fc.bias"}
        for k, g in grads.items():
            if g.size <= 64 or k in small:
                out[f"grad/{k}"] = g
        meta = {"repository_model": name, "depth": 20, "peer": f"{repo}:{filename}:{ctor}{ctor_args}",
                "resjax": settings, "torch": torch.__version__, "batch": BATCH,
                "params": int(sum(p.numel() for p in net.parameters()))}
        out["meta"] = np.asarray(json.dumps(meta))
        path = os.path.join(args.out, f"{name}_resnet20.npz")
        np.savez_compressed(path, **out)
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB; {meta['params']:,} parameters)")


def write_torchvision_layouts(args, torch) -> None:
    try:
        import torchvision
    except ImportError:
        print("torchvision not installed: torchvision_resnet_layouts.txt not written")
        return
    lines = [f"# torchvision {torchvision.__version__} ResNet state_dict names and shapes "
             "(tools/make_parity_fixtures.py)"]
    for depth in (18, 34, 50, 101, 152):
        net = getattr(torchvision.models, f"resnet{depth}")(weights=None)
        for k, v in net.state_dict().items():
            lines.append(f"resnet{depth} {k} {','.join(str(d) for d in v.shape)}")
    path = os.path.join(args.out, "torchvision_resnet_layouts.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(lines) - 1} tensors)")


# ------------------------------------------------------------------------------------------------ --check


def _resjax_run(model, variables, x_nchw, r, train: bool):
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.transpose(x_nchw, (0, 2, 3, 1)))
    r = jnp.asarray(r)

    def loss(x):
        if train:
            logits, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
        else:
            logits, state = model.apply(variables, x, train=False), {}
        return jnp.sum(logits * r), (logits, state)

    (_, (logits, state)), gx = jax.value_and_grad(loss, has_aux=True)(x)
    return np.asarray(logits), np.transpose(np.asarray(gx), (0, 3, 1, 2)), state


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-300))


def _rel_l2(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


def _fmt(a, b) -> str:
    """max |a - b| / max |b| and, in brackets, ||a - b|| / ||b|| (robust to the odd ReLU or max-pool unit
    that float32 rounding moves across its kink, which shifts one input gradient entry by ~1e-3)."""
    return f"{_rel(a, b):.1e} ({_rel_l2(a, b):.0e})"


def _compare(label, net, model, x, r, torch, dtype, reference=None) -> dict:
    """Print resjax's agreement with torch at ``dtype`` (and, given the float64 ``reference`` outputs,
    torch's own float32 error for scale); return torch's outputs."""
    import jax

    from resjax import interop

    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    net = copy.deepcopy(net).to(tdtype)
    xt, rt = x.to(tdtype), r.to(tdtype)
    logits_e, gx_e, _, _ = _torch_run(net, xt, rt, False, torch, True)
    logits_t, gx_t, _, after = _torch_run(net, xt, rt, True, torch, True)
    sd = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    counts = interop.bn_counts(model, (x.shape[0], x.shape[2], x.shape[3], x.shape[1]))
    with jax.enable_x64(dtype == np.float64):
        variables = interop.from_torch_state_dict(model, sd, dtype=dtype)
        le, ge, _ = _resjax_run(model, variables, xt.numpy(), rt.numpy(), False)
        counted = interop.from_torch_state_dict(model, sd, dtype=dtype, bn_count=counts)
        lt, gt, state = _resjax_run(model, counted, xt.numpy(), rt.numpy(), True)
    diffs = {"logits_eval": _fmt(le, logits_e), "logits_train": _fmt(lt, logits_t),
             "grad_x_eval": _fmt(ge, gx_e), "grad_x_train": _fmt(gt, gx_t)}
    outputs = {"logits_eval": logits_e, "logits_train": logits_t, "grad_x_eval": gx_e, "grad_x_train": gx_t}
    # resjax -> torch: the state_dict loads strictly into the peer's model and gives back every tensor
    loaded = copy.deepcopy(net)
    loaded.load_state_dict({k: torch.from_numpy(v) for k, v in interop.to_torch_state_dict(variables, model).items()},
                           strict=True)
    loaded_sd = loaded.state_dict()
    exact = all(torch.equal(a, loaded_sd[k]) for k, a in net.state_dict().items() if "num_batches" not in k)
    diffs["export"] = "exact" if exact else "DIFFERS"
    if state:
        back = interop.to_torch_state_dict({**counted, **state}, model, bn_count=counts)
        keys = [k for k in back if k.endswith(("running_mean", "running_var"))]
        diffs["bn_stats"] = f"{max(_rel(back[k], after[k]) for k in keys):.1e}"
    n_torch = sum(p.numel() for p in net.parameters())
    n_jax = sum(v.size for v in jax.tree_util.tree_leaves(variables["params"]))
    print(f"{label:<24} {np.dtype(dtype).name:<8} " + "  ".join(f"{k} {v}" for k, v in diffs.items())
          + f"  params torch {n_torch:,} resjax {n_jax:,}")
    if reference is not None:
        own = {k: _fmt(v, reference[k]) for k, v in outputs.items()}
        print(f"{'':<24} {'(torch float32 vs torch float64:':<8} " + "  ".join(f"{k} {v}" for k, v in own.items())
              + ")")
    return outputs


def check(args, torch) -> None:
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    from resjax.nn.resnet import REPOSITORY_MODELS, cifar_resnet, imagenet_resnet

    print("max |resjax - torch| / max |torch| and (||resjax - torch|| / ||torch||): logits, input gradients, "
          "BN running statistics after one step")
    roots = {"tau-resnet": args.tau_resnet, "fixup": args.fixup}
    for i, (name, (repo, filename, ctor, ctor_args, settings)) in enumerate(PEERS.items()):
        net = getattr(_import_peer(roots[repo], filename), ctor)(*ctor_args).double()
        gen = torch.Generator().manual_seed(2000 + i)
        _randomise(net, torch, gen, round_weights=False)
        x = torch.randn((8, 3, 32, 32), generator=gen, dtype=torch.float64)
        r = torch.randn((8, 10), generator=gen, dtype=torch.float64)
        model = cifar_resnet(20, **settings, **REPOSITORY_MODELS[name])
        reference = _compare(f"{name} ResNet-20", net, model, x, r, torch, np.float64)
        _compare(f"{name} ResNet-20", net, model, x, r, torch, np.float32, reference)
        for depth in (56, 110):
            big = getattr(_import_peer(roots[repo], filename), ctor.replace("20", str(depth)))(*ctor_args)
            n_torch = sum(p.numel() for p in big.parameters())
            print(f"{name} ResNet-{depth}: params torch {n_torch:,}")
    try:
        import torchvision
    except ImportError:
        print("torchvision not installed: ImageNet ResNets not checked")
        return
    for depth in args.torchvision_depths:
        net = getattr(torchvision.models, f"resnet{depth}")(weights=None).double()
        gen = torch.Generator().manual_seed(3000 + depth)
        _randomise(net, torch, gen, round_weights=False)
        x = torch.randn((2, 3, 224, 224), generator=gen, dtype=torch.float64)
        r = torch.randn((2, 1000), generator=gen, dtype=torch.float64)
        reference = _compare(f"torchvision ResNet-{depth}", net, imagenet_resnet(depth), x, r, torch, np.float64)
        _compare(f"torchvision ResNet-{depth}", net, imagenet_resnet(depth), x, r, torch, np.float32, reference)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tau-resnet", required=True, help="dayu11/tau-ResNet checkout (or its cifar/models)")
    parser.add_argument("--fixup", required=True, help="hongyi-zhang/Fixup checkout (or its cifar/models)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "parity"))
    parser.add_argument("--check", action="store_true", help="also print resjax's agreement (needs jax and resjax)")
    parser.add_argument("--no-write", action="store_true", help="only --check; write no fixtures")
    parser.add_argument("--torchvision-depths", type=int, nargs="*", default=[18, 50])
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if not args.no_write:
        write_fixtures(args, torch)
        write_torchvision_layouts(args, torch)
    if args.check:
        check(args, torch)


if __name__ == "__main__":
    main()
