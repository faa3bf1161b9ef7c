"""Every Python example of the README and of the documentation site runs here, and what it states about its
results is asserted.

The examples are the README's fenced ``python`` blocks and those of every page of ``docs/`` (each block a program
of its own, as a reader copies it), and the code cells of every executed page (a tutorial: a text notebook with a
``kernelspec``), whose cells run in order as one program, as the notebook runs when the site builds. The site's
build in the tests (``tests/test_docs.py``) does not execute the tutorials; their code runs here instead, with its
stated results checked. ``docs/report/`` (generated) and ``docs/_build/`` are not read.

The blocks run as they are written, each in a module of its own, in a temporary working directory (they
write checkpoints under ``runs/``), except for what ``SMALL`` changes so that the file runs in about two minutes
on a 2-core CPU: sizes (shapes and sizes, with the stated shapes that follow from them), and a few eager calls of
a whole model run as one compiled program (``jax.jit``; ``__jit__`` in a block that does not import jax), with
the same results: run eagerly, each of the model's operations compiles a program of its own (~30 ms each, ~100 ms
an initialiser's random draw, seconds a model). Three comment forms on a line are checked:

- ``expression  # -> value``: the expression equals the Python literal ``value`` (a remark may follow
  after ``;``);
- ``statement  # raises ValueError: text``: the statement raises that exception, with ``text`` in its
  message;
- ``name = ...  # 25,557,032 parameters``: the model ``name`` has that many parameters (counted from
  ``jax.eval_shape`` of its ``init`` on the input shape ``INPUT_SHAPES[name]``).

What an executed page shows, the value of an expression on a cell's last line and what its cells print, has no
unrounded number (``UNROUNDED``: ``0.925000011920929``, a float32 shown as a Python float).

The interoperability block starts from a torchvision ResNet-50 ``state_dict`` saved as ``resnet50.npz``
where torch is installed; torch is not a test dependency, so the test writes that file from resjax's own
export of random ResNet-50 weights, whose names and shapes are torchvision's (``tests/test_interop.py`` checks
them against torchvision's layouts).
"""

from __future__ import annotations

import ast
import math
import pathlib
import re
import sys
import types
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def sources() -> list[pathlib.Path]:
    """The README and every page of the site (not the generated report, build or API pages)."""
    pages = [p for p in sorted(DOCS.rglob("*.md"))
             if not {"report", "_build", "api"} & set(p.relative_to(DOCS).parts)]
    return [README] + pages


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))

# The input shape on which a model named in a "# N parameters" comment is counted.
INPUT_SHAPES = {"resnet50": (1, 224, 224, 3), "net": (1, 224, 224, 3), "taki": (1, 32, 32, 3)}

