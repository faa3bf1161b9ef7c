"""Parity fixtures from the peers' PyTorch models, and a parity report (needs torch; CI never runs this).

    python tools/make_parity_fixtures.py --tau-resnet PATH --fixup PATH [--out tests/data/parity] [--check]
        [--sgd-steps-only]
    python tools/make_parity_fixtures.py --fixup PATH --fixup-schedule-only   (no torch needed)

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
- ``{tau_resnet_bn,tau_resnet_nobn,fixup}_sgd_steps.npz``: two SGD steps of each repository's own CIFAR
  training (``cifar/cifar_train.py``, whose rules ``TRAINING`` restates with line numbers and checks are still
  in the checkout's script) from exactly the weights in ``sd/*`` of ``{name}_resnet20.npz`` (checked equal),
  float64, train mode, on two random batches of 4 (NCHW) with labels in 0..9, at epoch 0 with lr 0.1 and
  the script's rules: its parameter groups (tau-ResNet: names containing ``bias1``/``bias2`` and ``tau`` at
  lr / 10; Fixup: names containing ``bias`` and ``scale`` at base_lr / 10, the rest at base_lr * batch / 128),
  momentum 0.9, no dampening or Nesterov, weight decay 1e-4 on every group, mean cross-entropy (Fixup's
  criterion with ``--alpha 0``, no mixup), and tau-ResNet's ``scale_tau_grad`` between backward and step.
  Keys: ``x1``, ``y1``, ``x2``, ``y2``, ``loss1``, ``loss2`` (the loss before each step), ``step1/<name>``
  and ``step2/<name>`` (the state_dict after each step; as the full file would be over 3 MB, only entries
  with <= 64 values, ``conv1.weight``, ``layer1.0.conv1.weight``, ``fc.*`` and the BN running statistics),
  ``meta`` (JSON: script lines, every parameter group with its names and settings, lr and weight decay per
  group, gradient scaling, loss, batch-size rule, torch version). ``--sgd-steps-only`` writes just these.
- ``fixup_lr_schedule.json``: every parameter group's learning rate at chosen epochs (the warm-up, around
  the milestones, the last) of Fixup's CIFAR script at batches 64-1024 on one device, computed by the script's
  own ``adjust_learning_rate`` (read from the checkout's ``cifar/cifar_train.py`` and run on the param groups
  its ``optim.SGD`` and ``CosineAnnealingLR`` set up: ``lr`` and ``initial_lr`` base_lr / 10 for ``bias`` and
  ``scale``, ``base_learning_rate = base_lr * batch / 128`` for the rest). Needs no torch; also written by
  ``--fixup-schedule-only``.
- ``torchvision_resnet_layouts.txt`` (when torchvision is installed): ``<model> <state_dict name> <shape>``
  for torchvision's ResNet-18/34/50/101/152, buffers included.

``--check`` (needs jax, flax and resjax importable as well: run from the repository root) prints, for
each repository model and torchvision's ResNet-18 and -50 (random weights and BN statistics, batch of 2
at 224x224), the largest difference between PyTorch and resjax in float32 and float64: logits (train and
eval), input gradients, BN running statistics after one training step (converted with
``resjax.interop.bn_counts``), relative to the largest reference value; for the models with BatchNorm the
same model with ``running_variance='unbiased'`` (``UnbiasedBatchNorm``), from one import without
``bn_count``: eval logits and the running statistics after one step (``unbiased``); and each model's
parameter count in both libraries.

The running statistics after one training step are in the fixtures already (``after/*`` of
``{name}_resnet20.npz``, ``step1/*`` and ``step2/*`` of ``{name}_sgd_steps.npz``): ``tests/test_interop.py``
checks them with ``bn_count``, ``tests/test_bn_running_variance.py`` with the unbiased option (the
state_dicts' key order, torch's, is checked against the exporter's as well).
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


def _fixture_net(args, torch, name: str):
    """The peer's ResNet-20 with the fixtures' random weights (float64) and the generator that drew them."""
    repo, filename, ctor, ctor_args, _ = PEERS[name]
    roots = {"tau-resnet": args.tau_resnet, "fixup": args.fixup}
    net = getattr(_import_peer(roots[repo], filename), ctor)(*ctor_args).double()
    gen = torch.Generator().manual_seed(1000 + list(PEERS).index(name))
    _randomise(net, torch, gen, round_weights=True)
    return net, gen


def write_fixtures(args, torch) -> None:
    os.makedirs(args.out, exist_ok=True)
    for name, (repo, filename, ctor, ctor_args, settings) in PEERS.items():
        net, gen = _fixture_net(args, torch, name)
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


# ------------------------------------------------------------------------------------- the peers' SGD steps

# How each repository's CIFAR training script trains (read from the scripts; no peer code is copied: the
# rules are restated here and ``_script_check`` confirms the checkout's script still says them).
TRAINING = {
    "tau-resnet": {
        "script": "cifar/cifar_train.py",
        "lines": {"arguments (lr 0.1, weight_decay 1e-4, batchsize 128, tau %f)": "30-33, 36, 87",
                  "loss nn.CrossEntropyLoss() (mean)": "102",
                  "parameter groups and optim.SGD(momentum=0.9, weight_decay)": "103-113",
                  "step: zero_grad, forward, loss, backward, net.module.scale_tau_grad() (try/except), step":
                      "126-135",
                  "adjust_learning_rate (epoch 0: lr = initial_lr)": "190-200, 209"},
        "signature": ("'bias1' in p[0] or 'bias2' in p[0]", "'tau' in p[0]", "args.lr/10.", "momentum=0.9",
                      "weight_decay=args.weight_decay", "scale_tau_grad()", "nn.CrossEntropyLoss()"),
    },
    "fixup": {
        "script": "cifar/cifar_train.py",
        "lines": {"arguments (alpha 1 = mixup, decay 1e-4, batchsize 128 per GPU, base_lr 0.1)": "35-40",
                  "base_learning_rate = base_lr * batchsize / 128 (times the GPU count)": "54-59",
                  "mixup soft-target criterion": "112, utils.py:18-38, 53-54",
                  "parameter groups and optim.SGD(momentum=0.9, weight_decay)": "113-122",
                  "step: mixup_data, zero_grad, forward, loss, backward, step": "135-142",
                  "adjust_learning_rate (epoch 0; warm-up only when base_learning_rate > 0.1)": "197-219, 236",
                  "CosineAnnealingLR built (sets initial_lr) whether or not --sgdr": "226"},
        "signature": ("'bias' in p[0]", "'scale' in p[0]", "args.base_lr/10.", "args.batchsize / 128.",
                      "momentum=0.9", "weight_decay=args.decay", "CosineAnnealingLR(optimizer"),
    },
}
BASE_LR, WEIGHT_DECAY, MOMENTUM = 0.1, 1e-4, 0.9  # both scripts' defaults


def _script_check(root: str, repo: str) -> str | None:
    """The training script's path if it is found and still reads as TRAINING says, else None."""
    for candidate in (os.path.join(root, "cifar", "cifar_train.py"), os.path.join(root, "..", "cifar_train.py"),
                      os.path.join(root, "cifar_train.py")):
        if os.path.exists(candidate):
            with open(candidate) as f:
                text = f.read()
            missing = [s for s in TRAINING[repo]["signature"] if s not in text]
            if missing:
                raise SystemExit(f"{candidate} no longer reads as TRAINING[{repo!r}] says (missing {missing})")
            return os.path.abspath(candidate)
    print(f"warning: {repo} cifar_train.py not found near {root}; its training rules are taken as read")
    return None


