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


#: The API reference's packages: (module, what it holds). Their pages are written into ``docs/api/`` (git ignores
#: it) when the build starts, from the package as it is: every public module of each package gets a section.
API_PACKAGES = (
    ("resjax.nn", "Modules: residual blocks, MLPs, ResNets, DenseNet, U-Net, hourglass, norms, initialisers."),
    ("resjax.train", "Training: run configs, the trainers, grids, optimisers, schedules, logs, checkpoints, several "
                     "devices and processes."),
    ("resjax.data", "Data: MNIST-1D, your own arrays, the host's image sources."),
    ("resjax.analysis", "Analyses: signal propagation, gradients, paths, BatchNorm, your own model."),
    ("resjax.interop", "PyTorch weights in and out."),
)


def api_pages() -> dict[str, str]:
    """``{file name: MyST text}`` of the API reference: an index and one page per package of ``API_PACKAGES``,
    each with the package's docstring, a summary of the names it exports (``__all__``, linked to where each is
    defined) and every public module of the package (``automodule``: members, type hints in the signatures)."""
    import pkgutil

    pages = {}
    for name, what in API_PACKAGES:
        module = importlib.import_module(name)
        short = name.split(".", 1)[1]
        lines = [f"# `{name}`", "", what, ""]
        subs = ([m.name for m in pkgutil.iter_modules(module.__path__) if not m.name.startswith("_")]
                if hasattr(module, "__path__") else [])
        lines += ["```{eval-rst}", f".. automodule:: {name}", "   :no-members:" if subs else "", "```", ""]
        exported = []
        for attr in getattr(module, "__all__", []) if subs else []:
            obj = getattr(module, attr)
            where = getattr(obj, "__module__", "") or ""
            if where.startswith(name + ".") and not where.rsplit(".", 1)[1].startswith("_") \
                    and getattr(obj, "__qualname__", attr) == attr:
                exported.append(f"~{where}.{attr}")
        if exported:
            lines += [f"`{name}` exports these names (`from {name} import ...`); each is documented below, in the "
                      "module that defines it:", ""]
            lines += [f"{{py:obj}}`{entry}`" + ("," if k < len(exported) - 1 else ".")
                      for k, entry in enumerate(exported)] + [""]
        for sub in subs:
            lines += [f"## `{name}.{sub}`", "", "```{eval-rst}", f".. automodule:: {name}.{sub}", "```", ""]
        pages[f"{short}.md"] = "\n".join(lines)
    toc = "\n".join(n.split(".", 1)[1] for n, _ in API_PACKAGES)
    pages["index.md"] = f"""# API reference

For a researcher looking up a name: every public module, class and function of resjax with its type hints and
docstring, generated from the code as the site builds. Each package's page lists the names the package exports
and then documents each of its modules.

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


def _process_docstring(app, what, name, obj, options, lines) -> None:
    lines[:] = tidy_docstring(lines)
