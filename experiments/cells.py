"""Cells: an experiment's networks as one setting, ``KIND:DEPTH[:WIDTH]`` each (``--cells plain:8,residual_bn:16``).

An experiment names its kinds (``{kind: depth -> model fields}``); ``parse_cells`` reads a cell list (refusing an
unknown kind, a depth or width that is not an integer >= 1, a repeated name, with a ``ValueError`` naming the
setting) and ``cells_help`` writes its help line.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

CELL_SYNTAX = "KIND:DEPTH[:WIDTH]"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One network of an experiment's cell list, written ``KIND:DEPTH[:WIDTH]`` on the command line
    (``residual_bn:16``). ``name`` is its name in the metrics, ``<kind>_d<depth>`` (``_w<width>`` added when a
    width is given); ``model`` the model fields its kind makes for that depth (and width)."""

    kind: str
    depth: int
    width: int | None
    name: str
    model: dict


def parse_cell(spec: str, kinds: dict[str, Callable[[int], dict]], setting: str = "cells") -> Cell:
    """``'residual_bn:16'`` as a :class:`Cell` of one of ``kinds`` (``{kind: depth -> model fields}``);
    ``ValueError`` naming ``setting`` for an unknown kind or a depth or width that is not an integer >= 1."""
    known = ", ".join(kinds)
    parts = [p.strip() for p in str(spec).split(":")]
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"{setting}: {spec!r} is not a cell; write {CELL_SYNTAX}, e.g. {next(iter(kinds))}:8 "
                         f"(kinds: {known})")
    kind = parts[0]
    if kind not in kinds:
        raise ValueError(f"{setting}: unknown cell kind {kind!r} in {spec!r}; known kinds: {known}")
    numbers = []
    for what, text in zip(("depth", "width"), parts[1:]):
        if not re.fullmatch(r"\d+", text) or int(text) < 1 or int(text) > 2**31 - 1:
            raise ValueError(f"{setting}: the {what} in {spec!r} must be an integer >= 1, got {text!r}")
        numbers.append(int(text))
    depth, width = numbers[0], (numbers[1] if len(numbers) > 1 else None)
    model = dict(kinds[kind](depth))
    if width is not None:
        model["width"] = width
    return Cell(kind, depth, width, f"{kind}_d{depth}" + (f"_w{width}" if width is not None else ""), model)


def parse_cells(specs, kinds: dict[str, Callable[[int], dict]], setting: str = "cells",
                taken: tuple[str, ...] = ()) -> list[Cell]:
    """Every cell of ``specs`` (a tuple of ``KIND:DEPTH[:WIDTH]`` strings, or one comma-separated string);
    ``ValueError`` naming ``setting`` for a bad cell or one whose name repeats (also a name in ``taken``)."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    cells, seen = [], set(taken)
    for spec in specs:
        cell = parse_cell(spec, kinds, setting)
        if cell.name in seen:
            raise ValueError(f"{setting}: the cell {cell.name} ({spec!r}) is given twice")
        seen.add(cell.name)
        cells.append(cell)
    return cells


def cells_help(kinds: dict[str, Callable[[int], dict]], what: str) -> str:
    """A cell list's help line: what it holds, the syntax and every kind with the model it builds."""
    def show(kind):
        fields = {k: v for k, v in kinds[kind](1).items() if k not in ("depth", "num_blocks")}
        return f"{kind} ({', '.join(f'{k}={v}' for k, v in fields.items())})"
    return (f"{what}: comma-separated {CELL_SYNTAX} (DEPTH: hidden layers or residual blocks; WIDTH: default "
            f"model.width), e.g. \"plain:8,residual_bn:16\"; a leading + adds to the default list "
            f"(\"+residual_bn:16\"); metric names are <kind>_d<depth>. Kinds: {'; '.join(show(k) for k in kinds)}")