def _peer_optimizer(repo: str, net, torch, batch: int):
    """The optimiser of ``repo``'s CIFAR training script at epoch 0, for a batch of ``batch`` on one device."""
    named = list(net.named_parameters())
    if repo == "tau-resnet":
        is_bias = lambda n: "bias1" in n or "bias2" in n  # noqa: E731 (the script's substring rules)
        is_tau = lambda n: "tau" in n  # noqa: E731
        groups = [("bias", is_bias, BASE_LR / 10), ("tau", is_tau, BASE_LR / 10),
                  ("others", lambda n: not (is_bias(n) or is_tau(n)), None)]  # others: SGD's lr=args.lr
        default_lr = BASE_LR
        batch_rule = "none: lr 0.1 whatever --batchsize"
    else:
        n_gpu = 1
        base_learning_rate = BASE_LR * batch / 128.0 * n_gpu
        is_bias = lambda n: "bias" in n  # noqa: E731
        is_scale = lambda n: "scale" in n  # noqa: E731
        # the bias and scale groups get base_lr / 10 as given, NOT scaled by batch / 128
        groups = [("bias", is_bias, BASE_LR / 10), ("scale", is_scale, BASE_LR / 10),
                  ("others", lambda n: not (is_bias(n) or is_scale(n)), None)]
        default_lr = base_learning_rate
        batch_rule = (f"base_learning_rate = base_lr * batchsize / 128 * n_gpu = {BASE_LR} * {batch} / 128 * "
                      f"{n_gpu} = {base_learning_rate!r} for the 'others' group only; bias and scale groups "
                      f"base_lr / 10 = {BASE_LR / 10!r} unscaled; epoch-0 warm-up lr 0.1 only when "
                      "base_learning_rate > 0.1")
    spec = []
    for label, rule, lr in groups:
        entry = {"params": [p for n, p in named if rule(n)]}
        if lr is not None:
            entry["lr"] = lr
        if repo == "tau-resnet":
            entry["initial_lr"] = BASE_LR if lr is None else lr
        spec.append(entry)
    optimizer = torch.optim.SGD(spec, lr=default_lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if repo == "tau-resnet":  # adjust_learning_rate(optimizer, 0): lr = initial_lr / 1
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] / 1.0
    else:
        # the script builds CosineAnnealingLR (which sets initial_lr = lr in every group) even without --sgdr,
        # then adjust_learning_rate(optimizer, 0)
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 200, eta_min=0, last_epoch=-1)
        lr = base_learning_rate
        if lr > 0.1:  # epoch 0 of the warm-up: 0.1 + (base_learning_rate - 0.1) * 0 / 10
            lr = 0.1 + (base_learning_rate - 0.1) * 0 / 10.0
        for group in optimizer.param_groups:
            if group["initial_lr"] == base_learning_rate:
                group["lr"] = lr
            else:  # epoch <= 9
                group["lr"] = group["initial_lr"] * lr / base_learning_rate
    names = {id(p): n for n, p in named}
    described = []
    for (label, _, _), group in zip(groups, optimizer.param_groups):
        described.append({"group": label, "names": [names[id(p)] for p in group["params"]],
                          **{k: v for k, v in group.items() if k != "params"}})
    assert sum(len(g["names"]) for g in described) == len(named), "parameter groups overlap or miss a parameter"
    return optimizer, described, batch_rule


