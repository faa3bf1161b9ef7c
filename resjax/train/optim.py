"""Optimisers: ``make_optimizer(config, params, steps_per_epoch)``, any optax optimiser by name or as an object.

The update is one ``optax.chain``, wrapped in ``optax.inject_hyperparams`` so that the learning rate and
the weight decay live in the optimiser state (``opt_state.hyperparams``) and may differ between the seeds
of one vmapped program (``hparams``). ``make_optimizer(..., traced=('momentum',))`` injects more of the
optimiser's settings the same way (``TRACEABLE``: ``momentum`` of the SGD family, ``adam_b1`` and ``adam_b2``
of 'adam'), so that a grid over them is one program too (``resjax.train.grid``); left out (the default), the
setting is a constant of the program, exactly as before. A traced momentum gives the same numbers as the
constant (``buf = momentum * buf + g``, one float32 product either way; a traced momentum of 0 keeps a
buffer equal to the gradient, so the update is plain SGD's); traced Adam betas compute ``1 - b1`` in the
parameters' dtype where the constant is rounded once from Python's double, so they agree with a constant-beta
run to float rounding, not bit for bit.

  1. ``grad_clip_norm > 0``: clip the gradient to that global norm (``clip_grad_norm_`` before ``step``);
  2. coupled L2 weight decay, ``g + weight_decay * f_wd * w``, added to the gradient as ``torch.optim.SGD``
     (and ``Adam``) do with ``weight_decay`` -- for every optimiser that has no weight decay of its own;
  3. the direction: the built-in names below, or ``optax.<optimizer>(learning_rate=rate, **optimizer_args)``;
  4. the learning rate ``rate`` (``resjax.train.schedules``: ``learning_rate`` times the schedule, in the
     parameters' float dtype -- float64 under ``jax_enable_x64``);
  5. each parameter group's learning-rate factor ``f_lr`` (below).

``train.optimizer``:

  'sgd'        ``buf = momentum * buf + g`` (no dampening), the update ``buf`` or with ``nesterov``
               ``g + momentum * buf``: exactly ``torch.optim.SGD`` (plain SGD when ``momentum`` is 0)
  'momentum'   'sgd' that needs ``momentum > 0``; 'nesterov': 'sgd' with ``nesterov=True``
  'adam'       ``optax.scale_by_adam(adam_b1, adam_b2, adam_eps)``: ``torch.optim.Adam`` with its coupled
               ``weight_decay``
  any other    the optax optimiser of that name (``adamw``, ``lamb``, ``lars``, ``lion``, ``rmsprop``,
               ``adagrad``, ``nadamw``, ``adan``, ...) called with ``learning_rate=rate`` and
               ``train.optimizer_args`` (a dict of its other arguments: ``dict(b2=0.95)``). One that takes a
               ``weight_decay`` (adamw, lamb, lars, lion, ...) gets ``train.weight_decay`` there -- its own,
               decoupled decay, exactly optax's (AdamW's ``w -= rate * (adam + weight_decay * w)``) -- and,
               through its ``mask`` / ``weight_decay_mask``, which parameters decay; the others get the
               coupled L2 of step 2, as PyTorch's ``weight_decay`` does.

Parameter groups (``train.param_groups``, PyTorch's ``param_groups``): a tuple of rules, each a dict
``dict(match=REGEX | rank=R | where=FN, lr_factor=1.0, weight_decay_factor=...)`` or a preset's name
(``PARAM_GROUP_PRESETS``). A rule selects the parameters whose path (``'stage1/block0/conv1/kernel'``)
``re.search``-es ``match``, whose rank (number of axes) is ``rank`` (an int or a tuple of them), or for
which ``where(path, leaf)`` is true (a function: through the API's ``param_groups=``, not in a config, which
must stay JSON), and gives them ``lr_factor`` times the learning rate and ``weight_decay_factor`` times the
weight decay (default: what ``weight_decay_on`` says). The first rule that selects a parameter decides it;
a rule that selects nothing is refused (a misspelt name would otherwise change nothing). ``weight_decay_on``
sets the default weight-decay factor: 'all' (PyTorch's default: every parameter, BatchNorm scales and
biases and scalars included, as the tau-ResNet and Fixup repositories train) or 'kernels' (leaves named
``kernel`` only). ``scalar_lr_factor`` (default 1.0) is shorthand for a last rule ``dict(rank=0,
lr_factor=scalar_lr_factor)``.

Presets (the peers' training rules, parity-tested against their own training steps at float64):

  'tau_resnet'   dayu11/tau-ResNet: its scalars (tau) at lr/10 -- ``dict(rank=0, lr_factor=0.1)``
  'fixup'        hongyi-zhang/Fixup ``cifar_train.py``: every parameter whose name holds ``bias`` or
                 ``scale`` (the scalar biases and multipliers and the classifier's bias) at lr/10.
                 Fixup's script also multiplies the base rate, and only the base rate, by ``batch/128``:
                 ``fixup_param_groups(batch_size)`` gives that rule's group for another batch size
                 (``learning_rate = 0.1 * batch / 128`` with it keeps the bias/scale rate at 0.01). Above
                 batch 128 the script also warms up over its first 10 epochs (schedule ``'fixup'``,
                 ``resjax.train.schedules``); ``fixup_recipe(batch_size)`` gives every setting of the script's
                 recipe at once: ``image_train_config(**fixup_recipe(256))``.

Your own optimiser: ``make_optimizer(..., optimizer=tx)`` (and ``make_train`` / ``make_image_train``'s
``optimizer=``) takes an ``optax.GradientTransformation``, used as the direction and rate together (steps
1, 2 and 5 still apply: clipping, coupled L2 when ``weight_decay > 0`` -- set it to 0 to leave the decay to
your transformation -- and the groups' factors); or a factory ``f(learning_rate) -> GradientTransformation``
that receives resjax's schedule (a function of the step, the per-seed rate inside) -- so ``hparams`` may
still vary the learning rate. With a transformation given as an object, the rate is its own: ``hparams``
may not vary ``learning_rate`` and the history's ``lr`` is NaN.

Masks and factors are functions of the parameter tree's paths and ranks, so the same transformation works
inside ``jax.vmap`` over seeds. For plain SGD one step is ``w <- w - lr * f_lr * (g + wd * f_wd * w)``.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from resjax.train.schedules import _as_dict, _get, check_schedule, make_schedule

__all__ = ["BUILTIN_OPTIMIZERS", "PARAM_GROUP_PRESETS", "TRACEABLE", "WEIGHT_DECAY_ON", "check_optimizer",
           "check_param_groups", "fixup_param_groups", "fixup_recipe", "group_factors", "kernel_mask", "make_optimizer",
           "optax_optimizer", "param_path", "scalar_mask", "traceable"]

#: The optimisers resjax builds itself (PyTorch's exact update rules); every other name is optax's.
BUILTIN_OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam")
#: The values of ``train.weight_decay_on``.
WEIGHT_DECAY_ON = ("all", "kernels")
#: The optimiser settings ``make_optimizer(..., traced=...)`` can inject besides the learning rate and the weight
#: decay (always injected), with the built-in optimisers that use each.
TRACEABLE = {"momentum": ("sgd", "momentum", "nesterov"), "adam_b1": ("adam",), "adam_b2": ("adam",)}
#: optax names that are not a ``learning_rate -> GradientTransformation`` optimiser usable here.
_REFUSED = {"lbfgs": "its update needs the loss function (value_fn), which a training step does not pass",
            "polyak_sgd": "its update needs the loss value, which a training step does not pass",
            "noisy_sgd": "it draws its own random numbers from a fixed seed, outside the run's key"}
#: The keys a parameter-group rule may have.
_RULE_KEYS = ("match", "rank", "where", "lr_factor", "weight_decay_factor")


def fixup_param_groups(batch_size: int = 128) -> tuple[dict, ...]:
    """Fixup's ``cifar_train.py`` rule for ``batch_size``: parameters whose name holds ``bias`` or ``scale``
    train at ``0.1 * base`` while the base rate is multiplied by ``batch_size / 128``, i.e. a group factor of
    ``0.1 * 128 / batch_size`` relative to ``learning_rate = base * batch_size / 128``."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
    return (dict(match=r"bias|scale", lr_factor=0.1 * 128 / batch_size),)


