"""Build the HTML API reference of ``resjax`` with pdoc, and list the public API that lacks a docstring.

    python tools/api_docs.py [--out DIR] [--no-check]

Writes the reference into ``DIR`` (default ``docs/api/``, which git ignores: generated HTML is never
committed; open ``DIR/index.html``). The reference covers every module of ``resjax`` (each subpackage and
each file) and, in each, what pdoc treats as public: the names in its ``__all__`` (every name not starting
with an underscore where it has none).

Exit status 1 when pdoc emitted any warning while building (each is printed) or, unless ``--no-check``,
when ``undocumented()`` is not empty (the names are printed); 0 otherwise.

``undocumented(package)`` is usable on its own (``tests/test_api_docs.py`` calls it): the qualified names of
public modules, classes, functions and methods (properties included) that have no docstring of their own,
plus ``Cls.__call__`` for every flax ``nn.Module`` subclass defined in the package whose own ``__call__``
has none (pdoc hides dunder methods, the issue requires them). A docstring inherited from a base class (a
flax method's, or the one ``dataclasses`` generates from a signature) does not count; dataclass fields and
other variables need none; members a class inherits without overriding are not its own and do not count.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import typing
import warnings
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "api"
PACKAGE = "resjax"


def _in_package(modulename: str, package: str) -> bool:
    return modulename == package or modulename.startswith(package + ".")


def _module_names(package: str) -> list[str]:
    """Every module of ``package`` on disk, the package first: each gets a page and is checked.

    pdoc's own walk follows a package's ``__all__``, which lists names for ``from package import *`` and
    not the submodules, so it would leave out ``resjax.nn.residual``, ``resjax.train.core`` and the rest;
    the reference lists them explicitly instead (``build`` passes these names to ``pdoc.pdoc``)."""
    import pkgutil

    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return names


def _specs(package: str) -> list[str]:
    """``_module_names`` less those pdoc already reaches by walking an earlier one (naming a module twice
    makes pdoc warn)."""
    import pdoc.extract

    specs: list[str] = []
    covered: set[str] = set()
    for name in _module_names(package):
        if name not in covered:
            specs.append(name)
            covered.update(pdoc.extract.walk_specs([name]))
    return specs


def _resolve_generated_signatures(package: str) -> None:
    """Let pdoc resolve the annotations of the ``__init__``/``__new__`` that ``NamedTuple`` and ``dataclasses``
    generate, so that it renders their types instead of warning.

    Under ``from __future__ import annotations`` those annotations are strings. pdoc evaluates a function's
    string annotations in the globals of ``inspect.getmodule(function)``: for a ``NamedTuple``'s generated
    ``__new__`` that is no module at all (its ``__module__`` is ``namedtuple_<Name>``), and for a dataclass
    that inherits fields it is the subclass's module, which need not import the names a base class's module
    used. Here (in the building process only) the ``__new__`` gets its class's module, and a generated
    ``__init__`` gets its string annotations replaced by ``typing.get_type_hints(cls)``, which evaluates each
    field in the module of the class that declared it. Nothing else is touched; what still cannot be
    resolved keeps warning.
    """
    for name in _module_names(package):
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or not _in_package(cls.__module__, package):
                continue
            new = cls.__new__  # not vars(cls): type() wraps the __new__ in the class dict in a staticmethod
            if (issubclass(cls, tuple) and hasattr(cls, "_fields") and inspect.isfunction(new)
                    and new.__module__.startswith("namedtuple_")):
                new.__module__ = cls.__module__
            init = vars(cls).get("__init__")
            if dataclasses.is_dataclass(cls) and inspect.isfunction(init):
                annotations = getattr(init, "__annotations__", {})
                if not any(isinstance(a, str) for a in annotations.values()):
                    continue
                try:
                    hints = typing.get_type_hints(cls)
                except Exception:  # noqa: BLE001 - pdoc then warns about what it cannot resolve
                    continue
                for field, annotation in list(annotations.items()):
                    if isinstance(annotation, str) and field in hints:
                        annotations[field] = hints[field]


def build(out: Path | str = DEFAULT_OUT, package: str = PACKAGE) -> list[str]:
    """Write the HTML reference of ``package`` into ``out``; the warnings pdoc emitted, as text (empty: clean).

    Every warning raised while pdoc imports, walks and renders the package is recorded (``always``, so
    repeated ones are not swallowed), not just printed.
    """
    import pdoc
    import pdoc.render

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(package)
        _resolve_generated_signatures(package)
        pdoc.render.configure(docformat="restructuredtext")
        pdoc.pdoc(*_specs(package), output_directory=out)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]


def _own_doc(obj) -> str:
    """``obj``'s own docstring (``__doc__`` as written on it, not looked up in base classes), stripped."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) else ""