# Smaller settings for the test (the README's own sizes take minutes on a 2-core CPU), and eager model calls run
# as one compiled program: (what the page says, what the test runs). Each stated result still holds so; every
# entry must match.
SMALL = [
    ("logits = net.apply(net.init(key, jnp.ones((1, 224, 224, 3))), jnp.ones((1, 224, 224, 3)), False)",
     "logits = jax.eval_shape(lambda: net.apply(net.init(key, jnp.ones((1, 64, 64, 3))), jnp.ones((1, 64, 64, 3)),"
     " False))"),  # DenseNet-121 traced, not run: its 120 eager initialisers alone take a minute here
    ("num_blocks=1000", "num_blocks=12"),
    ('dict(kind="residual_mlp", width=64, num_blocks=8, norm="batch")',
     'dict(kind="residual_mlp", width=16, num_blocks=2, norm="batch")'),
    ("cifar_resnet(20,", "cifar_resnet(8,"),
    ('synthetic_image_dataset("cifar10", 256)', 'synthetic_image_dataset("cifar10", 64)'),
    ('synthetic_image_dataset("cifar10", 128, split="test")', 'synthetic_image_dataset("cifar10", 32, split="test")'),
    ("epochs=2, milestones=(1,), scalar_lr_factor=0.1)",
     "epochs=2, milestones=(1,), scalar_lr_factor=0.1, batch_size=32, eval_batch_size=32)"),
    ("size=(2, 3, 224, 224)", "size=(2, 3, 64, 64)"),
    ("jnp.ones((1, 224, 224, 3))", "jnp.ones((1, 64, 64, 3))"),
    ("jnp.ones((2, 32, 32, 256))", "jnp.ones((2, 16, 16, 256))"),
    ("# -> (2, 32, 32, 256)", "# -> (2, 16, 16, 256)"),
    ("# -> (2, 32, 32, 448)", "# -> (2, 16, 16, 448)"),
    ("# -> (2, 32, 32, 2)", "# -> (2, 16, 16, 2)"),
    ("# -> [(2, 32, 32, 16), (2, 32, 32, 16)]", "# -> [(2, 16, 16, 16), (2, 16, 16, 16)]"),
    # architectures.md: each model initialised and applied as one program (the block: ~10 s so, ~21 s eagerly)
    ('y, upd = block.apply(block.init(key, x), x, True, mutable=["batch_stats"])',
     'y, upd = jax.jit(lambda x: block.apply(block.init(key, x), x, True, mutable=["batch_stats"]))(x)'),
    ('y, upd = dense.apply(dense.init(key, x[..., :64]), x[..., :64], True, mutable=["batch_stats"])',
     'y, upd = jax.jit(lambda x: dense.apply(dense.init(key, x), x, True, mutable=["batch_stats"]))(x[..., :64])'),
    ('out, inter = unet.apply(unet.init(key, x[..., :3]), x[..., :3], False, mutable=["intermediates"])',
     'out, inter = jax.jit(lambda x: unet.apply(unet.init(key, x), x, False, mutable=["intermediates"]))(x[..., :3])'),
    ("heatmaps = hourglass.apply(hourglass.init(key, x[..., :3]), x[..., :3], False)",
     "heatmaps = jax.jit(lambda x: hourglass.apply(hourglass.init(key, x), x, False))(x[..., :3])"),
    # Two epochs where a page trains on the on-device feeder for more (with the stated shapes that follow): its
    # first chunk is two epochs, and the later chunks' training is run time that the stated results do not need
    ("batch_size=128, epochs=4), data=", "batch_size=128, epochs=2), data="),  # README, mnist1d_seeds.md
    ("batch_size=128,\n                     epochs=4)", "batch_size=128,\n                     epochs=2)"),  # index.md
    # mnist1d_resnet1d.md: 20 steps in place of 200 (the 1-D ResNet's convolutions run slowly inside the on-device
    # feeder's scan on a CPU), the stated shapes that follow from them
    ("steps=200, eval_every_steps=50,", "steps=20, eval_every_steps=10,"),
    ('# -> (3, 4); 3 seeds, an evaluation every 50 of 200 steps', '# -> (3, 2); 3 seeds, an evaluation every 10 of 20 steps'),
    ("steps = 50 * np.arange(1, 5)", "steps = 10 * np.arange(1, 3)"),
    ("# -> (3, 4); per seed and epoch", "# -> (3, 2); per seed and epoch"),
    ("trainer.model.num_blocks  # -> (4, 4)", "trainer.model.num_blocks  # -> (2, 4)"),
    ('train_config(learning_rate=0.05, epochs=3), data="mnist1d")',
     'train_config(learning_rate=0.05, epochs=2), data="mnist1d")'),  # training.md
    ("# -> (3, 3); per seed and epoch", "# -> (3, 2); per seed and epoch"),
    ("weight_decay=0.05, epochs=3), data=", "weight_decay=0.05, epochs=2), data="),  # recipes.md, watching.md
    ("sorted(log.epoch.unique().tolist())  # -> [1, 2, 3]", "sorted(log.epoch.unique().tolist())  # -> [1, 2]"),
    ("train_config(learning_rate=0.1, batch_size=32, epochs=4))",
     "train_config(learning_rate=0.1, batch_size=32, epochs=2))"),  # grid.md
    ("# -> (9, 4); one row per run of the grid", "# -> (9, 2); one row per run of the grid"),
    ("dict(batch_size=16, epochs=6, learning_rate=0.05)", "dict(batch_size=16, epochs=2, learning_rate=0.05)"),
    ("# -> (4, 6); four seeds, one program", "# -> (4, 2); four seeds, one program"),  # objective.md
    ('history["test_error"].shape  # -> (2, 6)', 'history["test_error"].shape  # -> (2, 2)'),
    ("image_train_config(batch_size=32, eval_batch_size=60, epochs=3,",
     "image_train_config(batch_size=32, eval_batch_size=60, epochs=2,"),  # own_data.md (host feeder: 12 runs' steps)
    ('result.history["train_loss"].shape  # -> (12, 3)', 'result.history["train_loss"].shape  # -> (12, 2)'),
    ('frame.query("learning_rate == 0.1 and epoch == 3")', 'frame.query("learning_rate == 0.1 and epoch == 2")'),
    # nnx.md: 32 examples, so that its NNX training loop (unrolled in one program) has 4 steps, not 8
    ("rng.normal(size=(64, 8)), rng.integers(0, 3, 64)", "rng.normal(size=(32, 8)), rng.integers(0, 3, 32)"),
    ("gap = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), mine, run.state.variables())",
     "gap = jax.tree.map(float, jax.jit(lambda m, r: jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), m, r))("
     "mine, run.state.variables()))"),
    # analyses.md: the gradients' autocorrelation from a numpy array (a jax array's 126 slices compile one each)
    ("g = np.asarray(grads) - np.mean(grads)", "g = np.asarray(grads) - np.mean(np.asarray(grads))"),
    # conv_resnet_own_images.md (imports no jax): the trained ResNet-8's forward pass as one program
    ("logits = trainer.model.apply(variables, data.x_test[first], train=False)",
     "logits = __jit__(lambda v, x: trainer.model.apply(v, x, train=False))(variables, data.x_test[first])"),
    # pytorch_weights.md (imports no jax): ResNet-50's forward pass as one program (~1 s to compile; ~5 s eagerly)
    ("logits = model.apply(variables, images.transpose(0, 2, 3, 1), train=False)",
     "logits = __jit__(lambda v, x: model.apply(v, x, train=False))(variables, images.transpose(0, 2, 3, 1))"),
]

