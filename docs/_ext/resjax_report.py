"""The experiments' pages, generated as the site builds from ``docs/report/`` and the experiments' code.

One directive, ``experiment-report``, renders one part of an experiment's committed results::

    ```{experiment-report} degradation
    :part: claims
    ```

``:part:`` is one of

- ``claims``: the claim table (claim, source, the seed document's value, measured, holds), evaluated from
  ``docs/report/<name>/results.json`` by the experiment's ``CLAIMS`` exactly as ``experiments.reproduce`` writes
  ``REPORT.md`` (``experiments.reproduce.claim_rows``), with the run's time and the settings that differ from the
  seed document's;
- ``tables``: the experiment's own tables beyond the claims (its ``report_section(metrics)``; nothing if it has
  none);
- ``figure``: ``docs/report/<name>/<name>.png``;
- ``settings``: every setting of the default size (``get_config('default')``) as a flag, with the value the
  committed run used and its help text;
- ``command``: the command that reruns it, and what ``--quick`` and ``--full`` change.

Nothing is copied by hand: rebuild the site after ``docs/report/`` changes and the pages follow. A missing
results file, a claim that cannot be evaluated or an unknown experiment is an error of the build.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

PARTS = ("claims", "tables", "figure", "settings", "command")


def _report_dir(app) -> Path:
    return Path(app.srcdir) / "report"


class ExperimentReport(SphinxDirective):
    required_arguments = 1
    option_spec = {"part": lambda arg: directives.choice(arg, PARTS)}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        part = self.options.get("part", "claims")
        from experiments import reproduce

        if name not in reproduce.REGISTRY:
            raise self.error(f"experiment-report: {name!r} is not an experiment of experiments.reproduce.REGISTRY")
        module = importlib.import_module(f"experiments.{name}")
        folder = _report_dir(self.env.app) / name
        results_path = folder / "results.json"
        if not results_path.is_file():
            raise self.error(f"experiment-report: {results_path} does not exist (run experiments.reproduce)")
        self.env.note_dependency(str(results_path))
        results = json.loads(results_path.read_text())
        text = getattr(self, f"_{part}")(module, name, results, folder)
        if not text:
            return []
        container = nodes.container(classes=["experiment-report", f"experiment-{part}"])
        self.state.nested_parse(self.content_offset_lines(text), self.content_offset, container)
        return [container]

    def content_offset_lines(self, text: str):
        from docutils.statemachine import StringList

        return StringList(text.splitlines(), source=self.env.docname)

    # the parts ---------------------------------------------------------------------------------------------------
    def _claims(self, module, name, results, folder) -> str:
        from experiments import common, image_runs, reproduce

        rows = reproduce.claim_rows(module, results)
        missing = [r for r in rows if str(r[3]).startswith("missing")]
        if missing:
            raise self.error(f"experiment-report: claims of {name} cannot be evaluated from {folder}: "
                             + "; ".join(f"{r[0]}: {r[3]}" for r in missing))
        lines = [reproduce.summary(rows, 1), ""]
        if image_runs.not_measured(results["metrics"]):
            lines += ["**Not measured.** The committed run trained on the synthetic stand-in data (`--quick`): the "
                      "data set was not prepared on the machine that made the report, so it checks the pipeline and "
                      "measures nothing the seed document claims.", ""]
        changed = common.changed_settings(module, results.get("config"))
        if changed:
            lines += ["Settings of this run that differ from the seed document's (the default size): "
                      + ", ".join(f"`{k}` {common.show_value(v)}" for k, v in changed.items()) + ".", ""]
        lines += [f"The committed run took {results['seconds']:.0f} s "
                  "(`docs/report/`, a default run on this project's 2-core CPU).", ""]
        lines += ["| claim | source | seed document | measured | holds |", "|---|---|---|---|---|"]
        for text, source, seed_value, measured, ok in rows:
            cells = [reproduce.table_text(c) for c in (text, source, seed_value)] + [measured, ok]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        return "\n".join(lines)

    def _tables(self, module, name, results, folder) -> str:
        if not hasattr(module, "report_section"):
            return ""
        return module.report_section(results["metrics"])

    def _figure(self, module, name, results, folder) -> str:
        png = folder / f"{name}.png"
        if not png.is_file():
            raise self.error(f"experiment-report: the figure {png} does not exist")
        page_dir = (Path(self.env.srcdir) / self.env.docname).parent
        relative = Path(*([".."] * len(page_dir.relative_to(self.env.srcdir).parts))) / "report" / name / png.name
        return f"![The figure of {name}, from docs/report/{name}/{name}.png]({relative.as_posix()})"

    def _settings(self, module, name, results, folder) -> str:
        import ml_collections
        from experiments import common

        default = common.flatten(module.get_config("default"))
        ran = common.flatten(ml_collections.ConfigDict(common.to_jsonable(results["config"])))
        lines = ["| flag | default | committed run | meaning |", "|---|---|---|---|"]
        for key, value in default.items():
            helptext = common.help_for(module, key) or ""
            used = common.show_value(ran[key]) if key in ran else "(not in this run)"
            shown = common.show_value(value)
            cells = [f"`--{key}`", f"`{shown}`", "same" if used == shown else f"`{used}`", " ".join(helptext.split())]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines)

    def _command(self, module, name, results, folder) -> str:
        from experiments import common

        quick = common.size_changes(module, "quick")
        full = common.size_changes(module, "full")
        lines = ["```bash", f"python -m experiments.{name}                # writes runs/{name}/results.json and "
                 f"{name}.png", f"python -m experiments.{name} --quick        # minutes; runs/{name}-quick",
                 f"python -m experiments.{name} --help", "```", ""]
        lines.append("`--quick` changes: " + ("; ".join(f"`{c}`" for c in quick) if quick else "nothing") + ".")
        lines.append("")
        lines.append("`--full` changes: " + ("; ".join(f"`{c}`" for c in full) if full else "nothing") + ".")
        return "\n".join(lines)


#: The API reference's pages: (module, what it holds), one page each. Their text is written into ``docs/api/`` (git
#: ignores it) when the build starts, from the modules as they are (``api_pages``). ``tests/test_docs.py`` checks
#: that every public module of ``resjax`` is here and that every name of each one's ``__all__`` has an entry.
API_PACKAGES = (
    ("resjax.nn", "Modules: residual blocks, MLPs, ResNets, DenseNet, U-Net, hourglass, norms, initialisers; "
                  "`build_model` builds any of them from a config."),
    ("resjax.train", "Training: run configs, the trainers, grids, optimisers, schedules, logs, checkpoints, several "
                     "devices and processes."),
    ("resjax.data", "Data: MNIST-1D, your own arrays, the host's image sources."),
    ("resjax.analysis", "Analyses: signal propagation, gradients, paths, BatchNorm, your own model."),
    ("resjax.interop", "PyTorch weights in and out."),
    ("resjax.paths", "Where runs live: local folders and bucket URLs through one path layer."),
    ("resjax.launch", "One program as several JAX processes on this machine (`python -m resjax.launch`)."),
)


def _is_data(obj) -> bool:
    """Whether autodoc documents ``obj`` as data (a constant), not as a class, function or module."""
    return not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj))


def _assigned_names(module) -> set[str]:
    """The names ``module``'s source assigns at its top level (where a constant is defined, and its ``#:``
    comment is read)."""
    import ast

    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def entry_module(package, name: str) -> str:
    """The module whose entry documents ``package.name``: where the class or function is defined, or the module
    that assigns the constant; the package itself if that is a private module (whose names the package's page
    documents) or if none of its modules is found."""
    import pkgutil

    obj = getattr(package, name)
    if not _is_data(obj):
        where = getattr(obj, "__module__", None) or package.__name__
    else:
        subs = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
        where = next((m for m in [package.__name__, *subs]
                      if name in _assigned_names(importlib.import_module(m))
                      and getattr(importlib.import_module(m), name, None) is obj), package.__name__)
    inside = where.startswith(package.__name__ + ".")
    return where if inside and not where.rsplit(".", 1)[1].startswith("_") else package.__name__


def export_groups(package) -> list[tuple[str, list[str]]]:
    """``package.__all__`` in groups for the reader: the groups its source marks with a comment in ``__all__``
    (``# functions``, ``# paths``), or else by kind (constants, classes, functions)."""
    import ast
    import io
    import tokenize

    names = list(package.__all__)
    try:
        source = inspect.getsource(package)
    except (OSError, TypeError):
        source = ""
    node = next((n for n in ast.parse(source).body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 and any(isinstance(t, ast.Name) and t.id == "__all__"
                         for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))), None)
    groups: list[tuple[str, list[str]]] = []
    if node is not None:
        text = "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                title = token.string.lstrip("#").strip()
                groups.append((title[:1].upper() + title[1:], []))
            elif token.type == tokenize.STRING and groups:
                groups[-1][1].append(ast.literal_eval(token.string))
    if groups and sorted(n for _, group in groups for n in group) == sorted(names):
        return [(title, group) for title, group in groups if group]
    kinds = (("Constants", lambda o: _is_data(o)), ("Classes", inspect.isclass),
             ("Functions", lambda o: not _is_data(o) and not inspect.isclass(o)))
    by_kind = [(title, [n for n in names if test(getattr(package, n))]) for title, test in kinds]
    return [(title, group) for title, group in by_kind if group]


