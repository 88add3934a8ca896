"""Static rules for the tests themselves (cheap: parsed, nothing run).

- A test waits for something to happen with `waiting.until` (bounded, fails with a message) or an
  exact wait (quiesce, an event, a future), never with a loop of its own: a loop that sleeps and
  can stop on a condition is a hand-written poll, and a function named like one (``until``,
  ``*_until``, ``wait_for*``, ``eventually``) is a copy of `until`. Only tests/waiting.py has one.
- Every sleep in tests/ says why on its line (or on a comment line just above it):
  ``# sleep-ok: <reason>``. A sleep that *is* what is tested (a client slow on purpose, the loop
  turns a chaos run interleaves, turns given to show something did not happen) is fine with its
  reason; a sleep that waits for something to happen is replaced by an exact wait.
  ``asyncio.sleep(0)`` is one loop turn, not wall-clock time, so a loop that yields with it is not
  counted as a poll, but it still needs its reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

TESTS = Path(__file__).parent
EXEMPT = {"waiting.py"}                         # the one polling loop
SLEEP_OK = re.compile(r"#\s*sleep-ok:\s*\w")
HELPER_NAME = re.compile(r"^_*(until|\w+_until|wait_until|wait_for\w*|eventually|poll_until)$")
SLEEP_MODULES = {"time", "asyncio", "anyio", "trio"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _comments(src: str) -> dict[int, str]:
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT}


def _sleep_names(tree: ast.AST) -> set[str]:
    """Names bound to a sleep function by ``from time import sleep [as x]`` and the like."""
    return {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] in SLEEP_MODULES for a in node.names if a.name == "sleep"}


def _is_sleep(node: ast.AST, names: set[str]) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "sleep")
            or (isinstance(node, ast.Name) and node.id in names))


def _local(nodes: list[ast.stmt]):
    """Every node under `nodes`, not entering nested functions, lambdas or classes."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, SCOPES))


def _turn(call: ast.Call) -> bool:
    """``sleep(0)``: one loop turn, no wall-clock time."""
    arg = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg in ("delay", "seconds")), None)
    return isinstance(arg, ast.Constant) and arg.value == 0


def problems(src: str, name: str = "<test>") -> list[str]:
    """What breaks the rules in one file's source, as ``name:line: why``."""
    tree = ast.parse(src)
    comments, lines = _comments(src), src.splitlines()
    names = _sleep_names(tree)
    out: list[str] = []

    def justified(first: int, last: int) -> bool:
        if any(SLEEP_OK.search(comments.get(n, "")) for n in range(first, last + 1)):
            return True
        above = first - 1
        text = lines[above - 1].lstrip() if above >= 1 else ""
        return text.startswith("#") and bool(SLEEP_OK.search(text))

    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and HELPER_NAME.match(node.name):
            out.append(f"{name}:{node.lineno}: `{node.name}` is a waiting helper of its own: "
                       "use `until` from tests/waiting.py")
        if _is_sleep(node, names):
            span = calls.get(id(node), node)
            if not justified(span.lineno, span.end_lineno or span.lineno):
                out.append(f"{name}:{node.lineno}: a sleep without `# sleep-ok: <reason>`: wait for "
                           "what must happen instead (quiesce, an event, `until`)")
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            inside = list(_local(node.body))
            sleeps = [n for n in inside if isinstance(n, ast.Call) and _is_sleep(n.func, names)
                      and not _turn(n)]
            forever = isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value
            conditional = (isinstance(node, ast.While) and not forever) or any(
                isinstance(n, (ast.Break, ast.Return)) for n in inside)
            if sleeps and conditional:
                out.append(f"{name}:{node.lineno}: a polling loop (it sleeps until a condition): "
                           "use `until` from tests/waiting.py")
    return sorted(set(out), key=lambda p: int(p.split(":")[1]))


def test_no_test_polls_on_its_own_or_sleeps_without_a_reason():
    files = sorted(p for p in TESTS.rglob("*.py") if p.name not in EXEMPT)
    assert len(files) > 50                      # the rules read the real tests
    found = [p for f in files for p in problems(f.read_text(), str(f.relative_to(TESTS.parent)))]
    assert found == [], "\n".join(found)


def test_waiting_has_the_one_poll_and_it_is_bounded():
    src = (TESTS / "waiting.py").read_text()
    assert any("polling loop" in p for p in problems(src, "waiting.py"))   # the rules would see it
    assert "loop.time() >= end" in src and "raise AssertionError" in src


def test_the_rules_catch_what_they_are_for():
    poll = ("async def t(rt):\n"
            "    for _ in range(100):\n"
            "        if rt.done:\n"
            "            break\n"
            "        await asyncio.sleep(0.01)  # sleep-ok: a reason does not make a poll fine\n")
    assert [p.split(": ")[1] for p in problems(poll)] == ["a polling loop (it sleeps until a condition)"]
    whiling = "async def t(rt):\n    while not rt.done:\n        await asyncio.sleep(0.02)\n"
    found = problems(whiling)
    assert len(found) == 2 and "polling loop" in found[0] and "sleep-ok" in found[1]
    helper = "async def _until(pred):\n    return await waiting.until(pred)\n"
    assert "waiting helper of its own" in problems(helper)[0]
    bare = "from time import sleep as nap\ndef t():\n    nap(0.5)\n    go(nap)\n"
    assert [int(p.split(":")[1]) for p in problems(bare)] == [3, 4]
    # what stays allowed: a reasoned sleep, a turn, a bounded loop with no sleep, a helper's call
    fine = ("import asyncio\n"
            "async def t(rt, clock):\n"
            "    # sleep-ok: the client is slow on purpose\n"
            "    await asyncio.sleep(0.2)\n"
            "    for _ in range(10):\n"
            "        await asyncio.sleep(0)  # sleep-ok: turns between arrivals are the chaos\n"
            "    for _ in range(100):\n"
            "        if rt.done:\n"
            "            break\n"
            "        clock.advance(1)\n"
            "        await rt.quiesce()\n"
            "        await asyncio.sleep(0)  # sleep-ok: one turn per virtual tick\n"
            "    await until(lambda: rt.done)\n")
    assert problems(fine) == []