def fixup_recipe(batch_size: int = 128) -> dict[str, Any]:
    """The training settings of Fixup's ``cifar/cifar_train.py`` (without mixup) at ``batch_size`` on one device,
    for ``image_train_config(**fixup_recipe(batch_size))``: SGD with momentum 0.9 and weight decay 1e-4 on every
    parameter, base rate ``0.1 * batch_size / 128`` with the bias and scale parameters at 0.01
    (``fixup_param_groups``), and the ``'fixup'`` schedule: divided by 10 at epochs 100 and 150 of 200 and,
    above batch 128, the script's warm-up (epochs 0-9 from 0.1 up to the base rate, each group scaled alike).
    Every group's rate equals the script's at every epoch (``tests/test_peer_training.py``). The epochs are those
    of the data the trainer is given (``resjax.train.schedules``): on a subset, the warm-up and the decays come
    after proportionally fewer steps than the script's runs on all of CIFAR-10."""
    groups = fixup_param_groups(batch_size)  # checks batch_size
    return dict(batch_size=batch_size, learning_rate=0.1 * batch_size / 128, param_groups=groups, schedule="fixup",
                milestones=(100, 150), decay_factor=0.1, momentum=0.9, weight_decay=1e-4, weight_decay_on="all",
                epochs=200)


