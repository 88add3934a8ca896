"""What a step's answer means for each member: the scheduler's finish decisions, in one place.

`decide(seq, out, limits, items)` reads the engine's answer for one member of a step (and a
speculating member's further accepted tokens) and says what happens to it; the scheduler applies
that (`SchedulerActor._apply`) and decides nothing itself:

* a token goes to the output stage: its `TokenOut`, with its finish when this token ends the
  request (the engine's, ``SeqOutput.stop``: its grammar ended; a stop token, EOS unless
  ``ignore_eos``, ``stop_token_ids``; a length limit, ``max_new_tokens`` or the context's
  capacity), is appended to the step's `items` (the one object a token makes here: the stage
  fills in its text and hands the same message on to the request actor);
* what else happens is the answer, a `(V, value)` pair (None: the member goes on):
  ``progress`` (a prefill chunk, no token yet: the request actor hears how far it is),
  ``pooled`` (a pooling forward is over: its values go to the request actor, its KV is freed),
  ``fail`` (the engine's verdict on this member alone, `SeqOutput.error`), ``finished`` (its
  last token was routed: its KV is freed at once).

A finish ends the member's tokens: a speculating member's tokens after it are never routed.
Generated tokens are counted by what the output stage output (its answer), so a speculative
step's tokens past a stop string are never counted either: no fix-up. The one finish decided
elsewhere is a stop string, because it needs the text and only the output stage has it; the
stage answers the rids it finished and the scheduler frees them before it plans the next step
(`_end_step`). What a step's members share (the context's capacity, the EOS ids, the weights'
version) is read once per step into `Limits`, not once per token.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from ..engine.scheduling.base import StepPreempted
from ..engine.scheduling.batching import step_stage
from ..messages import TokenOut


class V(enum.Enum):
    progress = "progress"
    pooled = "pooled"
    fail = "fail"
    finished = "finished"


PROGRESS = (V.progress, None)
FINISHED = (V.finished, None)


class Limits(NamedTuple):
    """What every member of one step is judged by (read once per step)."""
    capacity: int                   # tokens one sequence may hold (`EngineInfo.capacity`)
    eos_token_ids: tuple[int, ...]
    version: str                    # the weights the step ran with


def limits_of(info: Any, version: str) -> Limits:
    return Limits(info.capacity, info.eos_token_ids, version)


def finish_reason(seq: Any, tok: int, limits: Limits, grammar_done: bool = False) -> str | None:
    """Whether `tok` (already appended to `seq.output_ids`) ends the request, and why."""
    sp = seq.sampling
    if grammar_done or tok in sp.stop_token_ids or (not sp.ignore_eos and tok in limits.eos_token_ids):
        return "stop"
    if len(seq.output_ids) >= sp.max_new_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= limits.capacity:
        return "length"
    return None


def decide(seq: Any, out: Any, limits: Limits, items: list[TokenOut]) -> tuple[V, Any] | None:
    """What happens to one member (see the module doc). Appends each routed token to
    `seq.output_ids` (a length limit counts it) and its `TokenOut` to `items`."""
    if seq.pooling is not None:
        return PROGRESS if out.pooled is None else (V.pooled, out.pooled)
    spec = (len(seq.draft), len(out.extra)) if seq.draft else None
    o = out
    extra = iter(out.extra) if out.extra else None
    while True:
        if o.token_id is None:
            return PROGRESS
        if o.error is not None:
            return (V.fail, o.error)
        tok = o.token_id
        seq.output_ids.append(tok)
        reason = finish_reason(seq, tok, limits, o.stop)
        items.append(TokenOut(seq.rid, tok, o.logprob, o.top_logprobs, reason, o.ids_logprobs,
                              o.prompt_logprobs, spec, limits.version, probe=seq.is_probe))
        if reason is not None:
            return FINISHED
        o = next(extra, None) if extra is not None else None
        if o is None:
            return None
        spec = None


def step_note(sched: str, step: int, batch: list[tuple[Any, int]]) -> dict[str, Any]:
    """The recording's ``step`` note: the batch as ``[[rid, tokens], ...]`` (pairs: tuples in
    memory, lists in the file), its stage
    (``prefill`` | ``decode``: what the profiler splits by), and what each speculating member's
    step verifies."""
    data: dict[str, Any] = {"sched": sched, "step": step, "batch": [(s.rid, n) for s, n in batch],
                            "stage": step_stage((n, len(s.output_ids), s.pooling is not None) for s, n in batch)}
    drafts = {s.rid: list(s.draft) for s, _ in batch if s.draft}
    if drafts:
        data["draft"] = drafts
    return data


def step_end_note(sched: str, step: int, res: Any, err: BaseException | None) -> dict[str, Any]:
    """The recording's ``step_end`` input: what the model answered, which re-execution plays back."""
    if isinstance(err, StepPreempted):       # given up at a layer boundary: nothing answered
        return {"sched": sched, "step": step, "out": None, "error": None, "preempted": True}
    return {"sched": sched, "step": step, "out": None if err is not None else [answer(o) for o in res or ()],
            "error": None if err is None else f"{type(err).__name__}: {err}"}


def answer(o: Any) -> Any:
    """What the recording keeps of one member's answer: ``[rid, token | "pooled"]`` (a tuple in
    memory, a list in the file: a pair of atoms the collector stops tracking), and the
    engine's own verdict when it gave one (``"stop"``: its grammar ended; ``{"error": ...}``).
    A speculating member's is ``[rid, [token, ...]]``: every token its step yielded."""
    if o.seq.draft and o.token_id is not None:
        return [o.seq.rid, [o.token_id] + [m.token_id for m in o.extra]]
    entry = (o.seq.rid, "pooled" if o.pooled is not None else o.token_id)
    if o.error is not None:
        return [*entry, {"error": o.error}]
    if o.stop:
        return [*entry, "stop"]
    return entry