def _summary(package) -> list[str]:
    """Tables of the names ``package`` exports, in groups, each row linked to the name's entry."""
    lines = []
    for title, group in export_groups(package):
        lines += [f"### {title}", "", "```{eval-rst}", ".. autosummary::", "   :nosignatures:", ""]
        # relative to the package, the current module (autosummary refuses names that repeat it)
        lines += ["   ~" + f"{entry_module(package, name)}.{name}"[len(package.__name__) + 1:] for name in group]
        lines += ["```", ""]
    return lines


_DIRECTIVES = {"class": "autoclass", "exception": "autoexception", "data": "autodata", "function": "autofunction"}


def _own_entries(package) -> list[str]:
    """Directives documenting the exported names that are defined in the package itself."""
    lines = []
    for name in package.__all__:
        if entry_module(package, name) != package.__name__:
            continue
        obj = getattr(package, name)
        kind = ("exception" if inspect.isclass(obj) and issubclass(obj, BaseException) else "class"
                if inspect.isclass(obj) else "data" if _is_data(obj) else "function")
        lines += [f".. {_DIRECTIVES[kind]}:: {package.__name__}.{name}", ""]
    return ["```{eval-rst}", *lines, "```", ""] if lines else []


def api_pages() -> dict[str, str]:
    """``{file name: MyST text}`` of the API reference: an index and one page per module of ``API_PACKAGES``.

    A package's page has its docstring; tables of the names it exports (``__all__``, in the groups of
    ``export_groups``), each with its summary and linked to its entry; the entries of the names the package
    defines itself; and every public module of the package (``automodule``: members, type hints in the
    signatures), where the other exported names have their entries. A module's page is its ``automodule``."""
    import pkgutil

    pages = {}
    for name, what in API_PACKAGES:
        module = importlib.import_module(name)
        short = name.split(".", 1)[1]
        lines = [f"# `{name}`", "", what, ""]
        if not hasattr(module, "__path__"):
            lines += ["```{eval-rst}", f".. automodule:: {name}", "```", ""]
            pages[f"{short}.md"] = "\n".join(lines)
            continue
        subs = [m.name for m in pkgutil.iter_modules(module.__path__) if not m.name.startswith("_")]
        lines += ["```{eval-rst}", f".. automodule:: {name}", "   :no-members:", "```", ""]
        if getattr(module, "__all__", None):
            lines += ["## Exported names", "", f"Every name in these tables is importable from `{name}` (`from {name} "
                      "import ...`) and links to its entry, below or in the section of the module that defines it.", ""]
            lines += _summary(module)
            own = _own_entries(module)
            if own:
                lines += [f"## Defined in `{name}` itself", ""] + own
        for sub in subs:
            lines += [f"## `{name}.{sub}`", "", "```{eval-rst}", f".. automodule:: {name}.{sub}", "```", ""]
        pages[f"{short}.md"] = "\n".join(lines)
    toc = "\n".join(n.split(".", 1)[1] for n, _ in API_PACKAGES)
    pages["index.md"] = f"""# API reference

For a researcher looking up a name: every public module, class and function of resjax with its type hints and
docstring, generated from the code as the site builds. Each package's page starts with tables of the names the
package exports, each with its one-line summary, and then documents each of its modules.

```{{toctree}}
:maxdepth: 1

{toc}
```

The top-level package:

```{{eval-rst}}
.. automodule:: resjax
```
"""
    return pages