#: Named parameter-group rules (see the module docstring).
PARAM_GROUP_PRESETS: dict[str, tuple[dict, ...]] = {
    "tau_resnet": (dict(rank=0, lr_factor=0.1),),
    "fixup": fixup_param_groups(128),
}


def param_path(path: tuple) -> str:
    """A key path of ``jax.tree_util`` as ``'a/b/c'`` (dict keys, attribute names, sequence indices)."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def _is_kernel(path: tuple) -> bool:
    return getattr(path[-1], "key", None) == "kernel"


def kernel_mask(params: Any) -> Any:
    """True for leaves named ``kernel`` (Dense and Conv weights)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_kernel(path), params)


def scalar_mask(params: Any) -> Any:
    """True for 0-d leaves (Fixup scalars, SkipInit alpha, learnable tau)."""
    return jax.tree_util.tree_map(lambda p: p.ndim == 0, params)


def optax_optimizer(name: str) -> Callable[..., optax.GradientTransformation]:
    """The optax optimiser ``optax.<name>`` (a function taking ``learning_rate``); ``ValueError`` naming
    ``optimizer`` when there is none usable by that name."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"optimizer: must be an optimiser's name, got {name!r}")
    if name in _REFUSED:
        raise ValueError(f"optimizer: optax.{name} cannot train here: {_REFUSED[name]}")
    fn = getattr(optax, name, None)
    params = _parameters(fn)
    if params is None or not params or params[0] != "learning_rate":
        known = ", ".join(BUILTIN_OPTIMIZERS + ("adamw", "lamb", "lars", "lion", "rmsprop", "adagrad", "..."))
        raise ValueError(f"optimizer: unknown optimizer {name!r}; choose a built-in or optax optimiser ({known})")
    return fn


def _parameters(fn) -> list[str] | None:
    if not callable(fn) or inspect.isclass(fn) or inspect.ismodule(fn):
        return None
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _decay_argument(fn) -> tuple[str | None, str | None]:
    """``(weight-decay argument, its mask argument)`` of an optax optimiser (None when it has none)."""
    params = _parameters(fn) or []
    wd = "weight_decay" if "weight_decay" in params else None
    mask = next((m for m in ("mask", "weight_decay_mask") if m in params), None) if wd else None
    return wd, mask


def _number(config, field, default, low=0.0, high=None, low_open=False) -> None:
    v = _get(config, field, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > low if low_open else v >= low) and (high is None or v < high)
    if not ok:
        span = f"{'>' if low_open else '>='} {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{field}: must be a finite number {span}, got {v!r}")


def check_optimizer(config: Any) -> None:
    """Raise ``ValueError`` naming the first bad optimiser setting of ``config`` (a ``train_config``, or any
    mapping or object with its fields): unknown optimisers and arguments, ranges, parameter-group rules."""
    name = _get(config, "optimizer", "sgd")
    args = _as_dict(_get(config, "optimizer_args", None))
    if name in BUILTIN_OPTIMIZERS:
        if args:
            raise ValueError(f"optimizer_args: the built-in {name!r} takes its settings from train.momentum, "
                             f"nesterov, adam_b1, ... (got {sorted(args)}); optimizer_args is for optax's optimisers")
        if name in ("sgd", "momentum", "nesterov"):
            _number(config, "momentum", 0.9, 0.0, 1.0)
            if (name == "nesterov" or _get(config, "nesterov", False)) and not _get(config, "momentum", 0.9):
                raise ValueError("nesterov: needs momentum > 0")
            if name == "momentum" and not _get(config, "momentum", 0.9):
                raise ValueError("momentum: optimizer 'momentum' needs momentum > 0")
        else:
            _number(config, "adam_b1", 0.9, 0.0, 1.0)
            _number(config, "adam_b2", 0.999, 0.0, 1.0)
            _number(config, "adam_eps", 1e-8, 0.0, low_open=True)
    else:
        fn = optax_optimizer(name)
        params = _parameters(fn)
        wd, mask = _decay_argument(fn)
        own = {"learning_rate", *(p for p in (wd, mask) if p)}
        for key in args:
            if key in own:
                raise ValueError(f"optimizer_args.{key}: set by resjax (train.learning_rate, train.weight_decay, "
                                 "train.param_groups / weight_decay_on); leave it out of optimizer_args")
            if key not in params:
                raise ValueError(f"optimizer_args.{key}: optax.{name} has no argument {key!r}; its arguments: "
                                 f"{', '.join(p for p in params if p not in own)}")
    for field in ("weight_decay", "grad_clip_norm", "scalar_lr_factor"):
        _number(config, field, 1.0 if field == "scalar_lr_factor" else 0.0)
    on = _get(config, "weight_decay_on", "all")
    if on not in WEIGHT_DECAY_ON:
        raise ValueError(f"weight_decay_on: unknown choice {on!r}; choose one of {WEIGHT_DECAY_ON}")
    check_param_groups(_get(config, "param_groups", ()), allow_functions=False)


def traceable(config: Any, optimizer: Any = None) -> tuple[str, ...]:
    """The names of ``TRACEABLE`` that ``config``'s optimiser uses (none for your own ``optimizer`` or an optax
    optimiser by name, whose arguments are constants: a grid over them runs one program per value)."""
    if optimizer is not None:
        return ()
    name = _get(config, "optimizer", "sgd")
    return tuple(k for k, names in TRACEABLE.items() if name in names)


def _rules(groups: Any) -> list[tuple[str, dict, bool]]:
    """``groups`` (rules and preset names) as ``[(label, rule, own)]``, presets expanded (``own`` False for a
    preset's rules, which may select nothing)."""
    if groups is None:
        return []
    if isinstance(groups, (str, Mapping)):
        groups = (groups,)
    out = []
    for i, g in enumerate(groups):
        if isinstance(g, str):
            if g not in PARAM_GROUP_PRESETS:
                raise ValueError(f"param_groups[{i}]: unknown preset {g!r}; presets: {sorted(PARAM_GROUP_PRESETS)}")
            out += [(f"param_groups[{i}] ({g!r})", dict(r), False) for r in PARAM_GROUP_PRESETS[g]]
        elif isinstance(g, Mapping):
            out.append((f"param_groups[{i}]", dict(g), True))
        else:
            raise ValueError(f"param_groups[{i}]: must be a dict rule or a preset name, got {g!r}")
    return out


def check_param_groups(groups: Any, allow_functions: bool = True) -> None:
    """Raise ``ValueError`` naming the rule when a parameter-group rule is malformed (see the module docstring)."""
    for label, rule, _ in _rules(groups):
        unknown = set(rule) - set(_RULE_KEYS)
        if unknown:
            raise ValueError(f"{label}: unknown keys {sorted(unknown)}; a rule has {_RULE_KEYS}")
        selectors = [k for k in ("match", "rank", "where") if rule.get(k) is not None]
        if len(selectors) != 1:
            raise ValueError(f"{label}: give exactly one of match (a regex), rank (an int) or where (a function), "
                             f"got {selectors or 'none'}")
        if "match" in selectors:
            try:
                re.compile(rule["match"])
            except (re.error, TypeError) as e:
                raise ValueError(f"{label}.match: not a regular expression ({e}): {rule['match']!r}") from None
        if "rank" in selectors:
            ranks = rule["rank"] if isinstance(rule["rank"], (tuple, list)) else (rule["rank"],)
            if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
                raise ValueError(f"{label}.rank: must be an integer >= 0 or a tuple of them, got {rule['rank']!r}")
        if "where" in selectors and not allow_functions:
            raise ValueError(f"{label}.where: a function goes through the API's param_groups= (a config stays JSON)")
        if "where" in selectors and not callable(rule["where"]):
            raise ValueError(f"{label}.where: must be callable, got {rule['where']!r}")
        for key in ("lr_factor", "weight_decay_factor"):
            v = rule.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                      and v >= 0):
                raise ValueError(f"{label}.{key}: must be a finite number >= 0, got {v!r}")


