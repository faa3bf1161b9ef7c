"""Child of tests/test_tpu_plan_*.py: compiles resjax programs for TPU topologies (libtpu, no TPU) and prints one
JSON line per program: the plan's row (``benchmarks.tpu_plan.ProgramPlan``) with ``cpu_flops``, the same
program's dense FLOPs as the CPU would run it.

    python tests/tpu_programs.py mlp|resnet|resnet_dp|paths

Run with libtpu importable (``tests/tpu.py`` finds it) and ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.tpu_plan import Plan  # noqa: E402
from resjax.train import planning  # noqa: E402


def emit(plan: Plan, what: str) -> None:
    for p in plan.programs:
        print(json.dumps({"what": what, "hosts": plan.hosts, "chips": plan.chips,
                          "hbm": plan.chip.hbm_bytes, **dataclasses.asdict(p)}, default=float), flush=True)
    plan.programs.clear()


def mlp() -> None:
    """A degradation cell (plain MLP, 3 seeds over the 4 chips of v5e:2x2, 2 epochs of MNIST-1D) and a packed grid
    (residual MLPs of 2 and 4 blocks, 2 seeds each, one program)."""
    from experiments.degradation import CONFIGS
    from resjax.data import load_dataset
    from resjax.train import fit_grid, grid, make_train, run_config, train_config

    data = load_dataset("mnist1d")
    train = train_config(learning_rate=0.05, momentum=0.9, batch_size=100, epochs=2)
    plan = Plan("v5e:2x2", check_cpu=True)
    with planning.installed(plan):
        trainer = make_train(run_config(dict(CONFIGS["plain_d8"], width=64), train, "mnist1d"), data)
        run, history = trainer.fit([0, 1, 2], progress=False)
        assert history["test_error"].shape == (3, 2) and np.isnan(history["test_error"]).all()
        emit(plan, "degradation cell")
        deep = make_train(run_config(dict(kind="residual_mlp", num_blocks=4, width=32, norm="batch"), train,
                                     "mnist1d"), data)
        fit_grid(deep, grid(2, {"model.num_blocks": [2, 4]}), pack=True, progress=False)
        emit(plan, "packed grid")


def resnet(topology: str, seeds: tuple) -> None:
    """A CIFAR ResNet-8 on the host feeder (no test set: no evaluation program), its initialisation and training
    step, for each seed setting (0: one seed, no seed axis; S: S seeds, vmapped as on a TPU)."""
    from resjax.data import synthetic_image_dataset
    from resjax.nn.resnet import cifar_resnet
    from resjax.train import image_train_config, make_image_train, run_config

    train = image_train_config(batch_size=64, epochs=1, schedule="constant", seed_axis="vmap")
    trainer = make_image_train(run_config(train=train), synthetic_image_dataset("cifar10", 128), model=cifar_resnet(8))
    plan = Plan(topology, check_cpu=True)
    with planning.installed(plan):
        for s in seeds:
            trainer.fit(s if s == 0 else list(range(s)), progress=False)
            emit(plan, f"resnet8 {s if s else 1} seed{'s' if s else ''}")


def host_mlp() -> None:
    """A residual MLP on the host feeder, 3 seeds under seed_axis='auto': both layouts planned, one chosen."""
    from resjax.data import from_arrays
    from resjax.train import image_train_config, make_image_train, run_config

    rng = np.random.default_rng(0)
    data = from_arrays(rng.normal(size=(256, 40)).astype(np.float32), rng.integers(0, 10, 256))
    train = image_train_config(batch_size=64, epochs=2, schedule="constant")
    trainer = make_image_train(run_config(dict(kind="residual_mlp", num_blocks=2, width=32), train), data)
    plan = Plan("v5e:2x2", check_cpu=True)
    with planning.installed(plan):
        trainer.fit([0, 1, 2], progress=False)
    emit(plan, "host mlp")


def layout() -> None:
    """The host feeder's own layout rule on one v5e chip (``ImageTrainer.laid_out``, what ``fit`` runs before its
    first step on a TPU): a residual MLP's 8 seeds under ``seed_axis='auto'`` at three batch sizes, and an evaluation
    batch too large for the chip. One JSON line per case: the layout chosen and the costs the rule saw, or the
    refusal."""
    from resjax.data import from_arrays
    from resjax.train import image_train_config, make_image_train, run_config

    chip = Plan("v5e:2x2").devices[0]
    mesh = jax.sharding.Mesh(np.asarray([chip]), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rng = np.random.default_rng(0)
    data = from_arrays(rng.normal(size=(262144, 64)).astype(np.float32), rng.integers(0, 10, 262144))
    for case, batch, eval_batch in (("small", 256, 256), ("vmap too large", 262144, 256),
                                    ("eval too large", 256, 2**22)):
        train = image_train_config(batch_size=batch, eval_batch_size=eval_batch, epochs=1, schedule="constant")
        trainer = make_image_train(run_config(dict(kind="residual_mlp", num_blocks=4, width=1024), train), data,
                                   data, mesh=mesh)
        keys = jax.random.split(jax.random.key(0), 8)
        run = jax.eval_shape(trainer._compiled("init", True), keys, jnp.arange(8, dtype=jnp.int32), {})
        place = lambda t: jax.tree_util.tree_map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), t)
        batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
        args = (place(run), jax.ShapeDtypeStruct((8, batch, 64), jnp.float32, sharding=batch_sharding),
                jax.ShapeDtypeStruct((8, batch), jnp.int32, sharding=batch_sharding), {})
        said, costs = [], {}
        try:
            chosen = trainer.laid_out(args, chip, say=said.append, costs=costs)
            out = {"mode": chosen.config.train.seed_axis, "said": said}
        except planning.NoLayoutFits as err:
            out = {"refused": str(err)}
        out["costs"] = {m: dict(dataclasses.asdict(c), fits=c.fits, step_seconds=c.step_seconds)
                        for m, c in costs.items()}
        if case == "small":  # the looped program alone (no other seed's state beside it), and one seed's state
            from resjax.train.host import _nbytes, _row

            out["loop_alone"] = trainer._layout("loop").step_cost(args, chip, 1).needed
            out["state_bytes"] = _nbytes(_row(args[0]))
        print(json.dumps({"what": "layout", "case": case, **out}, default=float), flush=True)


def paths() -> None:
    """The exact path expansion of a 6-block residual MLP's Jacobian (``resjax.analysis.paths``)."""
    from resjax.analysis.paths import block_jacobians, expand_by_length, residual_stack_of
    from resjax.nn import ResidualMLP

    model = ResidualMLP(width=16, num_blocks=6, num_classes=10)
    x = jnp.ones((1, 40))
    variables = model.init(jax.random.key(0), x, train=False)
    stack = residual_stack_of(model, variables)
    fn = jax.jit(lambda x0: expand_by_length(block_jacobians(stack, x0)[0]))
    plan = Plan("v5e:2x2", check_cpu=True)
    plan.program("path expansion", fn, jax.ShapeDtypeStruct((16,), jnp.float32))
    emit(plan, "path expansion")


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "mlp":
        mlp()
    elif which == "resnet":
        resnet("v5e:2x2", (2,))
    elif which == "resnet_dp":
        resnet("v5e:4x4", (0,))
    elif which == "paths":
        paths()
    elif which == "layout":
        layout()
    elif which == "host_mlp":
        host_mlp()
    else:
        raise SystemExit(f"unknown program set {which!r}")