EXPECT = re.compile(r"^(?P<code>[^#].*?)\s+# -> (?P<value>[^;]+?)\s*(?:;.*)?$")
RAISES = re.compile(r"^(?P<code>[^#].*?)\s+# raises (?P<exc>\w+): (?P<text>.+?)\s*$")
PARAMS = re.compile(r"^(?P<name>\w+) = .*#\s*(?P<count>\d{1,3}(?:,\d{3})+) parameters\b")


def shrink(source: str) -> str:
    for readme, small in SMALL:
        source = source.replace(readme, small)
    return source


def _fences(text: str, name: str) -> list[tuple[str, int, int, str]]:
    """The page's fenced ``python`` blocks and code cells as (fence, line of the opening fence, line of the
    closing fence, source)."""
    found, lines, start, kind = [], text.splitlines(), None, None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() in ("```python", "```{code-cell} ipython3"):
            start, kind = i, line.strip()
        elif start is not None and line.strip() == "```":
            found.append((kind, start, i, "\n".join(lines[start:i - 1])))
            start = None
    assert start is None, f"{name}:{start}: a python block is not closed"
    return found


def python_blocks(text: str, name: str = "README.md") -> list[tuple[int, str]]:
    """A page's fenced ``python`` blocks as (line number of the fence, source), each a program of its own; and the
    code cells of an executed page (``{code-cell}``) as one program, at the line of its first cell."""
    fences = _fences(text, name)
    blocks = [(start, body) for kind, start, _, body in fences if kind == "```python"]
    cells = [(start, body) for kind, start, _, body in fences if kind != "```python"]
    if cells:
        # one program; each cell's lines keep their place (blank lines stand for the text between cells)
        first, program = cells[0][0], []
        for line_no, body in cells:
            program += [""] * (line_no - first - len(program)) + body.splitlines()
        blocks.append((first, "\n".join(program)))
    return blocks


def cell_ends(text: str, name: str = "README.md") -> list[int]:
    """The line number, in the program of ``python_blocks``, of each code cell's last line: what a notebook
    displays is the value of an expression there."""
    cells = [(start, end) for kind, start, end, _ in _fences(text, name) if kind != "```python"]
    return [end - 1 - cells[0][0] for start, end in cells if end - 1 > start]


BLOCKS = [(f"{_name(path)}:{line}", source) for path in sources()
          for line, source in python_blocks(path.read_text(), _name(path))]
# The executed pages' programs: where -> the lines whose expression's value the built page shows
DISPLAYED = {f"{_name(path)}:{python_blocks(text)[-1][0]}": cell_ends(text, _name(path))
             for path in sources() if "{code-cell}" in (text := path.read_text())}


def parameter_count(model, shape) -> int:
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones(shape)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes["params"]))


def instrument(source: str, where: str, displayed: Collection[int] = ()) -> tuple[str, int]:
    """The block with its stated results turned into checks, and how many checks it has; an expression alone on a
    line of ``displayed`` (a cell's last line, whose value the executed page shows) is passed to ``__display__``."""
    out, checks = [], 0
    for number, line in enumerate(source.splitlines(), 1):
        here = f"{where}+{number}"
        indent = line[: len(line) - len(line.lstrip())]
        body = line.strip()
        if m := RAISES.match(body):
            out.append(f"{indent}with __raises__({m['exc']}, {m['text']!r}, {here!r}):")
            out.append(f"{indent}    {m['code']}")
            checks += 1
        elif m := EXPECT.match(body):
            ast.literal_eval(m["value"])  # a typo in a page fails here, naming the line
            out.append(f"{indent}__expect__(({m['code']}), {m['value']}, {here!r})")
            checks += 1
        elif m := PARAMS.match(body):
            out.append(line)
            out.append(f"{indent}__params__({m['name']}, {m['name']!r}, {int(m['count'].replace(',', ''))}, {here!r})")
            checks += 1
        elif number in displayed and not indent and (expression := _expression(body)) is not None:
            out.append(f"__display__(({expression}), {here!r})")
        else:
            out.append(line)
    return "\n".join(out), checks


