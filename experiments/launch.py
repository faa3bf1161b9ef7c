"""Run an experiment as several JAX processes on this machine.

    python -m experiments.launch --processes 2 -- degradation --quick
    python -m experiments.launch --processes 2 -- reproduce --quick --out results-2p

The first word after ``--`` is an experiment (a module of ``experiments``, run as
``python -m experiments.<name>``) and the rest its flags; every process runs it, process 0 writes the
results, figures and report (see ``resjax.launch`` for the environment, the output and the exit status).
Each experiment's seed sweeps are sharded over the devices of all processes. On a cluster, start the
experiment with the cluster's launcher instead (README, "Several hosts").
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from resjax import launch as _launch

__all__ = ["command_for", "main"]


def command_for(words: Sequence[str]) -> list[str]:
    """``[python, -m, experiments.<name>, flags...]`` for ``[name, flags...]`` (``SystemExit`` naming an
    unknown experiment)."""
    name, flags = words[0], list(words[1:])
    module = f"experiments.{name.removeprefix('experiments.')}"
    if name.startswith("-") or importlib.util.find_spec(module) is None or module == "experiments.launch":
        sys.exit(f"experiment: unknown experiment {name!r}; give one of the modules in experiments/, "
                 "e.g. degradation or reproduce")
    return [sys.executable, "-m", module, *flags]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse, launch the experiment, return the exit status."""
    args = _launch.parse(argv, prog="python -m experiments.launch")
    return _launch.launch(command_for(args.command), args.processes, port=args.port, grace=args.grace,
                          heartbeat=args.heartbeat)


if __name__ == "__main__":
    sys.exit(main())
