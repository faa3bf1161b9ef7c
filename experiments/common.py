"""The experiment contract: config flags, ``results.json``, claims (one import for every experiment script).

``main(module)`` parses ``[--quick | --full] [--out DIR] [--<setting> VALUE ...]`` where every leaf of
the module's ``get_config(size)`` (an ``ml_collections.ConfigDict``; nested leaves as ``--a.b``) is a
flag, preflights the run (``preflight``: finite floats, counts, the module's ``check(config)`` hook that
validates every cell it will run, the output folder; a refused value is an argparse error naming its flag,
exit status 2), runs the experiment, and writes ``DIR/results.json`` =
``{"experiment", "config", "metrics", "seconds"}`` (``DIR``: ``--out``, else ``runs/<name>``, or
``runs/<name>-quick`` with ``--quick``; ``seconds``: the run's wall time over every session of it, a stopped run
and the sessions that resumed it). Metrics are flat dotted names mapping to numbers
or (nested) lists of numbers; NaN and infinities are written as JSON ``null``. Every training cell
checkpoints into ``--checkpoint_dir`` (default ``DIR/checkpoints``; ``none``: off) and the same command
resumes; ``--fresh`` starts every cell over; SIGTERM/SIGINT exit 143/130 cleanly (``experiments.checkpoints``).
A folder another running run holds (the output folder, the checkpoint folder) is refused before anything in it
changes, naming that run's process (``experiments.files``; exit status 75, ``EX_TEMPFAIL``).

This module holds nothing of its own: it re-exports the helpers, which live by concern in

- ``experiments.settings``: settings as flags (``flatten``, ``parse_value``, ``show_value``, ``default_out``);
- ``experiments.flags``: the command line (help lines, ``ArgumentParser``, ``parse_args``);
- ``experiments.preflight``: the checks before any training (``preflight``, ``check_train``, ...);
- ``experiments.cells``: ``KIND:DEPTH[:WIDTH]`` cell lists;
- ``experiments.results``: ``results.json`` values and :class:`Claim`;
- ``experiments.figures``: ``pyplot``, ``save_figure`` and panel helpers;
- ``experiments.files``: which process writes, atomic writes, folder locks;
- ``experiments.runner``: ``main``, ``run_experiment``, ``start``, ``release_memory``;
- ``experiments.checkpoints``: checkpoints, resume, stop signals.

None of these imports this module (``tests/test_import_graph.py`` keeps the imports free of circles), so a
helper module may import any module below it, never ``experiments.common``.
"""

from __future__ import annotations

from experiments.cells import CELL_SYNTAX, Cell, cells_help, parse_cell, parse_cells
from experiments.figures import (describe_optimizer, diverged_marks, integer_ticks, legend_outside, mark_diverged,
                                 plural, pyplot, save_figure)
from experiments.files import FolderInUseError, is_main, lock_folder, write_atomically
from experiments.flags import (COMMON_HELP, TRAIN_HELP, ArgumentParser, build_parser, flags_without_help, help_for,
                               parse_args, size_changes, size_help)
from experiments.preflight import (OUT_ROOM, build_models, check_batch_sizes, check_counts, check_finite,
                                   check_out_dir, check_seeds, check_train, flag_message, load_data, preflight,
                                   setting_prefix)
from experiments.results import (NEUTRAL_SETTINGS, SETTING_WORDS, Claim, changed_settings, describe_results,
                                 run_settings_note, to_jsonable)
from experiments.runner import (folder_in_use_ends_the_run, main, release_memory, run_experiment, start,
                                unusable_checkpoints_end_the_run)
from experiments.settings import (COUNT_SETTING, DICT_SETTINGS, SIZES, default_out, flatten, is_int, parse_value,
                                  set_path, show_value)

__all__ = [
    "CELL_SYNTAX", "COMMON_HELP", "COUNT_SETTING", "DICT_SETTINGS", "NEUTRAL_SETTINGS", "OUT_ROOM", "SETTING_WORDS",
    "SIZES", "TRAIN_HELP", "ArgumentParser", "Cell", "Claim", "FolderInUseError", "build_models", "build_parser",
    "cells_help", "changed_settings", "check_batch_sizes", "check_counts", "check_finite", "check_out_dir",
    "check_seeds", "check_train", "default_out", "describe_optimizer", "describe_results", "diverged_marks",
    "flag_message", "flags_without_help", "flatten", "folder_in_use_ends_the_run", "help_for", "integer_ticks",
    "is_int", "is_main", "legend_outside", "load_data", "lock_folder", "main", "mark_diverged", "parse_args",
    "parse_cell", "parse_cells", "parse_value", "plural", "preflight", "pyplot", "release_memory", "run_experiment",
    "run_settings_note", "save_figure", "set_path", "setting_prefix", "show_value", "size_changes", "size_help",
    "start", "to_jsonable", "unusable_checkpoints_end_the_run", "write_atomically",
]
