"""`actorserve serve | diagram | replay | models | fleet` — one entry, each subcommand in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand name -> module that defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, str] = {
    "serve": "actorserve.http.edge.serve_cli",
    "diagram": "actorserve.statemachines.diagram_cli",
    "replay": "actorserve.replay.replay_cli",
    "models": "actorserve.engine.weights.models_cli",
    "fleet": "actorserve.fleet.fleet_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise
            continue
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP's wait policy and a short spin (`omp`): set before torch loads. glibc's arenas
    # capped (`heap`) before any library starts a thread: arenas made before stay.
    from .heap import cap_malloc_arenas
    from .omp import apply_defaults
    apply_defaults()
    cap_malloc_arenas()
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
