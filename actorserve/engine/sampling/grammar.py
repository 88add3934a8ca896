"""Grammar-constrained decoding with xgrammar: compile a constraint once, match per sequence.

Design
------
A request's constraint is plain data on its `SamplingParams`: ``grammar = (kind, spec)``.
`GrammarBackend` belongs to one engine (one vocabulary) and does three things:

* **compile** (`compile`): spec text -> an xgrammar ``CompiledGrammar``, cached by
  ``(kind, spec)`` (xgrammar's compiler caches too; this cache also says whether a call was
  cold). It validates: a bad schema, regex or grammar raises `GrammarError` with xgrammar's
  message, which the HTTP edge turns into a 400. The runtime calls it on a worker thread, so a
  large schema never holds up the event loop; the engine's step then finds it compiled.
* **match** (`ensure`): each constrained `Sequence` gets its own ``GrammarMatcher`` in
  ``seq.grammar``, created on the sequence's first sampled token and kept for its whole life, so
  it survives a pause and a retract (a recompute rebuilds KV, not the output: the matcher has
  already accepted exactly ``seq.output_ids``).
* **mask** (`mask_rows`, called by the sampler): fill each constrained row's next-token bitmask
  and set every token it forbids to ``-inf`` in the logits, before penalties, temperature and
  truncation, in the batched step. After the draw `accept` advances the matcher by the sampled
  token; it answers ``"stop"`` once the grammar has terminated (the sampler only allowed a stop
  token, or the grammar has nothing more to match) and an error string if the token was refused.
* **after reasoning**: a request with ``grammar_after_think`` (a reasoning model's) is neither
  masked nor advanced while its output is inside ``<think>`` ... ``</think>``; from the token
  after ``</think>`` on the grammar constrains the rest as above (`engine.sampling.thinking.GrammarGate`).

``json_object`` is "any JSON object": the schema ``{"type": "object"}``. JSON grammars are
compiled without free whitespace (``any_whitespace=False``): a small model given the freedom
to emit whitespace can spend its whole budget on it.

SGLang's legacy structural tag (``{"structures": [{begin, schema, end}], "triggers": [...]}``)
is converted to xgrammar's ``triggered_tags`` format; the current format passes through.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import torch

from ..scheduling.params import GRAMMAR_KINDS, ParamError
from ..scheduling.sequence import Sequence
from .thinking import MAYBE, ON, gate_state, grammar_takes

__all__ = ["GrammarBackend", "GrammarError", "mask_rows", "accept"]


class GrammarError(ParamError):
    """A constraint that does not compile (becomes a 400 naming the field)."""


def _legacy_structural_tag(obj: dict[str, Any]) -> dict[str, Any]:
    """SGLang's legacy form, checked in its own terms, as xgrammar's ``triggered_tags``."""
    structures, triggers = obj.get("structures"), obj.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    if (not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise GrammarError("structural_tag.triggers must be a non-empty list of non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise GrammarError(f"{where} needs begin and end strings (and a schema)")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise GrammarError(f"{where}.begin {s['begin']!r} does not start with any of the triggers "
                               f"{triggers!r}")
        schema = s.get("schema", {"type": "object"})
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{where}.schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"{where}.schema must be a JSON schema (an object)")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers,
                                                 "tags": tags}}


class GrammarBackend:
    """xgrammar for one vocabulary (see the module docstring). Thread-safe."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._compiling = threading.Lock()
        self._cache: dict[tuple[str, str], Any] = {}
        self.compiles = 0          # cold compiles
        self.hits = 0              # answered from the cache

    def _xgr(self) -> Any:
        """The compiler, built on first use (reading the vocabulary takes a few hundred ms)."""
        import xgrammar as xgr
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def warm(self) -> None:
        """Build the compiler now (a server does, on a thread at start-up), not on the first
        constrained request."""
        self._xgr()

    def compile(self, grammar: tuple[str, str]) -> tuple[Any, float, bool]:
        """``(compiled, seconds, cached)``; raises `GrammarError` for a spec that does not compile."""
        key = (grammar[0], grammar[1])
        found = self._cache.get(key)
        if found is not None:
            self.hits += 1
            return found, 0.0, True
        compiler = self._xgr()
        with self._compiling:       # one compile at a time: a second asker of a spec waits for it
            found = self._cache.get(key)
            if found is not None:
                self.hits += 1
                return found, 0.0, True
            t0 = time.perf_counter()
            compiled = self._compile(compiler, *key)
            took = time.perf_counter() - t0
            self._cache[key] = compiled
            self.compiles += 1
        return compiled, took, False

    @staticmethod
    def _compile(compiler: Any, kind: str, spec: str) -> Any:
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        try:
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                json.loads(spec)                     # a clear message for text that is not JSON
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "ebnf":
                return compiler.compile_grammar(spec)
            obj = json.loads(spec)
            if not isinstance(obj, dict):
                raise GrammarError("structural_tag must be a JSON object")
            if "structures" in obj:
                obj = _legacy_structural_tag(obj)
            return compiler.compile_structural_tag(json.dumps(obj))
        except GrammarError:
            raise
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{kind} is not valid JSON: {exc}") from None
        except Exception as exc:    # xgrammar raises RuntimeError / ValueError / pydantic errors
            raise GrammarError(f"invalid {kind}: {_clean(exc)}") from None

    def matcher(self, grammar: tuple[str, str]) -> Any:
        import xgrammar as xgr
        compiled, _, _ = self.compile(grammar)
        return xgr.GrammarMatcher(compiled)

    def ensure(self, seqs: list[Sequence]) -> None:
        """Give each constrained sequence its matcher (first sampled token only)."""
        for seq in seqs:
            if seq.grammar is None and seq.sampling.grammar is not None:
                seq.grammar = self.matcher(seq.sampling.grammar)


