"""An experiment's settings as flags: every leaf of its ``get_config(size)`` by its dotted flag name.

``flatten`` names every setting as its flag (``train.learning_rate``; a dict setting such as
``train.optimizer_args`` is one setting), ``parse_value`` reads a flag's text as a value of its default's type,
``show_value`` writes a value back as a flag takes it, ``set_path`` sets one, and ``default_out`` is where a run
writes without ``--out``. ``COUNT_SETTING`` says, by its name, which settings count something (integers >= 1).
The command line built from these is ``experiments.flags``; this module imports nothing of ``experiments``.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Any

import ml_collections

from resjax.train.config import DICT_SETTINGS, is_int  # noqa: F401  (is_int: re-exported, common.is_int)

SIZES = ("quick", "default", "full")


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """``{'train.learning_rate': 0.005, ...}``: every setting by its flag name; a dict setting (an optax
    function's arguments, ``train.optimizer_args``) is one setting, a dict."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict) and key in DICT_SETTINGS:
            out[name] = value.to_dict()
        elif isinstance(value, ml_collections.ConfigDict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def parse_value(text: str, default: Any) -> Any:
    """``text`` as a value of ``default``'s type; ``ValueError`` saying what was expected."""
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if isinstance(default, str):
        return text
    if isinstance(default, dict):  # --train.optimizer_args "dict(b2=0.95)" or "{'b2': 0.95}"
        try:
            tree = ast.parse(text, mode="eval").body
            if isinstance(tree, ast.Call) and getattr(tree.func, "id", None) == "dict" and not tree.args:
                value = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
            else:
                value = ast.literal_eval(tree)
        except (ValueError, SyntaxError, TypeError):
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"expected a dict such as \"dict(b2=0.95)\", got {text!r}")
        return value
    if isinstance(default, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parts = [v.strip() for v in text.split(",") if v.strip()]
            if (default and all(isinstance(v, str) for v in default)) or (  # --taus 1,L^-1/2
                    not default and parts and all(v.isidentifier() for v in parts)):  # --train.param_groups fixup
                return tuple(parts)
            example = f"({', '.join(repr(v) for v in default[:2])},)" if default else "(1, 2)"
            raise ValueError(f"expected a tuple such as {example!r}, got {text!r}") from None
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    try:  # None-valued settings
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_path(config: ml_collections.ConfigDict, name: str, value: Any) -> None:
    *parents, leaf = name.split(".")
    node = config
    for p in parents:
        node = node[p]
    with node.unlocked():
        node[leaf] = tuple(value) if isinstance(value, list) else value


def default_out(name: str, size: str) -> pathlib.Path:
    """Where a run writes without ``--out``: ``runs/<name>``, or ``runs/<name>-quick`` for ``--quick`` (so a
    quick check never replaces the results of a real run)."""
    return pathlib.Path("runs") / (f"{name}-quick" if size == "quick" else name)


def show_value(value) -> str:
    """A setting's value as a flag takes it: ``(4, 8)``, ``false``, ``sgd``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(show_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


# Settings (outside ``train``, whose checks are the library's) that count something: integers >= 1.
COUNT_SETTING = re.compile(r"^(num_\w+|(\w+_)?(depths?|widths?|blocks|batch|batch_sizes?|epochs|examples|layers|"
                           r"draws|networks|repeats|samples|points|inputs|seeds|steps|runs))$")