def _expression(line: str) -> str | None:
    """The expression that ``line`` consists of (without a comment), or None if it is not one whole expression."""
    try:
        tree = ast.parse(line)
    except SyntaxError:  # a line of a statement that spans several
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr) or line.rstrip().endswith(";"):
        return None
    return ast.get_source_segment(line, tree.body[0].value)


#: A number printed with more digits than a reader can use: a float32 shown as a Python float
#: (``0.925000011920929``) or a sum's rounding error (``0.30000000000000004``).
UNROUNDED = re.compile(r"(?<![\w.])\d+\.\d{8,}")


def _rounded(text: str, where: str) -> None:
    found = UNROUNDED.search(text)
    assert found is None, f"{where}: the page shows {found[0]}; round it (or format it) before showing it"


def _display(value, where):
    """What a notebook shows of a cell's last expression: its repr, checked for unrounded numbers."""
    if value is not None:
        _rounded(repr(value), where)


def _expect(value, expected, where):
    assert value == expected, f"{where}: the page states {expected!r}, the code gives {value!r}"


class _Raises:
    def __init__(self, exc, text, where):
        self.exc, self.text, self.where = exc, text, where

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        assert kind is not None, f"{self.where}: the page says this raises {self.exc.__name__}; it did not"
        assert issubclass(kind, self.exc) and self.text in str(err), (
            f"{self.where}: expected {self.exc.__name__} with {self.text!r}, got {kind.__name__}: {err}")
        return True


def _params(model, name, count, where):
    assert name in INPUT_SHAPES, f"{where}: add the input shape of {name!r} to INPUT_SHAPES"
    got = parameter_count(model, INPUT_SHAPES[name])
    assert got == count, f"{where}: the page states {count:,} parameters for {name}, counted {got:,}"


def test_the_pages_have_the_blocks_this_test_expects():
    assert len(BLOCKS) >= 15, [where for where, _ in BLOCKS]
    # Every block with a stated result has at least one check; the counts guard against a comment form
    # that this test no longer recognises after an edit.
    total = sum(instrument(source, where)[1] for where, source in BLOCKS)
    assert total >= 30, total
    unused = [text for text, _ in SMALL if not any(text in source for _, source in BLOCKS)]
    assert not unused, f"SMALL names text that is no longer in any page: {unused}"
    # every tutorial (an executed page) is run here
    tutorials = [p for p in sources() if "kernelspec:" in p.read_text()]
    assert len(tutorials) >= 4, tutorials
    assert all(any(where.startswith(_name(p) + ":") for where, _ in BLOCKS) for p in tutorials)


@pytest.fixture
def torchvision_npz(tmp_path):
    """``resnet50.npz`` as torchvision's ``state_dict`` would be saved, from resjax's export of random weights:
    numpy draws of the shapes of ResNet-50's variables (``init`` traced; compiling it would take ~5 s here),
    running variances in [0.5, 1.5)."""
    from resjax import interop
    from resjax.nn import imagenet_resnet

    model = imagenet_resnet(50)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(7), jnp.ones((1, 64, 64, 3))))
    rng = np.random.default_rng(7)
    variables = jax.tree_util.tree_map(lambda s: rng.normal(0, 0.05, s.shape).astype(s.dtype), shapes)
    variables["batch_stats"] = jax.tree_util.tree_map_with_path(
        lambda path, a: rng.uniform(0.5, 1.5, a.shape).astype(a.dtype) if path[-1].key == "var" else a,
        variables["batch_stats"])
    np.savez(tmp_path / "resnet50.npz", **interop.to_torch_state_dict(variables, model))


@pytest.mark.parametrize("where,source", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_example_runs_and_states_its_results(where, source, tmp_path, monkeypatch, request, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the tutorials' figures: drawn, not shown
    if "resnet50.npz" in source:
        request.getfixturevalue("torchvision_npz")
    code, _ = instrument(shrink(source), where, DISPLAYED.get(where, ()))
    module = types.ModuleType("doc_example")  # a real module: flax modules are dataclasses and look theirs up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    module.__dict__.update(__expect__=_expect, __raises__=_Raises, __params__=_params, __jit__=jax.jit,
                           __display__=_display)
    try:
        exec(compile(code, where, "exec"), module.__dict__)
    finally:
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    if where in DISPLAYED:  # what an executed page prints is shown on it too
        _rounded(capsys.readouterr().out, where)