_CHECK_FAILED = re.compile(r"^Check failed: .*? is false: ")
_TAG_ERROR = re.compile(r"^Invalid structural tag error: ")


def _clean(exc: BaseException) -> str:
    """xgrammar's message in the request's terms: without its C++ source prefix
    (``[12:00:00] /project/x.cc:12: ...``), its internal assertion (``Check failed: (...) is
    false:``) and its own error-class label, first line only."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if rest and ".cc:" in rest.split(" ", 1)[0]:
            text = rest.split(": ", 1)[-1]
    text = text.splitlines()[0] if text else ""
    text = _TAG_ERROR.sub("", _CHECK_FAILED.sub("", text))
    return text[:500] if text else type(exc).__name__


def mask_rows(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set every token a constrained row's grammar forbids next to ``-inf`` (in place). A
    reasoning model's row inside its reasoning is left alone, and on its first token (the gate's
    ``maybe``) ``<think>`` stays drawable beside what the grammar allows (`engine.sampling.thinking`)."""
    states = [gate_state(s) if s.grammar is not None else None for s in seqs]
    rows = [i for i, st in enumerate(states) if st in (ON, MAYBE)]
    if not rows:
        return
    import xgrammar as xgr
    keep = [(i, seqs[i].sampling.think_ids[0]) for i in rows
            if states[i] == MAYBE and seqs[i].sampling.think_ids[0] < logits.shape[-1]]
    kept = [logits[i, t].clone() for i, t in keep]
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])   # small: vocab / 32 ints a row
    for j, i in enumerate(rows):
        seqs[i].grammar.fill_next_token_bitmask(bitmask, j)
    if len(rows) == len(seqs):
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    else:
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows] = sub
    for (i, t), value in zip(keep, kept):
        logits[i, t] = value


def accept(seq: Sequence, token: int) -> str | None:
    """Advance `seq`'s matcher by its sampled token: ``"stop"`` when the grammar has ended,
    an error message when it refused the token, None otherwise (also for an unconstrained seq,
    and for a token of a reasoning model's reasoning, which the grammar does not see)."""
    m = seq.grammar
    if m is None or not grammar_takes(seq, token):
        return None
    if not m.accept_token(int(token)):
        return f"the grammar refused token {token}"
    return "stop" if m.is_terminated() else None
