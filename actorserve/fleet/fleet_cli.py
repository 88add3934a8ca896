"""Serve N replicas behind sglang-router, as one URL (`actorserve fleet --replicas N`).

Takes every `actorserve serve` option (each replica gets them; ``--port`` and ``--host`` are the
fleet's own URL, the replicas and the router take free loopback ports), plus ``--replicas``,
``--policy`` and ``--router-port``. Replica i is named ``r<i>`` (``--replica-id ID``:
``ID-r<i>``); ``--record DIR`` gives each its ``DIR/<name>.jsonl`` (`actorserve replay DIR`
merges them), ``--record FILE`` the file with ``.r<i>`` before its suffix. Needs the ``fleet`` extra
(``pip install 'actorserve[fleet]'``, which ``make setup`` installs).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
import sys
from pathlib import Path

from ..http.edge import serve_cli

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
_FLEET_ONLY = frozenset({"host", "port", "replicas", "policy", "router_port", "help", "ray",
                         "ray_cpus", "ray_gpus"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_cli.add_arguments(p)
    p.add_argument("--replicas", type=int, default=2, help="replica processes (default 2)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="sglang-router's load-balancing policy (default cache_aware)")
    p.add_argument("--router-port", type=int, default=None, help="the router's own port (default: free)")
    p.add_argument("--ray", default=None, metavar="ADDRESS|auto",
                   help="place each replica as a Ray actor on this cluster (auto: the one ray.init "
                        "finds, else a private one on 127.0.0.1); needs the ray extra")
    p.add_argument("--ray-cpus", type=float, default=None,
                   help="with --ray: CPUs each replica asks for (default: its --threads, else 1)")
    p.add_argument("--ray-gpus", type=float, default=0.0,
                   help="with --ray: GPUs each replica asks for (default 0; placement only, the "
                        "engine runs on the CPU)")


def _serve_actions() -> list[argparse.Action]:
    scratch = argparse.ArgumentParser(add_help=False)
    serve_cli.add_arguments(scratch)
    return [a for a in scratch._actions if a.dest not in _FLEET_ONLY]


def replica_name(args: argparse.Namespace, index: int) -> str:
    base = getattr(args, "replica_id", None)
    return f"{base}-r{index}" if base else f"r{index}"


def replica_argv(args: argparse.Namespace, index: int, port: int) -> list[str]:
    """The `actorserve serve` command line of replica `index`: every serve option the fleet was
    given that differs from serve's default."""
    argv = [sys.executable, "-m", "actorserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for action in _serve_actions():
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
            continue
        if action.dest == "replica_id":
            continue
        if action.dest == "record" and not (str(value).endswith("/") or Path(value).is_dir()):
            path = Path(value)                 # a file: one per replica; a folder: <id>.jsonl in it
            value = str(path.with_name(f"{path.stem}.r{index}{path.suffix}"))
        argv += [flag, str(value)]
    return argv + ["--replica-id", replica_name(args, index)]


def serve_args(args: argparse.Namespace, index: int) -> list[str]:
    """The serve options of replica `index` as a Ray actor takes them (it picks host and port)."""
    argv = replica_argv(args, index, 0)
    return argv[argv.index("serve") + 1:]


async def _main(args: argparse.Namespace) -> int:
    from aiohttp import web

    from .front import Front
    from .ray_fleet import RayFleet
    from .supervisor import Fleet

    fleet: Fleet | RayFleet
    if args.ray:
        fleet = RayFleet(lambda i: serve_args(args, i), args.replicas, args.policy,
                         address=args.ray, cpus=args.ray_cpus or float(args.threads or 1),
                         gpus=args.ray_gpus, router_port=args.router_port, log=sys.stderr.buffer,
                         name_of=lambda i: replica_name(args, i))
    else:
        fleet = Fleet(lambda i, port: replica_argv(args, i, port), args.replicas, args.policy,
                      router_port=args.router_port, log=sys.stderr.buffer,
                      name_of=lambda i: replica_name(args, i))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner: web.AppRunner | None = None
    supervise: asyncio.Task[None] | None = None
    try:
        starting = asyncio.ensure_future(fleet.start())
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 0
        waiter.cancel()
        starting.result()
        supervise = asyncio.ensure_future(fleet.supervise())
        runner = web.AppRunner(Front(fleet).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"actorserve fleet of {args.replicas} at http://{args.host}:{args.port} "
              f"(router {fleet.router_url}, policy {args.policy}"
              f"{', placed by Ray' if args.ray else ''})", flush=True)
        await stop.wait()
        return 0
    except RuntimeError as exc:
        print(f"actorserve fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        if supervise is not None:
            supervise.cancel()
        if runner is not None:
            await runner.cleanup()
        await fleet.stop()


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("sglang_router") is None:
        print("actorserve fleet: sglang-router is not installed: pip install 'actorserve[fleet]'",
              file=sys.stderr)
        return 2
    if args.ray and importlib.util.find_spec("ray") is None:
        print("actorserve fleet: --ray needs Ray: pip install 'actorserve[ray]'", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("actorserve fleet: --replicas must be at least 1", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))
