"""The documentation site builds with the README's command, warnings as errors, and renders.

- The site (``docs/``, Sphinx) builds with ``-W --keep-going`` (every warning an error: a broken link or
  cross-reference, a docstring that reStructuredText misreads, a reference to resjax's own API that does not
  resolve), with the tutorials not executed (``-D nb_execution_mode=off``): their code runs in
  ``tests/test_doc_examples.py`` instead, with every stated result checked, and executing them in kernels here
  would cost the suite more than the build itself.
- Every experiment of ``experiments.reproduce`` has its page, whose claim table is the one its ``CLAIMS`` give for
  ``docs/report/<name>/results.json`` (generated as the site builds) and whose figure is there.
- Every link and image of the built pages points to a file of the site; every relative link of the README to a file
  of the checkout.
- The built front page and one tutorial, opened in headless Chromium, render: screenshots (saved in the built site,
  ``_screenshots/``) are not blank and show the degradation figure's colours and a code block's.
- The public API has docstrings and type hints (issue #15; the reference is generated from them), and every name of
  the ``__all__`` of ``resjax`` and of each public module under it has an entry in the API reference: checked from
  the API pages' directives without a build (by autodoc's rules), and in the built site's ``objects.inv``.

Chromium is Debian's package (``apt-get install -y chromium``; ``.ci/run`` installs it); outside CI the screenshot
test is skipped, saying so, when it is absent.
"""

from __future__ import annotations

import dataclasses
import html.parser
import importlib
import inspect
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from functools import cached_property
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

