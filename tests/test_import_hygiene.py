"""Importing resjax changes nothing of the program it is imported into: no logger (the root logger's handlers
and level, and every logger that existed: level, handlers, propagate, disabled), no JAX setting
(``jax.config``), no signal handler, no warnings filter, no environment variable. Each check runs in a fresh
interpreter that has imported what a Flax user's program has (jax, flax, optax, numpy), then imports every
module of resjax (``pkgutil.walk_packages``) and compares.

Orbax's and Grain's imports call absl's logging, which (as ``logging.info`` does) runs ``logging.basicConfig()``
when the root logger has no handler: a user's later ``logging.basicConfig(level=INFO)`` then did nothing.
resjax imports them only where they are used (``resjax.train.checkpoint``, ``resjax.data.source``), and puts
the root logger's handlers back after each call into them (``resjax._quiet``)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SNAPSHOT = textwrap.dedent('''
    import json, logging, os, pkgutil, signal, sys, warnings
    import numpy, jax, flax.linen, optax  # what a Flax user's program has imported already

    SIGNALS = [s for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGCHLD",
                           "SIGALRM") if hasattr(signal, s)]

    def snapshot():
        loggers = {"": logging.getLogger()}
        loggers.update({n: l for n, l in logging.Logger.manager.loggerDict.items() if isinstance(l, logging.Logger)})
        return {
            "loggers": {n: [l.level, [repr(h) for h in l.handlers], l.propagate, l.disabled]
                        for n, l in loggers.items()},
            "jax": {k: repr(v) for k, v in jax.config.values.items()},
            "signals": {s: repr(signal.getsignal(getattr(signal, s))) for s in SIGNALS},
            "warnings": [repr(f) for f in warnings.filters],
            "environ": dict(os.environ),
            "excepthook": repr(sys.excepthook),
        }

    before = snapshot()
    import resjax
    modules = [m.name for m in pkgutil.walk_packages(resjax.__path__, "resjax.")]
    for name in sys.argv[1:] or ["resjax"] + modules:
        __import__(name)
    after = snapshot()
    changed = {}
    for part in before:
        if part == "loggers":  # loggers that existed before: unchanged (new ones, a library's own, may appear)
            changed[part] = {n: [v, after[part][n]] for n, v in before[part].items() if after[part][n] != v}
        elif isinstance(before[part], dict):
            keys = set(before[part]) | set(after[part])
            changed[part] = {k: [before[part].get(k), after[part].get(k)] for k in keys
                             if before[part].get(k) != after[part].get(k)}
        elif before[part] != after[part]:
            changed[part] = [before[part], after[part]]
    print(json.dumps({"changed": {k: v for k, v in changed.items() if v}, "imported": len(modules),
                      "root_handlers": after["loggers"][""][1]}))
''')


def _run(*modules: str, code: str = _SNAPSHOT) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_resjax_module_changes_no_logger_jax_setting_signal_or_filter():
    result = _run()
    assert result["imported"] >= 40, result  # every module of resjax, not only the packages
    assert result["changed"] == {}, json.dumps(result["changed"], indent=1)[:3000]
    assert result["root_handlers"] == []


def test_the_issues_one_liner_prints_no_root_handler():
    """The issue's check, as written: ``import logging, resjax.train, resjax.nn, resjax.analysis,
    resjax.data; print(logging.getLogger().handlers)`` prints ``[]``; and a ``basicConfig`` after it works."""
    code = ("import logging, resjax.train, resjax.nn, resjax.analysis, resjax.data\n"
            "print(logging.getLogger().handlers)\n"
            "logging.basicConfig(level=logging.INFO, format='user:%(message)s')\n"
            "logging.getLogger('mine').info('hello')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
    assert "user:hello" in out.stderr


def test_using_orbax_through_resjax_leaves_the_root_logger_as_it_was(tmp_path):
    """Saving and restoring a checkpoint (the calls that import Orbax and make it log) leaves a root logger
    without handlers without them; a handler the user set stays."""
    code = textwrap.dedent(f'''
        import logging, sys
        import jax.numpy as jnp
        from resjax.train.checkpoint import Checkpoints
        user = sys.argv[1] == "user"
        if user:
            logging.basicConfig(level=logging.WARNING)
        before = list(logging.getLogger().handlers)
        c = Checkpoints({str(tmp_path)!r} + "/" + sys.argv[1])
        c.save(1, {{"w": jnp.arange(3.0)}}, meta={{}})
        restored = c.restore({{"w": jnp.zeros(3)}})
        assert float(restored["w"][2]) == 2.0
        c.close()
        print(logging.getLogger().handlers == before, len(before))
    ''')
    for who, kept in (("nobody", "True 0"), ("user", "True 1")):
        out = subprocess.run([sys.executable, "-c", code, who], capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == kept, (who, out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("module", ["orbax.checkpoint", "grain"])
def test_the_check_sees_what_orbax_and_grain_do_on_import(module):
    """The check is not blind: importing Orbax or Grain directly (as resjax did before) adds a root handler."""
    result = _run("resjax", module)
    assert result["root_handlers"], result
    assert "" in result["changed"].get("loggers", {}), result
