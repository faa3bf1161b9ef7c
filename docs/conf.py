"""Sphinx configuration of resjax's documentation site.

Build (from the repository root, with ``pip install -e '.[docs]'``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Pages are MyST Markdown. The tutorials are text notebooks (a ``kernelspec`` in their front matter) that myst-nb
executes while the site builds, on the CPU at small sizes; ``-D nb_execution_mode=off`` builds them without
running them (``tests/test_docs.py`` does that and runs every page's code itself). The experiments' pages read
``docs/report/*/results.json`` and the experiments' ``CLAIMS`` as the site builds (``_ext/resjax_report.py``).
Nothing is fetched from the internet: there is no intersphinx inventory, so references to other projects'
objects (jax, flax, numpy, ...) are left as text, and only resjax's own are resolved (``nitpicky``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # experiments/ (the experiments' pages read their CLAIMS); resjax if not installed
sys.path.insert(0, str(DOCS / "_ext"))

# The executed pages run on the CPU, compiled without XLA's optimisation passes (tiny programs: compiling is
# most of their time); set before a kernel starts, which inherits this environment.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("RESJAX_CPU_DEVICES", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

project = "resjax"
author = "the resjax authors"
copyright = "the resjax authors"
release = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",  # the API pages' tables of each package's exported names (no generated stubs)
    "sphinx.ext.napoleon",  # the docstrings are Google style (Args:, Returns:)
    "resjax_report",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints", "_ext"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# MyST
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings = []

# myst-nb: execute the text notebooks (the tutorials) when the site builds; a failing cell fails the build
nb_execution_mode = "auto"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# autodoc: every public name with its type hints, in the signature and in the description
autodoc_default_options = {"members": True, "show-inheritance": False, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_class_signature = "separated"
autodoc_inherit_docstrings = False
autosummary_generate = False  # the tables link to the autodoc entries of the API pages: no stub pages
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # Attributes: as fields, not objects autodoc documents again

# Every reference to resjax's own objects must resolve; other projects' (no inventories offline) stay text.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!resjax\.).*"),  # jax.Array, flax.linen.Module, numpy.ndarray, typing names, builtins ...
    (r"py:.*", r"resjax\..*\._.*"),  # private helpers named in annotations
    (r"py:class", r"resjax\..*\.[A-Z]"),  # type variables (side_by_side's T)
    (r"py:class", r"resjax\.nn\.precision\.PrecisionRepr"),  # a mixin giving modules their repr, not an API
]

html_theme = "sphinx_book_theme"
html_title = "resjax"
html_static_path = []
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_show_sourcelink = False
