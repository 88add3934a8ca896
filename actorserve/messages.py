"""Every message between actors, as a frozen dataclass.

Families (the receiving actor in brackets):

* client -> runtime:  `Submit` [scheduler]
* control plane:      `AbortRequest`, `PauseGeneration`, `ContinueGeneration`, `FlushCache`
                      [control], which become `Abort`, `Pause`, `Continue`, `Flush` [scheduler]
* scheduler -> request actor: `Scheduled`, `PrefillProgress`, `PoolOut`, `Paused`, `Resumed`,
                      `Retracted`; for a generation request `Aborted` and `Failed` go through the
                      output stage (which adds the held-back text)
* scheduler -> output stage: `StepOutputs` (one per step, asked; answered `OutputsDone`), `Forget`
* output stage -> request actor: `TokenOut` (detokenized, finish decided), `Aborted`, `Failed`
* runtime -> output stage: `Track`; runtime -> request actor: `Delivered` (client has the end)
* request actor -> scheduler: `Release` (its own failure)
* scheduler -> itself: `StepDone` (a model step came back from its worker thread)
* control -> scheduler: `WhenIdle` (answered as `SchedulerIdle`: a waiting flush, a drain)
* watchdog:           `WatchdogTick` (its timer), `ProgressQuery` -> `Progress` [scheduler],
                      `WatchdogReport`; it tells the control actor its `HealthVerdict`
* sessions:           `OpenSession`, `CloseSession` [control -> sessions], `SessionBegin` (a
                      request joins), `SessionEnd` (from the request actor), `SessionReap` (timer)

A message that concerns one request carries its `rid`, so the flight recorder files it under
that request. Dispatch is by type through each actor's handler table, never by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Two families live in their own modules, re-exported here: every actor imports messages from here.
from .messages_sessions import (  # noqa: F401
    CloseSession as CloseSession, OpenSession as OpenSession, ResponseBegin as ResponseBegin,
    ResponseCancel as ResponseCancel, ResponseDelete as ResponseDelete, ResponseEnd as ResponseEnd,
    ResponseStarted as ResponseStarted, SessionBegin as SessionBegin, SessionEnd as SessionEnd,
    SessionReap as SessionReap,
)
from .messages_weights import (  # noqa: F401
    GetWeightsByName as GetWeightsByName, LoadWeights as LoadWeights,
    UpdateWeightsFromDisk as UpdateWeightsFromDisk, UpdateWeightsFromTensor as UpdateWeightsFromTensor,
    UpdateWeightVersion as UpdateWeightVersion, WeightsApplied as WeightsApplied, WeightsRead as WeightsRead,
)
from .messages_weights import SetWeightVersion as SetWeightVersion  # noqa: F401
from .messages_lora import (  # noqa: F401
    LoadLora, LoadLoraAdapter, LoraRead, LoraWait, UnloadLora, UnloadLoraAdapter,
)
from .messages_weights_group import (  # noqa: F401
    DestroyWeightsUpdateGroup as DestroyWeightsUpdateGroup, InitWeightsUpdateGroup as InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed as UpdateWeightsFromDistributed, WeightsGroupClosed as WeightsGroupClosed,
    WeightsGroupJoined as WeightsGroupJoined,
)

# -- submission ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    rid: str
    seq: Any            # engine.sequence.Sequence
    actor: Any          # the request actor that receives this request's outputs
    lora: str | None = None   # the LoRA adapter it runs under (held from admission to its end)


@dataclass(frozen=True, slots=True)
class Release:
    """The request actor is done with its sequence (stop string, own failure): free it."""
    rid: str
    reason: str


# -- control plane (HTTP -> control actor) --------------------------------------------------------


#: the reason of an abort caused by a request's deadline (its finish_reason is "timeout")
DEADLINE_EXCEEDED = "deadline exceeded"
#: the reason of an abort caused by ``--max-queue-time`` (SGLang's words for its waiting timeout)
QUEUE_TIMEOUT = "Request waiting timeout reached."


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str | None = None
    prefix: bool = False
    abort_all: bool = False
    reason: str = "abort"     # why: abort (the route), or e.g. "client disconnected", a probe timeout
    lora: str | None = None   # every request running under this LoRA adapter (an unload's abort)


@dataclass(frozen=True, slots=True)
class PauseGeneration:
    mode: str = "abort"   # abort | retract | in_place


@dataclass(frozen=True, slots=True)
class ContinueGeneration:
    pass


@dataclass(frozen=True, slots=True)
class FlushCache:
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class ControlResult:
    """What the control plane answers: applied or rejected, with the reason and details."""
    ok: bool
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


# -- control actor -> scheduler -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str | None = None
    prefix: bool = False
    abort_all: bool = False
    reason: str = "abort"
    lora: str | None = None   # the requests holding this adapter


@dataclass(frozen=True, slots=True)
class Pause:
    mode: str


@dataclass(frozen=True, slots=True)
class Continue:
    pass


@dataclass(frozen=True, slots=True)
class Flush:
    """Clear the prefix cache if no request is in flight (else answered busy)."""


@dataclass(frozen=True, slots=True)
class FlushTimeout:
    """The timeout of waiting flush record `rid` ran out (the control actor's timer)."""
    rid: str


# -- scheduler -> request actor -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scheduled:
    rid: str
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    rid: str
    computed: int


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One generated token, detokenized by the output stage (`text` is the stable delta)."""
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None     # set on the last token: stop | length
    text: str = ""
    matched: int | str | None = None     # with stop: the stop token id or stop string that ended it
    ids_logprobs: list[tuple[int, float]] | None = None   # SamplingParams.token_ids_logprob
    prompt_logprobs: Any = None          # engine.base.PromptLogprobs, with the first token
    spec: tuple[int, int] | None = None  # first token of a speculative step: (verified, accepted)
    weight_version: str | None = None    # the weights that made it (its step's version)


@dataclass(frozen=True, slots=True)
class PoolOut:
    rid: str
    pooled: Any


@dataclass(frozen=True, slots=True)
class Paused:
    rid: str


@dataclass(frozen=True, slots=True)
class Resumed:
    rid: str
    prefill_complete: bool = True     # the sequence's prompt is in the KV: back to decode


@dataclass(frozen=True, slots=True)
class Retracted:
    rid: str
    cause: str = "pause"      # kv_pressure | priority:<the rid it made room for> | pause


@dataclass(frozen=True, slots=True)
class QueueTimeout:
    """Request `rid`'s queue deadline (``--max-queue-time``) passed: the scheduler ends it if it
    is still waiting for its first admission."""
    rid: str


@dataclass(frozen=True, slots=True)
class Aborted:
    rid: str
    reason: str = "abort"
    text: str = ""           # what the output stage still held back (the partial text's tail)


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    error: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class Delivered:
    """The client took the request's final output off its stream: the request is done."""
    rid: str


# -- scheduler <-> output stage -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Track:
    """A generation request starts: the output stage keeps its detokenizer and its actor."""
    rid: str
    actor: Any               # the request actor (inside the runtime; never crosses to HTTP)
    detokenizer: Any = None


@dataclass(frozen=True, slots=True)
class Forget:
    """The scheduler let go of a request that ended on its own: drop its output state."""
    rid: str


@dataclass(frozen=True, slots=True)
class TokenItem:
    """One member's token of a step, with the scheduler's verdict (EOS, length) if any."""
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    ids_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: Any = None          # engine.base.PromptLogprobs, with the first token
    # The first token of a speculative step: (drafts verified, drafts accepted) in that step
    spec: tuple[int, int] | None = None
    weight_version: str | None = None    # the version of the weights the step that made it ran with
    probe: bool = False                  # a health probe's: not counted as generated traffic


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One batched message per step (asked): the stage answers with the rids it finished
    (stop strings), before the scheduler plans the next step."""
    step: int
    items: tuple[TokenItem, ...]


@dataclass(frozen=True, slots=True)
class OutputsDone:
    """The output stage's answer to `StepOutputs`, back at the scheduler."""
    step: int
    stopped: tuple[str, ...]
    failed: tuple[str, ...] = ()      # its output failed in the stage (the stage told the actor)
    error: BaseException | None = None
    output: int = 0                   # tokens of business traffic the stage output (probes' are not counted)


# -- scheduler -> itself --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchWindowClosed:
    """The scheduler's batching window ran out: start the step with what has arrived."""


@dataclass(frozen=True, slots=True)
class StepDone:
    step: int
    batch: list[tuple[Any, int]]
    outputs: list[Any] | None
    error: BaseException | None = None


# -- request actor -> client ----------------------------------------------------------------------


@dataclass(slots=True)
class RequestOutput:
    """One item of a request's output stream (a delta), the last one with `finished`."""
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token (token_id, logprob, top [(id, lp)] | None, requested ids [(id, lp)] | None)
    logprobs: list[Any] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    pooled: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # finish_reason stop: the stop token id (EOS, stop_token_ids, a grammar's end) or the stop
    # string that ended it (SGLang's matched_stop); None otherwise
    matched_stop: int | str | None = None
    aborted_in: str | None = None        # finish_reason abort / timeout: the state it was caught in
    # On the finished output of a request that got its result (not aborted or failed): seconds
    # it spent in each lifecycle state until then ("queued", "prefill", "decode", "paused";
    # pooling: "queued", "forward"), from its state machine's transitions on the runtime clock.
    timings: dict[str, float] | None = None
    prompt_logprobs: Any = None          # engine.base.PromptLogprobs, on the first token's output
    # On the finished output of a request that speculated: (verify steps, drafts verified,
    # drafts accepted); None if it never did.
    spec: tuple[int, int, int] | None = None
    # The output tokens so far per weight version, in order: ((version, start, end), ...), end
    # exclusive, over the request's generated tokens (a request that spans a weight update has
    # several); on every item (cumulative) and on the finished one.
    weight_versions: tuple[tuple[str, int, int], ...] = ()


FINAL_FIELDS = ("finished", "finish_reason", "error", "pooled", "prompt_tokens", "completion_tokens",
                "cached_tokens", "matched_stop", "aborted_in", "spec", "weight_versions", "timings")


def merge_outputs(items: list[RequestOutput]) -> RequestOutput:
    """A request's output items (deltas, in order) as one output: the texts, token ids and
    logprobs joined, the prompt logprobs where they came, the rest (`FINAL_FIELDS`) the last
    item's. One item is returned as it is."""
    if not items:
        raise ValueError("no output items to merge")
    if len(items) == 1:
        return items[0]
    first, last = items[0], items[-1]
    merged = RequestOutput(first.rid, text="".join(it.text for it in items),
                           token_ids=[t for it in items for t in it.token_ids])
    lps = [lp for it in items if it.logprobs for lp in it.logprobs]
    merged.logprobs = lps if lps or first.logprobs is not None else None
    merged.prompt_logprobs = next((it.prompt_logprobs for it in reversed(items)
                                   if it.prompt_logprobs is not None), None)
    for f in FINAL_FIELDS:
        setattr(merged, f, getattr(last, f))
    return merged


# -- control actor internals ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlDone:
    """A scheduler's (or the session actor's) answer to control record `rid` came back."""
    rid: str
    result: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """Move the server lifecycle: ready, drain, stop."""
    event: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """Start draining; answered once every scheduler has no request left."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WhenIdle:
    """Asked of a scheduler: answered (True) the moment it has no request and no step."""


@dataclass(frozen=True, slots=True)
class SchedulerIdle:
    """A scheduler's `WhenIdle` answer, back at the control actor for record `rid`."""
    rid: str
    sched: str
    error: BaseException | None = None


# -- watchdog -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProgressQuery:
    """Asked of the scheduler: how far has it got? (answered with `Progress`)."""


@dataclass(frozen=True, slots=True)
class Progress:
    steps_done: int         # model steps completed since start
    pending: bool           # work that should make progress: a step in flight, or unpaused requests
    live: int               # live requests (probes included)


@dataclass(frozen=True, slots=True)
class WatchdogTick:
    pass


@dataclass(frozen=True, slots=True)
class WatchdogReport:
    progress: Any            # Progress, or None when the scheduler did not answer
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class HealthVerdict:
    """The watchdog's verdict after each report: the control actor moves the health region
    (`stall` / `recover`) only when the verdict differs from it."""
    ok: bool
    reason: str = ""


# -- health_generate ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """A /health_generate starts: the control actor opens its record (``waiting`` for the probe)
    or rejects it at once (starting, draining, unhealthy); paused answers ``paused``."""


@dataclass(frozen=True, slots=True)
class HealthDone:
    """The probe of health check `record` ended: apply (healthy) or reject it with the reason."""
    record: str
    ok: bool
    reason: str = ""
