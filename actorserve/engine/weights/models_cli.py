"""List the embedded default models and convert GGUF weights into the local cache.

``actorserve models`` prints each embedded model: alias, role, served name, whether its
package is installed, and whether (for a GGUF) it is already converted and where.
``actorserve models convert [default|tiny|PATH]`` converts ahead of time, so the first
``serve`` starts fast; a path may be a ``.gguf`` file (converted) or an HF folder (checked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import models


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command")
    sub.add_parser("list", help="list the embedded models (the default)")
    c = sub.add_parser("convert", help="convert a GGUF model into the cache")
    c.add_argument("spec", nargs="?", default="default",
                   help="default | tiny | a .gguf file | an HF folder (default: default)")
    c.add_argument("--force", action="store_true", help="convert again even if cached")


def _list() -> int:
    print(f"cache: {models.cache_root()}")
    for alias, entry in models.EMBEDDED.items():
        src = entry.source()
        if src is None:
            state = f"not installed ({entry.pip})"
        elif not entry.is_gguf:
            state = f"ready (HF folder {src})"
        else:
            folder = models.cache_dir_for(src, entry.name)
            state = (f"converted ({folder})" if models.is_converted(folder)
                     else "not converted (run: actorserve models convert " + alias + ")")
        print(f"{alias:8} {entry.role:9} {entry.name:24} {state}")
    return 0


def _convert(spec: str, force: bool) -> int:
    try:
        if force:
            if spec in models.EMBEDDED:
                src, name = models.embedded_source(spec), models.EMBEDDED[spec].name
            else:
                src, name = Path(spec).expanduser(), None
            if src.suffix.lower() == ".gguf":
                path = models.convert_gguf(src, name, force=True)
            else:
                path = models.resolve_model(spec)
        else:
            path = models.resolve_model(spec)
    except models.ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) == "convert":
        return _convert(args.spec, args.force)
    return _list()