def write_api_pages(app) -> None:
    """Write ``docs/api/*.md`` (only files whose text changed, so that an unchanged reference is not rebuilt)."""
    folder = Path(app.srcdir) / "api"
    folder.mkdir(exist_ok=True)
    pages = api_pages()
    for stale in set(p.name for p in folder.glob("*.md")) - set(pages):
        (folder / stale).unlink()
    for file, text in pages.items():
        path = folder / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def setup(app):
    app.add_directive("experiment-report", ExperimentReport)
    app.connect("builder-inited", write_api_pages)
    app.connect("autodoc-process-docstring", _process_docstring, priority=600)  # after napoleon's (500)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


# The docstrings, written for reading in the source and in a terminal, as reStructuredText ---------------------------
_UNDERLINE = re.compile(r"^\s*([-=~^])\1{2,}\s*$")
_LIST_ITEM = re.compile(r"^(\s*)([-*+] |\d+[.)] )")
_LITERAL = re.compile(r"(``.*?``)")


def _escape_bars(line: str) -> str:
    """``|W|`` outside inline literals is a norm, not a substitution reference: escape its bars."""
    if line.lstrip().startswith(("|", "+-")):  # an rst line block or grid table
        return line
    parts = _LITERAL.split(line)
    return "".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _in_list_item(lines: list[str], i: int) -> bool:
    """Whether line ``i`` is a list item or the continuation of one (a paragraph line inside it)."""
    if _LIST_ITEM.match(lines[i]):
        return True
    for k in range(i - 1, -1, -1):
        if not lines[k].strip():
            return False
        if _LIST_ITEM.match(lines[k]):
            return _indent(lines[k]) < _indent(lines[i])
        if _indent(lines[k]) < _indent(lines[i]):
            return False
    return False