def _peer_loss(repo: str, logits, y, torch):
    if repo == "tau-resnet":  # nn.CrossEntropyLoss(): mean over the batch
        return torch.nn.functional.cross_entropy(logits, y)
    # Fixup's soft-target criterion with --alpha 0 (ERM: lam = 1 for y, 1 - lam = 0 for y[index]); the
    # second term is exactly zero, so this is the mean cross-entropy
    log_p = torch.nn.functional.log_softmax(logits, dim=1)

    def criterion(target, lam):
        return (-log_p * torch.zeros(logits.size(), dtype=logits.dtype).scatter_(1, target.view(-1, 1),
                                                                               lam.view(-1, 1))).sum(dim=1).mean()

    lam = torch.ones(y.size(), dtype=logits.dtype)
    return criterion(y, lam) + criterion(y, 1 - lam)


def write_sgd_steps(args, torch) -> None:
    """``{name}_sgd_steps.npz``: two SGD steps of each peer's training script from the fixture weights."""
    os.makedirs(args.out, exist_ok=True)
    roots = {"tau-resnet": args.tau_resnet, "fixup": args.fixup}
    small = {"conv1.weight", "layer1.0.conv1.weight", "fc.weight", "fc.bias"}
    for i, (name, (repo, filename, ctor, ctor_args, settings)) in enumerate(PEERS.items()):
        script = _script_check(roots[repo], repo)
        net, _ = _fixture_net(args, torch, name)
        start = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
        existing = os.path.join(args.out, f"{name}_resnet20.npz")
        if os.path.exists(existing):  # the steps start from exactly the weights in sd/* of that fixture
            with np.load(existing) as f:
                stored = {k[3:]: f[k] for k in f.files if k.startswith("sd/")}
            bad = [k for k, v in start.items() if k not in stored or not np.array_equal(stored[k].astype(v.dtype), v)]
            if bad or set(stored) != set(start):
                raise SystemExit(f"{name}: the starting weights differ from sd/* of {existing}: {bad[:5]}")
            same_start = f"sd/* of {name}_resnet20.npz (checked equal)"
        else:
            same_start = f"sd/* of {name}_resnet20.npz (not present to check)"
        gen = torch.Generator().manual_seed(4000 + i)
        batches = [(torch.randn((BATCH, 3, 32, 32), generator=gen, dtype=torch.float64),
                    torch.randint(0, 10, (BATCH,), generator=gen)) for _ in range(2)]
        optimizer, groups, batch_rule = _peer_optimizer(repo, net, torch, BATCH)
        scaled = hasattr(net, "scale_tau_grad")
        out, losses = {}, []
        for step, (x, y) in enumerate(batches, 1):
            net.train()
            optimizer.zero_grad()
            logits = net(x)
            loss = _peer_loss(repo, logits, y, torch)
            loss.backward()
            if scaled:  # tau-ResNet: net.module.scale_tau_grad() between backward and step (see TRAINING)
                net.scale_tau_grad()
            missing = [n for n, p in net.named_parameters() if p.grad is None]
            assert not missing, f"{name}: no gradient for {missing} (SGD would skip them, weight decay too)"
            optimizer.step()
            losses.append(loss.item())
            out[f"x{step}"], out[f"y{step}"], out[f"loss{step}"] = x.numpy(), y.numpy(), np.float64(loss.item())
            for k, v in net.state_dict().items():
                out[f"step{step}/{k}"] = v.detach().numpy().copy()
        meta = {
            "repository_model": name, "depth": 20, "peer": f"{repo}:{filename}:{ctor}{ctor_args}",
            "resjax": settings, "torch": torch.__version__, "batch": BATCH, "start": same_start,
            "script": TRAINING[repo]["script"], "script_found": script is not None,
            "script_lines": TRAINING[repo]["lines"],
            "optimizer": "torch.optim.SGD (coupled weight decay: d = g + wd * p; first step buf = d, no "
                         "dampening; then buf = momentum * buf + (1 - dampening) * d; p -= lr * buf)",
            "param_groups": groups, "momentum": MOMENTUM, "nesterov": False, "dampening": 0.0,
            "weight_decay": {g["group"]: g["weight_decay"] for g in groups},
            "lr": {g["group"]: g["lr"] for g in groups},
            "grad_scaling": ("tau.grad /= num_layers (9) by the model's scale_tau_grad() after backward, before "
                             "step (the script calls net.module.scale_tau_grad() in try/except: it runs only "
                             "under DataParallel, i.e. on CUDA; on CPU it is silently skipped)") if scaled else
                            "none (no scale_tau_grad on this model)" if repo == "tau-resnet" else "none",
            "loss": "nn.CrossEntropyLoss() (mean over the batch)" if repo == "tau-resnet" else
                    "the script's soft-target criterion with --alpha 0 (no mixup; the default --alpha 1 mixes "
                    "inputs and targets at random): mean cross-entropy",
            "batch_rule": batch_rule, "epoch": 0, "train_mode": True, "gradient_clipping": "none",
            "losses": losses,
        }
        path = os.path.join(args.out, f"{name}_sgd_steps.npz")
        meta["stored"] = "every state_dict entry after each step"
        np.savez_compressed(path, **out, meta=np.asarray(json.dumps(meta)))
        if os.path.getsize(path) > 3e6:
            keep = {k for k, v in start.items()
                    if v.size <= 64 or k in small or k.endswith(("running_mean", "running_var"))}
            out = {k: v for k, v in out.items() if not k.startswith("step") or k.split("/", 1)[1] in keep}
            meta["stored"] = ("after each step: state_dict entries with <= 64 values, conv1.weight, "
                              "layer1.0.conv1.weight, fc.weight, fc.bias and all BN running statistics")
            np.savez_compressed(path, **out, meta=np.asarray(json.dumps(meta)))
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB; losses {losses[0]:.6f} {losses[1]:.6f}; "
              f"lr {meta['lr']}; start {same_start})")