def group_factors(params: Any, groups: Any = (), weight_decay_on: str = "all",
                  scalar_lr_factor: float = 1.0) -> tuple[Any, Any]:
    """``(lr_factors, weight_decay_factors)``: trees of Python floats like ``params``, from the parameter-group
    rules ``groups`` (see the module docstring; ``ValueError`` naming a rule that selects nothing)."""
    rules = _rules(groups)
    if scalar_lr_factor != 1.0:
        rules.append(("scalar_lr_factor", dict(rank=0, lr_factor=float(scalar_lr_factor)), False))
    used = [False] * len(rules)

    def factors(path, leaf):
        name, rank = param_path(path), len(leaf.shape)
        wd = 1.0 if weight_decay_on == "all" or _is_kernel(path) else 0.0
        for i, (_, rule, _) in enumerate(rules):
            ranks = rule.get("rank")
            ranks = ranks if isinstance(ranks, (tuple, list)) else (ranks,)
            if ((rule.get("match") is not None and re.search(rule["match"], name))
                    or (rule.get("rank") is not None and rank in ranks)
                    or (rule.get("where") is not None and rule["where"](name, leaf))):
                used[i] = True
                f_wd = rule.get("weight_decay_factor")
                return float(rule.get("lr_factor", 1.0)), wd if f_wd is None else float(f_wd)
        return 1.0, wd

    pairs = jax.tree_util.tree_map_with_path(factors, params)
    for (label, _, own), u in zip(rules, used):  # a preset may select nothing (tau-ResNet with BN has no scalars)
        if own and not u:
            raise ValueError(f"{label}: selects no parameter of this model")
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    return (jax.tree_util.tree_map(lambda p: p[0], pairs, is_leaf=is_pair),
            jax.tree_util.tree_map(lambda p: p[1], pairs, is_leaf=is_pair))