def _is_public(doc, module_all) -> bool:
    """pdoc's default template rule: ``@private`` hides; dunders and ``_names`` are private unless in ``__all__``."""
    if "@private" in (doc.docstring or ""):
        return False
    if "@public" in (doc.docstring or ""):
        return True
    name = doc.name
    return not name.startswith("_") or name in (module_all or ()) or doc.qualname in (module_all or ())


def undocumented(package: str = PACKAGE) -> list[str]:
    """Qualified names (where each object is defined) of the public API of ``package`` without a docstring.

    Walks pdoc's doc objects: every module pdoc documents (``pdoc.doc.Module.from_name``; see
    ``_module_names``), its public members and, for each class, its own (not inherited) public methods and
    properties, recursing into nested classes. Each object is reported once, under the name of the place it
    is defined (a class re-exported by ``resjax.nn`` is reported as ``resjax.nn.mlp.PlainMLP``); objects
    defined outside the package (re-exported from elsewhere) are skipped.
    """
    import flax.linen as nn
    import pdoc.doc

    missing: dict[str, None] = {}  # insertion-ordered set
    seen: set[tuple[str, str]] = set()

    def check(obj, fullname: str) -> None:
        if not _own_doc(obj):
            missing.setdefault(fullname, None)

    def visit_class(cls_doc, module_all) -> None:
        cls = cls_doc.obj
        where = cls_doc.taken_from
        if where in seen:
            return
        seen.add(where)
        fullname = ".".join(where)
        doc = vars(cls).get("__doc__")
        # the one-line signature that ``dataclasses`` (flax modules and struct dataclasses too) and
        # ``namedtuple`` write as the docstring of an undocumented class is no docstring (``vars``, because
        # inspect.getdoc would fall back to a base class's docstring)
        generated = ((dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")) and isinstance(doc, str)
                     and re.fullmatch(rf"{re.escape(cls.__name__)}\(.*\)", doc.strip(), re.S) is not None)
        if not (isinstance(doc, str) and doc.strip()) or generated:
            missing.setdefault(fullname, None)
        if issubclass(cls, nn.Module) and "__call__" in vars(cls):
            check(vars(cls)["__call__"], f"{fullname}.__call__")
        for member in cls_doc.own_members:
            if not _is_public(member, module_all):
                continue
            if isinstance(member, pdoc.doc.Class):
                visit_class(member, module_all)
                continue
            raw = vars(cls).get(member.name)
            if isinstance(member, pdoc.doc.Function):
                check(member.obj, f"{fullname}.{member.name}")
            elif isinstance(raw, (property, cached_property)):  # pdoc renders properties as variables
                check(raw, f"{fullname}.{member.name}")
            # other variables (dataclass fields, constants) need no docstring

    for name in _module_names(package):
        module = pdoc.doc.Module.from_name(name)
        module_all = getattr(module.obj, "__all__", None)
        check(module.obj, name)
        for member in module.members.values():
            if not _in_package(member.taken_from[0], package) or not _is_public(member, module_all):
                continue
            if isinstance(member, pdoc.doc.Class):
                visit_class(member, module_all)
            elif isinstance(member, pdoc.doc.Function):
                if member.taken_from in seen:
                    continue
                seen.add(member.taken_from)
                check(member.obj, ".".join(member.taken_from))
    return list(missing)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--no-check", action="store_true", help="only build; do not list what is undocumented")
    args = parser.parse_args(argv)

    failed = False
    caught = build(args.out)
    if caught:
        failed = True
        print(f"pdoc emitted {len(caught)} warning(s):")
        for text in caught:
            print(f"  {text}")
    print(f"API reference written to {args.out / 'index.html'}")
    if not args.no_check:
        names = undocumented()
        if names:
            failed = True
            print(f"{len(names)} public object(s) without a docstring of their own:")
            for name in names:
                print(f"  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