FIXUP_SCHEDULE_BATCHES = (64, 128, 256, 512, 1024)
FIXUP_SCHEDULE_EPOCHS = tuple(range(0, 13)) + (50, 98, 99, 100, 101, 148, 149, 150, 151, 199)


def _fixup_adjust_learning_rate(root: str):
    """The Fixup script's ``adjust_learning_rate`` as a function of (base_learning_rate, optimizer, epoch): its
    own source (``ast``), run with the script's module-level ``base_learning_rate`` given per call."""
    import ast

    path = _script_check(root, "fixup")
    if path is None:
        raise SystemExit(f"--fixup {root}: cifar/cifar_train.py not found (the schedule is computed by its function)")
    with open(path) as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "adjust_learning_rate")
    code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec")

    def run(base_learning_rate: float, optimizer, epoch: int) -> float:
        namespace = {"base_learning_rate": base_learning_rate}
        exec(code, namespace)  # noqa: S102  (the peer's own function, from the checkout)
        return namespace["adjust_learning_rate"](optimizer, epoch)

    return run, path, node.lineno, node.end_lineno


def write_fixup_schedule(args) -> None:
    """``fixup_lr_schedule.json``: each group's rate per epoch, from the Fixup script's own function."""
    run, path, first, last = _fixup_adjust_learning_rate(args.fixup)

    class Optimizer:  # what the function reads and writes: param_groups' 'lr' and 'initial_lr'
        def __init__(self, groups):
            self.param_groups = groups

    out = {}
    for batch in FIXUP_SCHEDULE_BATCHES:
        base = BASE_LR * batch / 128.0  # base_learning_rate = args.base_lr * args.batchsize / 128. (n_gpu = 1)
        # optim.SGD([bias lr base_lr/10, scale lr base_lr/10, others], lr=base_learning_rate); CosineAnnealingLR
        # (built whether or not --sgdr) sets initial_lr = lr in every group
        groups = [{"lr": BASE_LR / 10.0}, {"lr": BASE_LR / 10.0}, {"lr": base}]
        for g in groups:
            g["initial_lr"] = g["lr"]
        optimizer = Optimizer(groups)
        rows = {"bias": [], "scale": [], "others": [], "returned": []}
        for epoch in FIXUP_SCHEDULE_EPOCHS:
            rows["returned"].append(run(base, optimizer, epoch))
            for label, g in zip(("bias", "scale", "others"), optimizer.param_groups):
                rows[label].append(g["lr"])
        out[str(batch)] = {"base_learning_rate": base, **rows}
    meta = {"script": "cifar/cifar_train.py", "function": f"adjust_learning_rate, lines {first}-{last}",
            "base_lr": BASE_LR, "n_gpu": 1, "epochs": list(FIXUP_SCHEDULE_EPOCHS),
            "groups": "bias: names containing 'bias'; scale: names containing 'scale'; others: the rest",
            "note": "each group's 'lr' after adjust_learning_rate(optimizer, epoch), called at the start of each epoch"}
    os.makedirs(args.out, exist_ok=True)
    target = os.path.join(args.out, "fixup_lr_schedule.json")
    with open(target, "w") as f:
        json.dump({"meta": meta, "batches": out}, f, indent=1)
        f.write("\n")
    print(f"wrote {target} (from {path}, lines {first}-{last})")


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
        # PyTorch's running-variance convention: one import gives the eval logits and the update at once
        from resjax.nn.norms import UnbiasedBatchNorm

        unbiased = model.clone(norm=UnbiasedBatchNorm)
        with jax.enable_x64(dtype == np.float64):
            plain = interop.from_torch_state_dict(unbiased, sd, dtype=dtype)
            lu, _, _ = _resjax_run(unbiased, plain, xt.numpy(), rt.numpy(), False)
            _, _, state_u = _resjax_run(unbiased, plain, xt.numpy(), rt.numpy(), True)
        back = interop.to_torch_state_dict({**plain, **state_u}, unbiased)
        diffs["unbiased"] = (f"logits_eval {_fmt(lu, logits_e)} bn_stats "
                             f"{max(_rel(back[k], after[k]) for k in keys):.1e}")
        diffs["key_order"] = "torch's" if list(back) == list(sd) else "DIFFERS"
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
    parser.add_argument("--tau-resnet", help="dayu11/tau-ResNet checkout (or its cifar/models); required but with "
                                             "--fixup-schedule-only")
    parser.add_argument("--fixup", required=True, help="hongyi-zhang/Fixup checkout (or its cifar/models)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "parity"))
    parser.add_argument("--check", action="store_true", help="also print resjax's agreement (needs jax and resjax)")
    parser.add_argument("--no-write", action="store_true", help="only --check; write no fixtures")
    parser.add_argument("--sgd-steps-only", action="store_true",
                        help="write only the {name}_sgd_steps.npz files (checked against the existing fixtures)")
    parser.add_argument("--torchvision-depths", type=int, nargs="*", default=[18, 50])
    parser.add_argument("--fixup-schedule-only", action="store_true",
                        help="write only fixup_lr_schedule.json (from the Fixup script's own function; no torch)")
    args = parser.parse_args(argv)
    if args.fixup_schedule_only:
        write_fixup_schedule(args)
        return
    if not args.tau_resnet:
        parser.error("--tau-resnet is required (but with --fixup-schedule-only)")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.sgd_steps_only:
        write_sgd_steps(args, torch)
    elif not args.no_write:
        write_fixtures(args, torch)
        write_sgd_steps(args, torch)
        write_fixup_schedule(args)
        write_torchvision_layouts(args, torch)
    if args.check:
        check(args, torch)


if __name__ == "__main__":
    main()
