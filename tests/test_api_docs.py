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
