"""The HTML API reference (``tools/api_docs.py``, pdoc) builds without a warning, and the public API of
``resjax`` has docstrings (issue #15: modules, classes, functions, methods and flax modules' ``__call__``)."""

from __future__ import annotations

import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import resjax

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "api_docs.py"


def _tool():
    spec = importlib.util.spec_from_file_location("api_docs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_builds_without_warnings(tmp_path):
    # In a process of its own: the build resolves the annotations of generated __init__/__new__ in place,
    # which the other tests' modules should not see.
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--no-check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"api_docs.py failed (pdoc warnings?):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "warning" not in proc.stdout.lower(), proc.stdout

    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "resjax.html").is_file()
    subpackages = [m.name for m in pkgutil.iter_modules(resjax.__path__) if m.ispkg]
    assert {"nn", "train", "data", "analysis"} <= set(subpackages), subpackages
    pages = [tmp_path / "resjax" / f"{name}.html" for name in subpackages]
    assert all(page.is_file() for page in pages), [str(p) for p in pages if not p.is_file()]
    # and one page for every module pdoc walks
    for name in _tool()._module_names("resjax"):
        assert (tmp_path / (name.replace(".", "/") + ".html")).is_file(), name


def test_public_api_has_docstrings():
    names = _tool().undocumented("resjax")
    assert not names, f"{len(names)} public object(s) without a docstring of their own:\n  " + "\n  ".join(names)


def _public_callables():
    """(qualified name, function) for every public function of resjax, each public method of its classes and
    each flax module's ``__call__``, where they are defined."""
    import importlib
    import inspect

    import flax.linen as nn

    tool = _tool()
    for name in tool._module_names("resjax"):
        module = importlib.import_module(name)
        public = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for attr in public:
            obj = getattr(module, attr, None)
            if getattr(obj, "__module__", None) != name:
                continue  # re-exported: checked where it is defined
            if inspect.isfunction(obj):
                yield f"{name}.{attr}", obj
            elif inspect.isclass(obj):
                for meth_name, meth in vars(obj).items():
                    wanted = meth_name == "__call__" and issubclass(obj, nn.Module)
                    if (inspect.isfunction(meth) and meth.__module__ == name  # not flax.struct's replace
                            and (wanted or not meth_name.startswith("_"))):
                        yield f"{name}.{attr}.{meth_name}", meth


def test_public_functions_and_calls_have_type_hints():
    """Every parameter (but ``self``/``cls``) and the return of every public function, method and ``__call__``
    is annotated (issue #15)."""
    import inspect

    missing, count = [], 0
    for qualname, fn in _public_callables():
        count += 1
        sig = inspect.signature(fn)
        bare = [p.name for i, p in enumerate(sig.parameters.values())
                if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))]
        if sig.return_annotation is inspect.Signature.empty:
            bare.append("return")
        if bare:
            missing.append(f"{qualname}: {', '.join(bare)}")
    assert count > 200, count
    assert not missing, f"{len(missing)} without type hints:\n  " + "\n  ".join(missing)
