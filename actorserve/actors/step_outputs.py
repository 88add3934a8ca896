"""What a step's answer means for each member: the scheduler's finish decisions, in one place.

`decide(seq, out, info, version)` reads the engine's answer for one member of a step (and a
speculating member's further accepted tokens) and says, as `Verdict`s, what happens to it;
the scheduler applies them in order (`SchedulerActor._apply`) and decides nothing itself:

* ``progress``: a prefill chunk (no token yet): the request actor hears how far it is;
* ``pooled``: a pooling forward is over: its values go to the request actor, its KV is freed;
* ``fail``: the engine's verdict on this member alone (`SeqOutput.error`);
* ``token``: a token for the output stage, with its finish when this token ends the request:
  the engine's (``SeqOutput.stop``: its grammar ended), a stop token (EOS unless
  ``ignore_eos``, ``stop_token_ids``), or a length limit (``max_new_tokens``, the context's
  capacity). A finished request's KV is freed at once.

A verdict that ends the member ends the list: a speculating member's tokens after its finish
are never routed. Generated tokens are counted by what the output stage output (its answer),
so a speculative step's tokens past a stop string are never counted either: no fix-up. The one finish decided elsewhere is a stop
string, because it needs the text and only the output stage has it; the stage answers the
rids it finished and the scheduler frees them before it plans the next step (`_end_step`).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from ..engine.base import StepPreempted
from ..messages import TokenOut


class V(enum.Enum):
    progress = "progress"
    pooled = "pooled"
    fail = "fail"
    token = "token"


class Verdict(NamedTuple):
    kind: V
    value: Any = None        # pooled: the values; fail: the error; token: the `TokenOut`


def finish_reason(seq: Any, tok: int, info: Any, grammar_done: bool = False) -> str | None:
    """Whether `tok` (already appended to `seq.output_ids`) ends the request, and why."""
    sp = seq.sampling
    if grammar_done or tok in sp.stop_token_ids or (not sp.ignore_eos and tok in info.eos_token_ids):
        return "stop"
    if len(seq.output_ids) >= sp.max_new_tokens or seq.num_tokens >= info.capacity:
        return "length"
    return None


def decide(seq: Any, out: Any, info: Any, version: str) -> list[Verdict]:
    """The verdicts on one member's answer (see the module doc). Appends each routed token to
    `seq.output_ids` (a length limit counts it)."""
    spec = (len(seq.draft), len(out.extra)) if seq.draft else None
    verdicts: list[Verdict] = []
    for o in (out, *out.extra):
        v = _one(seq, o, info, version, spec if o is out else None)
        verdicts.append(v)
        if v.kind is not V.token or v.value.finish_reason is not None:
            break
    return verdicts


def _one(seq: Any, o: Any, info: Any, version: str, spec: tuple[int, int] | None) -> Verdict:
    if seq.pooling is not None:
        return Verdict(V.progress) if o.pooled is None else Verdict(V.pooled, o.pooled)
    if o.token_id is None:
        return Verdict(V.progress)
    if o.error is not None:
        return Verdict(V.fail, o.error)
    tok = o.token_id
    seq.output_ids.append(tok)
    reason = finish_reason(seq, tok, info, o.stop)
    return Verdict(V.token, TokenOut(seq.rid, tok, o.logprob, o.top_logprobs, reason, o.ids_logprobs,
                                     o.prompt_logprobs, spec, version, probe=seq.is_probe))


def step_note(sched: str, step: int, batch: list[tuple[Any, int]]) -> dict[str, Any]:
    """The recording's ``step`` note: the batch as ``[[rid, tokens], ...]``, and what each
    speculating member's step verifies."""
    data: dict[str, Any] = {"sched": sched, "step": step, "batch": [[s.rid, n] for s, n in batch]}
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


def answer(o: Any) -> list[Any]:
    """What the recording keeps of one member's answer: ``[rid, token | "pooled"]``, and the
    engine's own verdict when it gave one (``"stop"``: its grammar ended; ``{"error": ...}``).
    A speculating member's is ``[rid, [token, ...]]``: every token its step yielded."""
    if o.seq.draft and o.token_id is not None:
        return [o.seq.rid, [o.token_id] + [m.token_id for m in o.extra]]
    entry = [o.seq.rid, "pooled" if o.pooled is not None else o.token_id]
    if o.error is not None:
        entry.append({"error": o.error})
    elif o.stop:
        entry.append("stop")
    return entry
