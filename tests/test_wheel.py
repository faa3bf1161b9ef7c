"""resjax as a dependency: the wheel built from this checkout, installed where the checkout is out of sight.

Guards (issue #15) that

- the wheel holds the ``resjax`` package and nothing else at its top level (the checkout's ``experiments``
  and ``benchmarks`` folders, generic names, are not installed: they run from a checkout as
  ``python -m experiments.<name>``), and it carries the ``resjax/py.typed`` marker;
- every module of the installed package imports from a fresh environment, without the checkout on
  ``sys.path``, and every name in each module's ``__all__`` resolves;
- every third-party package that the library imports (at top level or inside a function) is declared in
  the wheel's ``Requires-Dist`` (core or an extra).

The fresh environment gets the third-party dependencies offline and fast from this interpreter's
site-packages through a ``.pth`` file; see ``_link_dependencies``.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Not copied into the build folder: VCS data, environments, build outputs, caches, run outputs.
_SKIP_PATHS = {".git", ".venv", "venv", "build", "dist", "runs", "checkpoints", ".pytest_cache", "docs/api"}
_SKIP_NAMES = {"__pycache__"}

# Run in the fresh environment (python -I): import each module named in argv[1] (a JSON list), resolve its
# __all__, and try the checkout's top-level names; prints one JSON line.
_PROBE = r"""
import importlib, json, sys
report = {"failed": {}, "unresolved": {}, "top_level": {}, "prefix": sys.prefix}
for name in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
    except Exception as err:
        report["failed"][name] = f"{type(err).__name__}: {err}"
        continue
    for attr in getattr(module, "__all__", ()):
        try:
            getattr(module, attr)
        except AttributeError:
            report["unresolved"].setdefault(name, []).append(attr)
import resjax
report["resjax_file"] = resjax.__file__
for top in ("experiments", "benchmarks"):
    try:
        importlib.import_module(top)
        report["top_level"][top] = "imported"
    except ModuleNotFoundError:
        report["top_level"][top] = "ModuleNotFoundError"
    except Exception as err:
        report["top_level"][top] = f"{type(err).__name__}: {err}"
print(json.dumps(report))
"""


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _copy_checkout(dest: Path) -> Path:
    """The checkout without its ignored outputs. The wheel is built from this copy, not in place: setuptools
    builds into ``<project>/build/lib`` and packs everything it finds there, so a stale ``build/`` folder
    (an earlier build that still had ``experiments/``) would leak into the wheel, and concurrent builds
    would share it."""

    def ignore(folder, names):
        rel = Path(folder).relative_to(ROOT)
        return {n for n in names
                if n in _SKIP_NAMES or n.endswith(".egg-info") or (rel / n).as_posix() in _SKIP_PATHS}

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def _venv_python(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _link_dependencies(fresh_python: Path) -> None:
    """Make this interpreter's third-party packages importable in the fresh environment, offline.

    A ``.pth`` file in the fresh site-packages whose single line is this interpreter's site-packages path.
    That does not bring the checkout's editable ``resjax`` along: a path line in a ``.pth`` file only
    appends that folder to ``sys.path``; ``site`` does not process the ``.pth`` files inside an appended
    folder, and the editable install is exactly such a ``.pth`` hook (``__editable__.resjax-*.pth``, which
    installs a finder mapping ``resjax`` to the checkout). The fresh site-packages also comes first on
    ``sys.path``, so its own ``resjax`` wins in any case.
    """
    fresh_site = _run([fresh_python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    fresh_site = Path(fresh_site.stdout.strip())
    (fresh_site / "_resjax_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def _imported_top_level(wheel: zipfile.ZipFile) -> dict[str, set[str]]:
    """{top-level module name: wheel files importing it}, for every absolute import anywhere in the code."""
    found: dict[str, set[str]] = {}
    for name in wheel.namelist():
        if not (name.startswith("resjax/") and name.endswith(".py")):
            continue
        for node in ast.walk(ast.parse(wheel.read(name), filename=name)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], set()).add(name)
    return found


def test_wheel_installs_only_resjax_and_declares_its_imports(tmp_path):
    # ---- build the wheel (no network: no build isolation, no dependencies) ----
    src = _copy_checkout(tmp_path / "src")
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", wheels, src])
    (wheel_path,) = wheels.glob("resjax-*.whl")
    version = wheel_path.name.split("-")[1]
    dist_info = f"resjax-{version}.dist-info"
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
        imported = _imported_top_level(wheel)

    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"resjax", dist_info}, f"unexpected top-level entries in the wheel: {sorted(top_level)}"
    assert "resjax/py.typed" in names

    # ---- a fresh environment outside the checkout, the wheel installed there ----
    # Without its own pip (ensurepip costs ~8 s here): this interpreter's pip drives it via --python.
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", env])
    fresh = _venv_python(env)
    pip = [sys.executable, "-m", "pip", "--python", fresh, "--disable-pip-version-check"]
    _run([*pip, "install", "--no-deps", "--no-index", "-q", wheel_path])

    shown = _run([*pip, "show", "-f", "resjax"]).stdout.splitlines()
    files = [line.strip() for line in shown]
    assert any(line.startswith("resjax/") for line in files), "\n".join(shown)
    stray = [line for line in files if line.startswith(("experiments/", "benchmarks/"))]
    assert not stray, f"pip show -f resjax lists files outside the package: {stray}"

    _link_dependencies(fresh)

    # ---- import every module of the installed package, isolated (no cwd, no PYTHONPATH) ----
    modules = sorted(
        name[: -len(".py")].removesuffix("/__init__").replace("/", ".")
        for name in names if name.startswith("resjax/") and name.endswith(".py"))
    assert "resjax.nn" in modules and "resjax.train.core" in modules, modules
    probe = _run([fresh, "-I", "-c", _PROBE, json.dumps(modules)], cwd=tmp_path)
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    assert not report["failed"], f"modules that do not import from the wheel: {report['failed']}"
    assert not report["unresolved"], f"names in __all__ that do not resolve: {report['unresolved']}"
    resjax_file = Path(report["resjax_file"]).resolve()
    assert resjax_file.is_relative_to(env.resolve()), f"resjax imported from {resjax_file}, not from {env}"
    assert report["top_level"] == {"experiments": "ModuleNotFoundError", "benchmarks": "ModuleNotFoundError"}, \
        report["top_level"]

    # ---- every imported third-party package is declared ----
    requires = email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []
    declared = {_normalise(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)) for r in requires}
    third_party = {m: files for m, files in imported.items()
                   if m not in sys.stdlib_module_names and m != "resjax"}
    assert {"jax", "flax", "numpy"} <= third_party.keys(), sorted(third_party)  # the scan sees imports
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, files in sorted(third_party.items()):
        # a package not installed here (an optional one) is looked for under its import name
        candidates = distributions.get(module) or [module]
        if not any(_normalise(d) in declared for d in candidates):
            missing.append(f"{module} (distribution {' or '.join(sorted(set(candidates)))}; "
                           f"imported in {', '.join(sorted(files))})")
    assert not missing, ("imported by resjax but not declared in pyproject.toml (dependencies or an extra):\n  "
                         + "\n  ".join(missing) + f"\ndeclared: {sorted(declared)}")
