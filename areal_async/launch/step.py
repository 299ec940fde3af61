"""`python -m areal_async.launch.step --name server0 --host H [--port P] -- CMD ... {port} ...`: how a server step
starts on a node the controller cannot look into.

It picks the port (P, or a free one on this node), reports `tcp://<address>:<port>` to the controller's registry
(net/rank_registry.py; AREAL_REGISTRY and AREAL_RPC_SECRET come from the environment), removes both variables from
the environment and then becomes CMD (exec, same pid: the step's task is the server itself, so Slurm's signals
reach it), with `{port}` replaced. The controller learns the URL before the server has bound the port and polls
/health until it answers. Torch-free, and quick to start: it runs on every server node.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from areal_async.net.rank_registry import (
    REGISTRY_ENV,
    SECRET_ENV,
    Registration,
    reachable_address,
    report_sync,
    slurm_step_id,
)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m areal_async.launch.step --name NAME --host HOST [--port P] -- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m areal_async.launch.step")
    p.add_argument("--name", required=True)
    p.add_argument("--host", required=True, help="the interface the server binds")
    p.add_argument("--port", type=int, default=0, help="0: a free port on this node")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        print("step: no command after --", file=sys.stderr)
        return 2
    registry, secret_hex = os.environ.pop(REGISTRY_ENV, ""), os.environ.pop(SECRET_ENV, "")
    if not registry or not secret_hex:
        print(f"step: {REGISTRY_ENV} and {SECRET_ENV} must be set by the launcher", file=sys.stderr)
        return 2
    port = args.port or _free_port(args.host)
    address = reachable_address(f"tcp://{args.host}:{port}", registry)
    reg = Registration(
        kind="step",
        name=args.name,
        address=address,
        node=socket.gethostname(),
        pid=os.getpid(),
        slurm_step=slurm_step_id(),
    )
    print(f"step {args.name}: node {reg.node}, Slurm step {reg.slurm_step}, serving at {address}", flush=True)
    try:
        report_sync(reg, registry=registry, secret=bytes.fromhex(secret_hex))
    except (ConnectionError, OSError, ValueError) as e:
        print(f"step {args.name}: cannot report to the controller's registry at {registry}: {e}", file=sys.stderr)
        return 1
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
