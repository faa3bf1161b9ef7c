"""What the analyses need of a model that is not resjax's: the call, the ``train`` argument, NNX objects.

The analyses of ``propagation``, ``shattering`` and ``paths`` take a model as either

- a Linen module (any ``flax.linen.Module``: resjax's, your own, or an NNX module class wrapped by
  ``flax.nnx.bridge.to_linen``), called as ``module.apply(variables, x, **kwargs)``; or
- a plain function ``apply_fn(variables, x, **kwargs)`` with Linen's ``apply`` conventions (a bound
  ``module.apply`` is one): it returns the output, or ``(output, updated_collections)`` when called with
  ``mutable=[...]``.

``train`` is passed only to a callee that takes it: one whose ``__call__`` (a module) or signature (a
function; for a bound ``module.apply``, the module's ``__call__``) has a parameter named ``train``, or a
function with ``**kwargs`` when ``train`` is given (not None). A ``train`` given to a callee that takes none
raises ``ValueError`` naming ``train``.

An NNX object cannot be applied to a variables dict: an NNX module, ``nnx.State`` or a dict holding NNX
variables is refused with ``TypeError`` saying what to pass. A ``flax.nnx.bridge.ToNNX`` wrapper of a Linen
module is turned back into ``(linen_module, variables)`` by ``from_nnx``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import flax.linen as nn

#: Exported at ``resjax.analysis``'s top level; ``applied``, ``Applied``, ``takes_train`` and ``check_variables``
#: are the helpers the analyses share, importable from here.
__all__ = ["from_nnx"]

_NNX_HELP = ("pass a Linen module and its variables dict ({'params': ...}): an NNX model of your own as "
             "flax.nnx.bridge.to_linen(YourClass, *args) with its .init(...) variables, a ToNNX-wrapped Linen "
             "model as resjax.analysis.from_nnx(model) -> (module, variables); or any apply_fn(variables, x, "
             "**kwargs) with Linen's apply conventions and its variables")


def _nnx():
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always ships nnx here
        return None
    return nnx


def _is_nnx_module(obj: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(obj, nnx.Module)


def _has_nnx_leaf(tree: Any) -> bool:
    nnx = _nnx()
    if nnx is None:
        return False
    import jax

    kind = nnx.Variable  # flax 0.12: nnx.VariableState is an alias of it
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kind))
    return any(isinstance(leaf, kind) for leaf in leaves)


def check_variables(variables: Any, where: str) -> None:
    """Refuse NNX state (``nnx.State``, NNX variables) with a ``TypeError`` that says what to pass."""
    nnx = _nnx()
    if _is_nnx_module(variables):
        raise TypeError(f"{where}: variables is an NNX module ({type(variables).__name__}); {_NNX_HELP}")
    if nnx is not None and isinstance(variables, getattr(nnx, "State", ())):
        raise TypeError(f"{where}: variables is an nnx.State, not a Linen variables dict; {_NNX_HELP}")
    if isinstance(variables, dict) and _has_nnx_leaf(variables):
        raise TypeError(f"{where}: variables holds NNX variables; {_NNX_HELP}")


def from_nnx(model: Any) -> tuple[nn.Module, dict]:
    """``(linen_module, variables)`` of a ``flax.nnx.bridge.ToNNX`` wrapper (initialised by ``lazy_init``).

    The pair is what every analysis takes: ``variance_through_depth(*from_nnx(model), x)``. An NNX module
    of your own is no ``ToNNX``: wrap its class with ``flax.nnx.bridge.to_linen`` instead (``TypeError``).
    """
    nnx = _nnx()
    if nnx is None or not isinstance(model, nnx.Module):
        raise TypeError(f"from_nnx: want a flax.nnx.bridge.ToNNX model, got {type(model).__name__}")
    from flax.nnx import bridge
    from flax.nnx.bridge import variables as bridge_variables

    if not isinstance(model, bridge.ToNNX):
        raise TypeError(f"from_nnx: {type(model).__name__} is an NNX module of its own, not a ToNNX wrapper of a "
                        "Linen module; analyse flax.nnx.bridge.to_linen(YourClass, *args) with its .init(...) "
                        "variables instead")
    attrs = {k: v for k, v in vars(model).items() if not k.startswith("to_nnx__") and not k.startswith("_pytree__")}
    variables = {k: v for k, v in bridge_variables.nnx_attrs_to_linen_vars(attrs).items() if k != "intermediates"}
    if not variables:
        raise ValueError("from_nnx: the ToNNX model has no variables yet; initialise it with "
                         "flax.nnx.bridge.lazy_init(model, x) first")
    return model.to_nnx__module, variables


def _signature_of(fn: Any) -> inspect.Signature | None:
    target = fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(fn, "__name__", None) in ("apply", "__call__"):
        target = type(owner).__call__
    elif isinstance(fn, nn.Module):
        target = type(fn).__call__
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def takes_train(fn: Any) -> str:
    """``'named'`` if the module's ``__call__`` (or the function) has a ``train`` parameter, ``'kwargs'`` if it
    takes ``**kwargs`` only, ``'no'`` otherwise (or when the signature cannot be read)."""
    sig = _signature_of(fn)
    if sig is None:
        return "no"
    params = sig.parameters
    if "train" in params and params["train"].kind is not inspect.Parameter.VAR_KEYWORD:
        return "named"
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "kwargs"
    return "no"


class Applied:
    """A model resolved for the analyses: ``apply(variables, x, **kwargs)``, its name, and how to pass ``train``."""

    def __init__(self, apply: Callable[..., Any], name: str, train_mode: str, module: Any = None) -> None:
        self.apply, self.name, self.train_mode, self.module = apply, name, train_mode, module

    def train_kwargs(self, train: bool | None) -> dict:
        """``{'train': train}`` when the callee takes it (see the module docstring), else ``{}``."""
        if self.train_mode == "named" or (self.train_mode == "kwargs" and train is not None):
            return {"train": train}
        if train is not None:
            raise ValueError(f"train: {self.name} takes no 'train' argument; leave train=None (the default) for a "
                             "model without one")
        return {}

    def __call__(self, variables: Any, x: Any, *, train: bool | None = None, **kwargs: Any) -> Any:
        """``apply(variables, x, train=..., **kwargs)``, ``train`` only where it is taken."""
        return self.apply(variables, x, **self.train_kwargs(train), **kwargs)


def applied(model: Any, variables: Any = None, where: str = "analysis") -> Applied:
    """Resolve a Linen module or an ``apply_fn``; refuse NNX objects (and NNX ``variables``) with ``TypeError``."""
    if _is_nnx_module(model):
        raise TypeError(f"{where}: {type(model).__name__} is an NNX module, which cannot be applied to a variables "
                        f"dict; {_NNX_HELP}")
    if variables is not None:
        check_variables(variables, where)
    if isinstance(model, nn.Module):
        return Applied(model.apply, type(model).__name__, takes_train(model), model)
    if callable(model):
        owner = getattr(model, "__self__", None)
        name = (type(owner).__name__ + ".apply" if isinstance(owner, nn.Module)
                else getattr(model, "__name__", "apply_fn"))
        return Applied(model, name, takes_train(model), owner if isinstance(owner, nn.Module) else None)
    raise TypeError(f"{where}: want a Linen module or a function apply_fn(variables, x, **kwargs), got "
                    f"{type(model).__name__}")