def _scale_leaves(factors_of: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Multiply each update leaf by its factor (``factors_of(updates)``: a tree of floats); leaves at 1.0
    are left as they are (no multiply)."""
    def update(updates, state, params=None):
        factors = factors_of(updates)
        return jax.tree_util.tree_map(lambda u, f: u if f == 1.0 else u * f, updates, factors), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _coupled_decay(weight_decay, factors_of: Callable[[Any], Any]) -> optax.GradientTransformation:
    """``g + weight_decay * f * w`` per leaf (``f`` its weight-decay factor; leaves at 0 untouched)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight_decay: the optimiser's update needs the parameters")
        factors = factors_of(updates)

        def one(g, w, f):
            if f == 0.0:
                return g
            return g + (weight_decay if f == 1.0 else weight_decay * f) * w

        return jax.tree_util.tree_map(one, updates, params, factors), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


#: How a factory composes a schedule of its own with resjax's rate (``check_factory``'s refusal, the grid tutorial).
OWN_SCHEDULE = ("for a schedule of your own, set train.schedule='constant' and multiply it in: optimizer=lambda lr: "
                "optax.adamw(lambda step: lr(step) * optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 60)(step))")


def check_factory(factory: Callable, rate: Callable) -> None:
    """Call the optimiser factory ``factory`` once, as training will, with resjax's learning rate ``rate`` (a
    schedule: a function of the step), before anything is built: a factory that cannot take a function (one that
    hands the rate to an optax schedule as its peak, or does arithmetic on it) or that returns no
    ``GradientTransformation`` is refused in one line that says what it receives."""
    receives = ("optimizer: your factory f(learning_rate) is called with resjax's learning rate, a schedule (a "
                "function of the step: train.learning_rate x train.schedule, the run's own rate where hparams "
                "vary it), which optax optimisers take as their learning_rate")
    try:
        out = factory(rate)
    except Exception as err:  # noqa: BLE001  (the user's code: refused with what it was given)
        raise ValueError(f"{receives}; it raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}."
                         f" Hand it to the optimiser as it is (lambda lr: optax.adamw(lr)); {OWN_SCHEDULE}") from err
    if not isinstance(out, optax.GradientTransformation):
        raise ValueError(f"{receives}; it returned {type(out).__name__}, not an optax.GradientTransformation")


def make_optimizer(config: Any, params: Any = None, steps_per_epoch: int = 1, *,
                   optimizer: optax.GradientTransformation | Callable | None = None,
                   schedule: Callable | None = None, param_groups: Any = None,
                   traced: Any = (), warn: bool = True) -> optax.GradientTransformation:
    """The optax transformation for ``config`` (see the module docstring).

    The learning rate and the weight decay are ``optax.inject_hyperparams`` values: they live in the
    optimiser state (``opt_state.hyperparams['learning_rate' | 'weight_decay']``), start at the config's,
    and a seed-vmapped run may set them per seed (``resjax.train.core.with_hyperparams``). The rate at a step
    is ``make_schedule(config, steps_per_epoch, learning_rate, schedule)`` of the optimiser's own step count.

    ``params``: one seed's parameter tree (or its shapes); the groups' factors are checked against it (a rule
    selecting nothing, ``weight_decay_on='kernels'`` with no ``kernel``). ``optimizer``: your own
    transformation or factory (module docstring); ``schedule``: a learning-rate multiplier function of the step
    (``resjax.train.schedules``); ``param_groups``: rules added before the config's (they may hold ``where``
    functions); ``traced``: names of ``TRACEABLE`` to inject as well (``opt_state.hyperparams[name]``, starting
    at the config's value; ``ValueError`` naming one the optimiser does not use). ``warn=False``: the schedule's
    warnings (milestones past the run's end) left out, where the config was checked, and warned about, already.
    """
    check_optimizer(config)
    traced = tuple(traced)
    usable = traceable(config, optimizer)
    for t in traced:
        if t not in usable:
            own = _get(config, "optimizer", "sgd")
            why = (f"its optimizer {own!r} has no {t}" if optimizer is None and t in TRACEABLE
                   else "your own optimizer's settings are its own" if t in TRACEABLE else "not an optimiser setting")
            raise ValueError(f"traced: {t} cannot be injected ({why}); traceable here: {list(usable)}")
    check_schedule(config, steps_per_epoch, warn=warn)
    check_param_groups(param_groups)
    if optimizer is not None and not (isinstance(optimizer, optax.GradientTransformation) or callable(optimizer)):
        raise ValueError(f"optimizer: must be an optax.GradientTransformation or a function of the learning rate "
                         f"returning one, got {optimizer!r}")
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        check_factory(optimizer, make_schedule(config, steps_per_epoch, float(_get(config, "learning_rate", 0.1)),
                                               schedule))
    name = _get(config, "optimizer", "sgd")
    on = _get(config, "weight_decay_on", "all")
    wd = float(_get(config, "weight_decay", 0.0))
    mine = (param_groups,) if isinstance(param_groups, (str, Mapping)) else tuple(param_groups or ())
    groups = mine + tuple(_get(config, "param_groups", ()) or ())
    scalar = float(_get(config, "scalar_lr_factor", 1.0))

    def factors(tree):
        return group_factors(tree, groups, on, scalar)

    if params is not None:
        if wd > 0 and on == "kernels" and not any(jax.tree_util.tree_leaves(kernel_mask(params))):
            raise ValueError("weight_decay_on: 'kernels' but the model has no parameter named 'kernel'")
        factors(params)  # a rule that selects nothing is refused here, before tracing
    clip = float(_get(config, "grad_clip_norm", 0.0))
    const_momentum = float(_get(config, "momentum", 0.9)) if name in ("sgd", "momentum", "nesterov") else 0.0
    nesterov = bool(_get(config, "nesterov", False)) or name == "nesterov"
    adam = tuple(float(_get(config, k, d)) for k, d in (("adam_b1", 0.9), ("adam_b2", 0.999), ("adam_eps", 1e-8)))
    args = _as_dict(_get(config, "optimizer_args", None))
    own = optimizer is None and name not in BUILTIN_OPTIMIZERS
    decay_arg, mask_arg = _decay_argument(optax_optimizer(name)) if own else (None, None)

    def chain(learning_rate, weight_decay, momentum=None, adam_b1=None, adam_b2=None):
        # None: not traced (a constant of the program, as before); else the injected, per-run value
        beta = (adam[0] if adam_b1 is None else adam_b1, adam[1] if adam_b2 is None else adam_b2)
        rate = make_schedule(config, steps_per_epoch, learning_rate, schedule)
        parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
        if decay_arg is None:  # always: a per-seed hparams weight decay may be > 0 where the config's is 0
            parts.append(_coupled_decay(weight_decay, lambda t: factors(t)[1]))
        if optimizer is not None:
            parts.append(optimizer if isinstance(optimizer, optax.GradientTransformation) else optimizer(rate))
        elif own:
            kwargs = dict(args)
            if decay_arg is not None:
                kwargs[decay_arg] = weight_decay
                if mask_arg is not None:
                    kwargs[mask_arg] = lambda tree: jax.tree_util.tree_map(lambda f: f != 0.0, factors(tree)[1])
            parts.append(optax_optimizer(name)(learning_rate=rate, **kwargs))
        else:
            if momentum is not None or const_momentum > 0:  # traced: a trace even where the config's momentum is 0
                parts.append(optax.trace(decay=const_momentum if momentum is None else momentum, nesterov=nesterov))
            elif name == "adam":
                parts.append(optax.scale_by_adam(b1=beta[0], b2=beta[1], eps=adam[2]))
            parts.append(optax.scale_by_learning_rate(rate))
        parts.append(_scale_leaves(lambda t: factors(t)[0]))
        return optax.chain(*parts)

    if own and decay_arg is not None and params is not None:
        wd_factors = jax.tree_util.tree_leaves(factors(params)[1])
        if any(f not in (0.0, 1.0) for f in wd_factors):
            raise ValueError(f"param_groups: weight_decay_factor other than 0 or 1 needs coupled weight decay; "
                             f"optax.{name} applies its own decoupled decay, which only a mask can switch per "
                             "parameter")
        if mask_arg is None and wd > 0 and 0.0 in wd_factors:
            raise ValueError(f"weight_decay_on: optax.{name} decays every parameter (it has no mask); "
                             "use weight_decay_on='all' or another optimiser")
    extra = {t: float(_get(config, t, 0.999 if t == "adam_b2" else 0.9)) for t in traced}
    return optax.inject_hyperparams(chain)(learning_rate=float(_get(config, "learning_rate", None)), weight_decay=wd,
                                           **extra)