def tidy_docstring(lines: list[str]) -> list[str]:
    """The docstring's lines with the plain-text habits that reStructuredText misreads made explicit:

    - a paragraph that ends with ``:`` followed by a more indented block (an aligned table of settings or
      fields) ends with ``::`` instead, so the block shows as written (a literal block);
    - a list that starts right after a paragraph line gets the blank line rst needs before it;
    - a section title's underline is made as long as its title;
    - ``|`` outside inline literals (norms, ``|W|``) is escaped.
    """
    out: list[str] = []
    for i, line in enumerate(lines):
        prev = out[-1] if out else ""
        if _UNDERLINE.match(line) and prev.strip() and not _UNDERLINE.match(prev):
            line = line.strip()[0] * max(len(prev.strip()), len(line.strip()))
            out.append(" " * _indent(prev) + line)
            continue
        item = _LIST_ITEM.match(line)
        if item and prev.strip() and not _LIST_ITEM.match(prev) and _indent(prev) == len(item.group(1)) \
                and not prev.rstrip().endswith("::"):
            # a list right after its paragraph (at the same indentation): rst wants a blank line before it
            if not any(_LIST_ITEM.match(p) for p in out[-5:]):
                out.append("")
        out.append(_escape_bars(line))
    # paragraphs ending in ':' before a more indented block that is not already literal or a field list
    result = list(out)
    for i, line in enumerate(out):
        stripped = line.rstrip()
        if not stripped.endswith(":") or stripped.endswith("::") or stripped.lstrip().startswith(":"):
            continue
        if _in_list_item(out, i):  # a list item's text: what follows it is the item's continuation
            continue
        j = i + 1
        while j < len(out) and not out[j].strip():
            j += 1
        if j >= len(out):
            continue
        block = out[j]
        if _indent(block) > _indent(line) and not _LIST_ITEM.match(block) and not block.lstrip().startswith(":"):
            result[i] = stripped + ":" + ("\n" if j == i + 1 else "")  # a blank line before the literal block
    # napoleon's ``:ivar name:`` links the name to every attribute of that name in the package (ambiguous):
    # a plain field instead, which shows the same
    result = [re.sub(r"^(\s*):ivar ([^:]+):", r"\1:\2:", line) for line in result]
    # and a ``:vartype``: the docstrings give no types there (annotations do), so napoleon read a parenthesis as one
    result = [re.sub(r"^(\s*):vartype ([^:]+):", r"\1:\2 (of):", line) for line in result]
    return "\n".join(result).split("\n")


def untyped(lines: list[str]) -> list[str]:
    """A constant's, attribute's or property's docstring as written, where napoleon took its first line up to a
    colon for a type: ``The values of train.seed_axis: how ...`` became the description ``how ...`` with the field
    ``:type: The values of train.seed_axis``. resjax's docstrings are prose; none gives a type so (a property's
    type is its annotation, in the signature)."""
    if len(lines) < 2 or lines[-2] != "" or not lines[-1].startswith(":type: "):
        return lines
    kind, body = lines[-1][len(":type: "):], lines[:-2]
    first = next((i for i, line in enumerate(body) if line.strip()), None)
    if first is None:
        return [kind]
    return [*body[:first], f"{kind}: {body[first].lstrip()}", *body[first + 1:]]


def _process_docstring(app, what, name, obj, options, lines) -> None:
    if what in ("data", "attribute", "property"):
        lines[:] = untyped(lines)
    lines[:] = tidy_docstring(lines)
