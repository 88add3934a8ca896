"""Draw the lifecycles: Mermaid, Graphviz DOT, SVG or a Markdown page, from their tables.

``actorserve diagram KIND --format mermaid|dot|svg|markdown [--out FILE]
[--layout auto|graphviz|python]``, where KIND is one of the lifecycles (generation, pooling,
control, server, health, scheduler, session) or ``all``.

* One kind: the text goes to stdout, or to ``--out`` (a directory gets ``KIND.<ext>``).
* ``all`` with mermaid or dot: every diagram, each under a comment header naming it, on
  stdout or in one ``--out`` file; if ``--out`` is a directory, one ``KIND.<ext>`` each.
* ``all`` with svg: ``--out`` must be a directory (created if missing); one ``KIND.svg``
  each. Anything else is a usage error (exit status 2).
* svg is laid out by Graphviz's ``dot`` when it is installed (``--layout auto``, the default;
  a note on stderr says when it is not and the built-in layout is used), or as asked:
  ``--layout graphviz`` fails (exit status 2) without ``dot``, ``--layout python`` never
  runs it.
* markdown: the ``docs/lifecycles.md`` page for one kind or for all of them
  (``make diagrams`` runs ``actorserve diagram all --format markdown --out docs/lifecycles.md``).

Rendering is pure (`statemachines.diagram`); only this module writes files.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from .diagram import to_dot, to_markdown, to_mermaid, to_svg
from .graphviz_layout import dot_version
from .lifecycles import LIFECYCLES
from .svg import LAYOUTS

FORMATS = {"mermaid": (to_mermaid, "mmd", "%%"), "dot": (to_dot, "dot", "//"),
           "svg": (to_svg, "svg", None)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=[*LIFECYCLES, "all"], metavar="KIND",
                   help=f"one of {', '.join(LIFECYCLES)}, or all")
    p.add_argument("--format", "-f", choices=["mermaid", "dot", "svg", "markdown"],
                   default="mermaid", help="output format (default: mermaid)")
    p.add_argument("--out", "-o", type=Path, default=None,
                   help="file to write (a directory for svg with all); default: stdout")
    p.add_argument("--layout", choices=LAYOUTS, default="auto",
                   help="svg layout: graphviz (dot), python (built in), or auto: graphviz "
                        "when dot is installed (default)")


def _error(msg: str) -> int:
    print(f"actorserve diagram: error: {msg}", file=sys.stderr)
    return 2


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    kinds = list(LIFECYCLES) if args.kind == "all" else [args.kind]
    out: Path | None = args.out
    if args.format == "markdown":
        text = to_markdown([LIFECYCLES[k] for k in kinds])
        if out is not None and out.is_dir():
            out = out / ("lifecycles.md" if args.kind == "all" else f"{args.kind}.md")
        if out is None:
            sys.stdout.write(text)
        else:
            _write(out, text)
        return 0

    render, ext, comment = FORMATS[args.format]
    if args.format == "svg":
        layout = args.layout
        if layout != "python" and dot_version() is None:
            if layout == "graphviz":
                return _error("--layout graphviz needs Graphviz's `dot` (apt-get install "
                              "graphviz, or `make setup`)")
            print("note: Graphviz's `dot` not found; using the built-in layout "
                  "(`make setup` installs graphviz)", file=sys.stderr)
            layout = "python"
        render = functools.partial(to_svg, layout=layout)
    to_dir = out is not None and out.is_dir()
    if args.kind == "all" and args.format == "svg":
        if out is None:
            return _error("'all --format svg' writes one KIND.svg per kind: "
                          "--out must name a directory")
        if out.exists() and not out.is_dir():
            return _error(f"--out {out} is not a directory ('all --format svg' writes "
                          "one KIND.svg per kind)")
        if out.suffix.lower() == ".svg":
            return _error(f"--out {out} looks like a file; 'all --format svg' needs a directory")
        out.mkdir(parents=True, exist_ok=True)
        to_dir = True
    if to_dir:
        for k in kinds:
            _write(out / f"{k}.{ext}", render(LIFECYCLES[k]))
        return 0
    if len(kinds) == 1:
        text = render(LIFECYCLES[kinds[0]])
    else:
        text = "\n".join(f"{comment} {k}\n{render(LIFECYCLES[k])}" for k in kinds)
    if out is None:
        sys.stdout.write(text)
    else:
        _write(out, text)
    return 0
