"""Keeping the host program's logging as it was around the libraries resjax uses (private).

Orbax and Grain log through absl, and absl's ``logging.log`` -- like the standard ``logging.info`` -- runs
``logging.basicConfig()`` when the root logger has no handler. Importing Orbax does so (a ``vlog`` in its
array handler's constructor), and so does nearly every call into it; after that a user's own
``logging.basicConfig(level=INFO)`` did nothing. So resjax imports Orbax and Grain only where it uses them,
through ``quiet_import``, and runs its calls into them inside ``root_logger_kept``: a root logger that had no
handler before has none after (the handler absl added is removed; what it printed meanwhile stays printed,
and warnings still reach stderr through Python's last-resort handler). A root logger that had handlers (the
user configured logging) is left alone. ``tests/test_import_hygiene.py`` checks that importing any resjax
module changes no logger, JAX setting, signal handler, warnings filter or environment variable.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from types import ModuleType

__all__ = ["quiet_import", "root_logger_kept"]


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """Run the block; if the root logger had no handler before it, remove the handlers added during it."""
    root = logging.getLogger()
    had = list(root.handlers)
    try:
        yield
    finally:
        if not had:
            for handler in list(root.handlers):
                root.removeHandler(handler)


def quiet_import(name: str) -> ModuleType:
    """``importlib.import_module(name)`` inside ``root_logger_kept``."""
    with root_logger_kept():
        return importlib.import_module(name)