import resjax

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The README's command, with the tutorials' execution off (see the module docstring)
BUILD = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-D", "nb_execution_mode=off"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site's folder (built once for the module, into a temporary folder)."""
    out = tmp_path_factory.mktemp("site")
    html_dir, doctrees = out / "html", out / "doctrees"
    proc = subprocess.run(BUILD + ["-d", str(doctrees), str(DOCS), str(html_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"the site does not build (warnings are errors):\n{proc.stderr[-6000:]}"
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-6000:]
    return html_dir


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.imgs, self.ids = [], [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if tag == "img" and attrs.get("src"):
            self.imgs.append(attrs["src"])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _local(url: str) -> bool:
    parts = urlsplit(url)
    return not parts.scheme and not parts.netloc and not url.startswith(("mailto:", "javascript:"))


def test_site_has_every_page(site):
    for page in ["index", "getting_started", "tutorials/mnist1d_seeds", "tutorials/conv_resnet_own_images",
                 "tutorials/grid", "tutorials/analyses", "howto/resume", "howto/watching", "howto/pytorch_weights",
                 "howto/nnx", "howto/mixed_precision", "howto/several_hosts", "howto/recipes", "benchmarks",
                 "report/REPORT", "api/index", "api/nn", "api/train", "api/data", "api/analysis", "api/interop",
                 "api/paths", "api/launch"]:
        assert (site / f"{page}.html").is_file(), page
    # the API reference documents every public module of the packages, with type hints in the signatures
    api = (site / "api" / "train.html").read_text()
    for name in [m.name for m in pkgutil.iter_modules(importlib.import_module("resjax.train").__path__)
                 if not m.name.startswith("_")]:
        assert f'id="module-resjax.train.{name}"' in api, name
    assert 'id="resjax.train.ondevice.make_train"' in api
    signature = api[api.index('id="resjax.train.ondevice.make_train"'):][:12000]
    assert "ConfigDict" in signature and "Trainer" in signature, signature[:2000]
    # every name of every public module's __all__ has an entry (the site's inventory, objects.inv)
    inventory = _inventory(site / "objects.inv")
    missing = {module: names for module in _api_modules() if (names := _without_entry(module, inventory))}
    assert not missing, f"exported names without an entry in the built API reference: {missing}"


# The API reference: an entry for every exported name ------------------------------------------------------------------
def _extension():
    """``docs/_ext/resjax_report.py``, which writes the API pages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("resjax_report", DOCS / "_ext" / "resjax_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _api_modules() -> list[str]:
    """``resjax`` and every public module directly under it: the names of each one's ``__all__`` are its API."""
    return ["resjax"] + [f"resjax.{m.name}" for m in pkgutil.iter_modules(resjax.__path__)
                         if not m.name.startswith("_")]


def _without_entry(module_name: str, entries) -> list[str]:
    """The names of ``module_name.__all__`` that no entry documents: ``entries`` are the documented dotted names,
    and an entry documents a name when it ends with the name and is the same object (its home module's entry)."""
    module = importlib.import_module(module_name)
    by_name: dict[str, list[str]] = {}
    for entry in entries:
        by_name.setdefault(entry.rsplit(".", 1)[-1], []).append(entry)
    return [name for name in module.__all__
            if not any(_resolve(entry) is getattr(module, name) for entry in by_name.get(name, []))]


def _resolve(dotted: str):
    """The object a documented dotted name stands for (None if it does not import)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _inventory(path: Path) -> set[str]:
    """The Python objects' names in a built site's ``objects.inv`` (four header lines, then zlib)."""
    import zlib

    lines = zlib.decompress(path.read_bytes().split(b"\n", 4)[4]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.split(" ")[1].startswith("py:")}


_AUTO = re.compile(r"^\.\. auto(module|class|exception|function|data|attribute)::\s*(\S+)\s*$")
_OPTION = re.compile(r"^\s+:([\w-]+):\s*(.*)$")


def _has_doc(obj, attr_doc: bool) -> bool:
    """autodoc's test of a member to document: a ``#:`` comment, or a docstring of its own (a constant's
    ``__doc__`` is its type's)."""
    doc = getattr(obj, "__doc__", None)
    return attr_doc or (isinstance(doc, str) and bool(doc.strip()) and doc != getattr(type(obj), "__doc__", None))


def documented(pages: dict[str, str]) -> set[str]:
    """The dotted names the API pages' autodoc directives give entries, by autodoc's rules (Sphinx 9): an
    ``automodule`` documents, unless ``:no-members:``, its ``:members:`` list, or else its ``__all__``, or else
    its public names defined in it (a constant: assigned with a ``#:`` comment); each only if it has a docstring
    of its own or a ``#:`` comment, and not if ``:exclude-members:`` names it."""
    from sphinx.pycode import ModuleAnalyzer

    found = set()
    for text in pages.values():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if not (m := _AUTO.match(line.strip())):
                continue
            options = {}
            for following in lines[i + 1:]:
                if not (o := _OPTION.match(following)):
                    break
                options[o[1]] = o[2].strip()
            kind, target = m[1], m[2]
            if kind != "module":
                where, name = target.rsplit(".", 1)
                attr_docs = ModuleAnalyzer.for_module(where).find_attr_docs()
                if _has_doc(_resolve(target), ("", name) in attr_docs):
                    found.add(target)
                continue
            found.add(target)  # the module's own entry (a module exported by name, as resjax.train.grid is)
            if "no-members" in options:
                continue
            module = importlib.import_module(target)
            attr_docs = ModuleAnalyzer.for_module(target).find_attr_docs()
            if options.get("members"):
                names, own_only = [n.strip() for n in options["members"].split(",")], False
            elif getattr(module, "__all__", None) is not None and "ignore-module-all" not in options:
                names, own_only = list(module.__all__), False
            else:
                names, own_only = [n for n in vars(module) if not n.startswith("_")], True
            excluded = {n.strip() for n in options.get("exclude-members", "").split(",")}
            for name in names:
                if name in excluded or name.startswith("_") or not hasattr(module, name):
                    continue
                obj, attr_doc = getattr(module, name), ("", name) in attr_docs
                if own_only and not attr_doc and getattr(obj, "__module__", target) != target:
                    continue  # imported: documented where it is defined
                if _has_doc(obj, attr_doc):
                    found.add(f"{target}.{name}")
    return found


def test_api_reference_has_an_entry_for_every_exported_name():
    """Every name of the ``__all__`` of ``resjax`` and of each public module under it has an entry in the API
    reference: the pages ``docs/_ext/resjax_report.py`` writes are read (not built) and their directives resolved
    by autodoc's rules. A constant needs a ``#:`` comment where it is assigned."""
    extension = _extension()
    pages = extension.api_pages()
    assert {name for name, _ in extension.API_PACKAGES} | {"resjax"} == set(_api_modules()), \
        "every public module of resjax has its page in the API reference (API_PACKAGES)"
    entries = documented(pages)
    missing = {module: names for module in _api_modules() if (names := _without_entry(module, entries))}
    assert not missing, ("exported names without an entry in the API reference (a constant needs a #: comment where "
                         f"it is assigned; a class or function a docstring): {missing}")
    # each package's tables list every name it exports, once
    for name, _ in extension.API_PACKAGES:
        module = importlib.import_module(name)
        if hasattr(module, "__path__"):
            listed = re.findall(r"^   ~(\S+)$", pages[f"{name.split('.', 1)[1]}.md"], re.M)
            assert sorted(entry.rsplit(".", 1)[-1] for entry in listed) == sorted(module.__all__), name


def test_constants_docs_read_as_written():
    """napoleon takes a constant's docstring's first line up to a colon for a type (rendered as ``Type: ...``,
    the rest as the description); the site's docstring hook puts the text back as written."""
    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    written = ["The values of ``train.seed_axis``: how the host feeder steps several seeds", "(``seed_axis_mode``)."]
    for what in ("data", "attribute", "property"):
        lines = GoogleDocstring(list(written), Config(), what=what, name="SEED_AXIS_MODES").lines()
        assert any(line.startswith(":type:") for line in lines), lines  # napoleon's reading
        _extension()._process_docstring(None, what, "SEED_AXIS_MODES", None, {}, lines)
        assert [line for line in lines if line.strip()] == written, lines


def test_front_page_is_for_users():
    """The site's front page, as the Flax and optax sites have it: the install line, then one short example (which
    ``tests/test_doc_examples.py`` runs, its stated results checked), then where to go next; its prose has no
    timings and no dates (they live on the benchmarks page)."""
    text = (DOCS / "index.md").read_text()
    install = re.findall(r"```bash\n(.*?)```", text, re.S)
    examples = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(install) == 1 and install[0].startswith("pip install"), install
    assert len(examples) == 1 and 5 <= len(examples[0].splitlines()) <= 12, examples
    assert text.index("```bash") < text.index("```python") < text.index("## Where to go next")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose), "a date on the front page"
    timings = re.findall(r"\b\d[\d,.]*\s*(?:s|ms|seconds?|minutes?|hours?|[GT]FLOP/?s?)\b", prose)
    assert not timings, f"timings on the front page: {timings}"


def test_links_and_images_resolve(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40
    ids = {page: _parse(page) for page in pages}
    broken = []
    for page, parsed in ids.items():
        for url in parsed.hrefs + parsed.imgs:
            if not _local(url):
                continue
            parts = urlsplit(url)
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {url}")
            elif parts.fragment and target.suffix == ".html" and target in ids \
                    and unquote(parts.fragment) not in ids[target].ids:
                broken.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    assert not broken, "\n".join(broken[:50])


def test_readme_links_point_into_the_checkout():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(targets) >= 20, targets
    missing = [t for t in targets if _local(t) and not (ROOT / urlsplit(t).path).exists()]
    assert not missing, missing
    assert len(text.splitlines()) <= 200


# What a measured timing looks like in prose: a date, a rate, seconds, or minutes that are not a rounded "about N".
MEASURED = re.compile(r"\b20\d\d-\d\d-\d\d\b|GFLOP|TFLOP|\b\d[\d,.]* ?(?:s|ms|seconds)\b|\b\d[\d.]* minutes\b")
#: ... and what a rounded one looks like ("about 25 minutes", "about 8 to 13 minutes"): allowed.
ROUNDED = re.compile(r"\babout \d+(?: to \d+)? minutes\b")


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md", "docs/index.md"])
def test_front_pages_carry_no_measured_timings(page):
    """Measured numbers live in one generated table (docs/benchmarks.md, ``python -m benchmarks.first_hour``); the
    front pages round them ("about 25 minutes") and carry no dates, rates or seconds."""
    found = MEASURED.findall(ROUNDED.sub("", (ROOT / page).read_text()))
    assert not found, f"{page} states measured timings in prose (they belong in docs/benchmarks.md): {found}"


def test_the_first_hour_table_is_on_the_benchmarks_page():
    text = (DOCS / "benchmarks.md").read_text()
    assert "python -m benchmarks.first_hour" in text and "FIRST_HOUR_TABLE" not in text
    assert re.search(r"^Machine: .+ matmul peak \d+ GFLOP/s", text, re.M)
    assert "| `python -m experiments.reproduce --quick` |" in text and "| `python -m pytest -q tests` |" in text


def test_every_experiment_has_its_page_with_claims_and_figure(site):
    from experiments import reproduce

    for name in reproduce.REGISTRY:
        page = site / "experiments" / f"{name}.html"
        assert page.is_file(), name
        text = page.read_text()
        module = importlib.import_module(f"experiments.{name}")
        results = json.loads((DOCS / "report" / name / "results.json").read_text())
        rows = reproduce.claim_rows(module, results)
        assert len(rows) == len(module.CLAIMS) > 0, name
        table = text[text.index("experiment-claims"):]
        table = table[:table.index("</table>")]
        verdicts = re.findall(r"<tr[^>]*>(?:\s*<td[^>]*>.*?</td>){4}\s*<td[^>]*><p>(.*?)</p></td>", table, re.S)
        expected = [re.sub(r"\*\*(.*)\*\*", r"<strong>\1</strong>", r[4]) for r in rows]
        assert verdicts == expected, (name, verdicts, expected)
        assert f"python -m experiments.{name}" in re.sub(r"<[^>]+>", "", text), name  # the command, highlighted
        figure = [src for src in _parse(page).imgs if src.endswith(f"{name}.png")]
        assert figure and (page.parent / figure[0]).is_file(), name


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _screenshot(browser: str, page: Path, png: Path, tmp: Path, size=(1280, 1600)) -> None:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={tmp}", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file(), f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-3000:]}"


def _pixels(png: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(png).convert("RGB")).astype(int)


def _hue(pixels: np.ndarray, name: str) -> int:
    """How many pixels are clearly red or clearly green."""
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    mask = (r > 180) & (g < 90) & (b < 90) if name == "red" else (g > 120) & (r < 110) & (b < 110)
    return int(mask.sum())


#: the background of a highlighted code block in sphinx-book-theme's light mode
CODE_BACKGROUND = (243, 244, 245)


def test_front_page_and_a_tutorial_render_in_chromium(site, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's package 'chromium'")
        pytest.skip("chromium is not installed (apt-get install -y chromium): the screenshots were not taken")
    shots = site / "_screenshots"
    shots.mkdir(exist_ok=True)
    front, tutorial = shots / "index.png", shots / "tutorial_mnist1d_seeds.png"
    _screenshot(browser, site / "index.html", front, tmp_path / "profile-front")
    _screenshot(browser, site / "tutorials" / "mnist1d_seeds.html", tutorial, tmp_path / "profile-tutorial")
    for png in (front, tutorial):
        pixels = _pixels(png)
        assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1200, pixels.shape
        assert pixels.std() > 20, f"{png}: the page is blank"
    # the front page shows the degradation figure: its red and green curves are on screen (no other part of the
    # page is red or green; the links are blue)
    front_pixels = _pixels(front)
    figure_png = site / "_images" / "degradation.png"
    assert figure_png.is_file(), "the degradation figure was not copied into the site"
    for hue, count in (("red", _hue(_pixels(figure_png), "red")), ("green", _hue(_pixels(figure_png), "green"))):
        assert count > 500, f"the figure has no {hue} curve to look for ({count} pixels)"
        assert _hue(front_pixels, hue) > 100, f"{front}: the figure's {hue} curves are not on screen"
    # every image of the two pages is a file of the site
    for page in (site / "index.html", site / "tutorials" / "mnist1d_seeds.html"):
        for src in _parse(page).imgs:
            assert not _local(src) or (page.parent / unquote(urlsplit(src).path)).is_file(), (page, src)
    # the tutorial shows its code: the highlighted code block's background (the theme's light grey) over many rows
    tutorial_pixels = _pixels(tutorial)
    html_text = (site / "tutorials" / "mnist1d_seeds.html").read_text()
    code_rows = (np.abs(tutorial_pixels - np.asarray(CODE_BACKGROUND)).max(axis=-1) <= 3).sum(axis=1) > 200
    assert code_rows.sum() > 100, f"{tutorial}: no code block on screen ({code_rows.sum()} rows of its background)"
    assert 'class="highlight' in html_text and "make_train" in html_text


# The public API has docstrings and type hints -----------------------------------------------------------------------
def _module_names(package: str = "resjax") -> list[str]:
    """Every public module of ``package`` on disk, the package first."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return names


def _public_names(module) -> list[str]:
    return list(getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")])


def _own_doc(obj) -> bool:
    doc = getattr(obj, "__doc__", None)
    return isinstance(doc, str) and bool(doc.strip())


def undocumented(package: str = "resjax") -> list[str]:
    """Qualified names (where each is defined) of the public modules, classes, functions, methods and properties of
    ``package`` without a docstring of their own, and ``Cls.__call__`` of each flax module that has none.

    A class's docstring that ``dataclasses`` or ``namedtuple`` generated from its signature is no docstring, nor is
    one inherited from a base class; dataclass fields and other variables need none."""
    import flax.linen as nn

    missing: dict[str, None] = {}
    seen: set[int] = set()

    def visit_class(cls, fullname: str) -> None:
        if id(cls) in seen:
            return
        seen.add(id(cls))
        doc = vars(cls).get("__doc__")
        generated = ((dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")) and isinstance(doc, str)
                     and re.fullmatch(rf"{re.escape(cls.__name__)}\(.*\)", doc.strip(), re.S) is not None)
        if not (isinstance(doc, str) and doc.strip()) or generated:
            missing.setdefault(fullname, None)
        if issubclass(cls, nn.Module) and "__call__" in vars(cls) and not _own_doc(vars(cls)["__call__"]):
            missing.setdefault(f"{fullname}.__call__", None)
        for name, raw in vars(cls).items():
            if name.startswith("_"):
                continue
            if inspect.isclass(raw) and raw.__module__ == cls.__module__:
                visit_class(raw, f"{fullname}.{name}")
            elif isinstance(raw, (staticmethod, classmethod)):
                if not _own_doc(raw.__func__):
                    missing.setdefault(f"{fullname}.{name}", None)
            elif inspect.isfunction(raw) or isinstance(raw, (property, cached_property)):
                if getattr(raw, "__module__", cls.__module__) == cls.__module__ and not _own_doc(raw):
                    missing.setdefault(f"{fullname}.{name}", None)

    for name in _module_names(package):
        module = importlib.import_module(name)
        if not _own_doc(module):
            missing.setdefault(name, None)
        for attr in _public_names(module):
            obj = getattr(module, attr, None)
            where = getattr(obj, "__module__", None) or ""
            if not (where == package or where.startswith(package + ".")):
                continue
            if inspect.isclass(obj):
                visit_class(obj, f"{where}.{obj.__qualname__}")
            elif inspect.isfunction(obj) and id(obj) not in seen:
                seen.add(id(obj))
                if not _own_doc(obj):
                    missing.setdefault(f"{where}.{obj.__qualname__}", None)
    return list(missing)


def test_public_api_has_docstrings():
    names = undocumented("resjax")
    assert not names, f"{len(names)} public object(s) without a docstring of their own:\n  " + "\n  ".join(names)


def _public_callables():
    """(qualified name, function) for every public function of resjax, each public method of its classes and
    each flax module's ``__call__``, where they are defined."""
    import flax.linen as nn

    for name in _module_names("resjax"):
        module = importlib.import_module(name)
        for attr in _public_names(module):
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


def test_the_docstring_check_finds_a_missing_docstring(monkeypatch):
    """``undocumented`` is not vacuous: a public function whose docstring is removed is reported."""
    from resjax.train import ondevice

    monkeypatch.setattr(ondevice.make_train, "__doc__", None)
    assert "resjax.train.ondevice.make_train" in undocumented("resjax")
    assert resjax.__doc__
