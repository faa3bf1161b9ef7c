"""Start one program as several JAX processes on this machine: ``python -m resjax.launch --processes N -- CMD``.

For testing multi-process code on one host and for single-node jobs. It starts ``N`` copies of ``CMD``
with the environment that ``resjax.train.distributed.initialize_if_needed`` reads:

    JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>   (process 0 runs the coordination service there)
    JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i
    RESJAX_CPU_DEVICES=<cores // N>            (unless set: CPU devices per process, so N processes
                                               share the cores instead of each taking all of them)

Each line a process prints is passed through prefixed with ``[i]``. The exit status is 0 when every
process exits 0, else the status of the first process that failed; once one has failed, the others get
``--grace`` seconds to stop by themselves (JAX's heartbeat stops them when a peer is gone, after
``RESJAX_HEARTBEAT_TIMEOUT`` seconds, which the launcher sets to ``--heartbeat`` unless set; a process
that ended waits at most ``RESJAX_SHUTDOWN_TIMEOUT``, set to 60 s, for the others) and are then
terminated (SIGTERM, SIGKILL 10 s later). SIGINT and SIGTERM sent to the launcher are passed on to every
process. On a cluster, use the cluster's own launcher instead (``srun``, ``gcloud ... ssh --worker=all``);
see the README, "Several hosts".

    python -m resjax.launch --processes 2 -- python my_experiment.py --flag
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["free_port", "launch", "main", "parse", "parser", "process_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_env(index: int, processes: int, port: int, heartbeat: int,
                base: dict | None = None) -> dict:
    """The environment of process ``index`` of ``processes`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(index))
    env.setdefault("RESJAX_CPU_DEVICES", str(max(1, (os.cpu_count() or 1) // processes)))
    env.setdefault("RESJAX_HEARTBEAT_TIMEOUT", str(heartbeat))
    env.setdefault("RESJAX_SHUTDOWN_TIMEOUT", str(max(heartbeat, 60)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pipe(stream, index: int, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[{index}] {line.decode(errors='replace')}")
        out.flush()
    stream.close()


def launch(command: Sequence[str], processes: int, *, port: int | None = None, grace: float = 60.0,
           heartbeat: int = 30, out: TextIO | None = None) -> int:
    """Run ``command`` as ``processes`` JAX processes; returns the exit status (see the module docstring)."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes: want an integer >= 1, got {processes!r}")
    if not command:
        raise ValueError("command: nothing to run; put the program after '--'")
    if grace < 0:
        raise ValueError(f"grace: want seconds >= 0, got {grace!r}")
    out = sys.stdout if out is None else out
    port = free_port() if port is None else port
    procs = [subprocess.Popen(list(command), env=process_env(i, processes, port, heartbeat), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for i in range(processes)]
    pipes = [threading.Thread(target=_pipe, args=(p.stdout, i, out), daemon=True) for i, p in enumerate(procs)]
    for t in pipes:
        t.start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status, failed_at, reported = 0, None, set()
    try:
        while len(reported) < processes:
            for i, p in enumerate(procs):
                if i in reported or p.poll() is None:
                    continue
                reported.add(i)
                if p.returncode == 0:
                    continue
                if failed_at is None:
                    status, failed_at = p.returncode, time.monotonic()
                    out.write(f"[launch] process {i} exited with status {p.returncode}; the others get {grace:g} s "
                              "to stop\n")
                else:
                    out.write(f"[launch] process {i} exited with status {p.returncode}, "
                              f"{time.monotonic() - failed_at:.1f} s after the first failure\n")
                out.flush()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                _terminate(procs, out)
                break
            time.sleep(0.1)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    for t in pipes:
        t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return 128 + -status if status < 0 else status


def _terminate(procs: list, out) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        out.write(f"[launch] stopping {len(alive)} process(es) still running ({sig.name})\n")
        for p in alive:
            p.send_signal(sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.1)


def parser(prog: str = "python -m resjax.launch") -> argparse.ArgumentParser:
    """The command line's parser (``experiments.launch`` shares it)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, required=True, help="how many processes to start")
    p.add_argument("--port", type=int, default=None, help="the coordinator's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds the others get to stop once one process failed, before SIGTERM (default 60)")
    p.add_argument("--heartbeat", type=int, default=30,
                   help="RESJAX_HEARTBEAT_TIMEOUT for the processes unless set: seconds after which a silent peer "
                        "counts as dead (default 30)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    return p


def parse(argv: Sequence[str] | None, prog: str = "python -m resjax.launch") -> argparse.Namespace:
    """Parse and check the launcher's arguments (``ValueError``-style exits naming the setting)."""
    p = parser(prog)
    args = p.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.processes < 1:
        p.error(f"--processes: want an integer >= 1, got {args.processes}")
    if not command:
        p.error("command: nothing to run; put the program after '--'")
    if args.grace < 0:
        p.error(f"--grace: want seconds >= 0, got {args.grace}")
    if args.heartbeat < 1:
        p.error(f"--heartbeat: want whole seconds >= 1, got {args.heartbeat}")
    args.command = command
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse, launch, return the exit status."""
    args = parse(argv)
    return launch(args.command, args.processes, port=args.port, grace=args.grace, heartbeat=args.heartbeat)


if __name__ == "__main__":
    sys.exit(main())
