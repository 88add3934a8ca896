"""Every message between actors, as a dataclass (frozen, but for the per-token and per-request ones: see `hot`).

Families (the receiving actor in brackets):

* client -> runtime:  `Submit` [scheduler] (with the request actor's ref: where outputs go)
* control plane:      `AbortRequest`, `PauseGeneration`, `ContinueGeneration`, `FlushCache`
                      [control]; the control actor hands the same `AbortRequest` on to each
                      scheduler, and the others become `Pause`, `Continue`, `Flush` [scheduler]
* scheduler -> request actor: `Scheduled`, `PrefillProgress`, `PoolOut`, `Paused`, `Resumed`,
                      `Retracted`; for a generation request `Aborted` and `Failed` go through the
                      output stage (which adds the held-back text)
* scheduler -> output stage: `StepOutputs` (one per step, asked; answered `OutputsDone`) of
                      `TokenOut`s without text, `Forget`
* output stage -> request actor: `TokenOut` (the same message, now with its text and the
                      finish decided), `Aborted`, `Failed`
* runtime -> output stage: `Track` (with the request actor's ref); runtime -> request actor:
                      `Delivered` (client has the end)
* request actor -> scheduler: `Release` (its own failure)
* scheduler -> itself: `StepDone` (a model step came back from its worker thread)
* control -> scheduler: `WhenIdle` (answered as `SchedulerIdle`: a waiting flush, a drain)
* watchdog:           `WatchdogTick` (its timer), `ProgressQuery` -> `Progress` [scheduler],
                      `WatchdogReport`; it tells the control actor its `HealthVerdict`
* sessions:           `OpenSession`, `CloseSession` [control -> sessions], `SessionBegin` (a
                      request joins), `SessionEnd` (from the request actor), `SessionReap` (timer)

A message that concerns one request carries its `rid`, so the flight recorder files it under
that request. A message names an actor by its `ActorRef` (`actors.actor`), never by the actor
object: what crosses between actors is plain data, rids and refs. Dispatch is by type through each actor's handler table, never by name.
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
from .messages_output import (  # noqa: F401
    FINAL_FIELDS as FINAL_FIELDS, RequestOutput as RequestOutput, delta_output as delta_output,
    merge_outputs as merge_outputs,
)
from .messages_weights_group import (  # noqa: F401
    DestroyWeightsUpdateGroup as DestroyWeightsUpdateGroup, InitWeightsUpdateGroup as InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed as UpdateWeightsFromDistributed, WeightsGroupClosed as WeightsGroupClosed,
    WeightsGroupJoined as WeightsGroupJoined,
)

#: The messages sent once per request or once per token (submission, the scheduler's and the
#: output stage's to a request actor, a step's): slotted dataclasses that are not frozen, because
#: building a frozen one costs about ten times as much (each field is set through
#: ``object.__setattr__``) and a token pays for two. Like every message, none is ever written
#: after it is sent. The others (control, sessions, weights) stay frozen.
hot = dataclass(slots=True)

# -- submission ----------------------------------------------------------------------------------


@hot
class Submit:
    rid: str
    seq: Any            # engine.sequence.Sequence
    ref: Any            # the ActorRef of the request actor that receives this request's outputs
    lora: str | None = None   # the LoRA adapter it runs under (held from admission to its end)


@hot
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
    """Abort the requests it names: from a client (the route, a disconnect, a deadline) to the
    control actor, which hands the same message on to every scheduler."""
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


@hot
class Scheduled:
    rid: str
    cached_tokens: int = 0


@hot
class PrefillProgress:
    rid: str
    computed: int


@hot
class TokenOut:
    """One generated token. From the scheduler to the output stage (in `StepOutputs`) it carries
    the scheduler's verdict (EOS, length) and no text; the stage sends the request actor the
    same message with the stable text delta, and the finish decided (a stop string too)."""
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None     # set on the last token: stop | length
    ids_logprobs: list[tuple[int, float]] | None = None   # SamplingParams.token_ids_logprob
    prompt_logprobs: Any = None          # engine.base.PromptLogprobs, with the first token
    spec: tuple[int, int] | None = None  # first token of a speculative step: (verified, accepted)
    weight_version: str | None = None    # the weights that made it (its step's version)
    text: str = ""                       # the stable text delta (set by the output stage)
    matched: int | str | None = None     # with stop: the stop token id or stop string that ended it
    probe: bool = False                  # a health probe's: not counted as generated traffic


@hot
class PoolOut:
    rid: str
    pooled: Any


@hot
class Paused:
    rid: str


@hot
class Resumed:
    rid: str
    prefill_complete: bool = True     # the sequence's prompt is in the KV: back to decode


@hot
class Retracted:
    rid: str
    cause: str = "pause"      # kv_pressure | priority:<the rid it made room for> | pause


@hot
class QueueTimeout:
    """Request `rid`'s queue deadline (``--max-queue-time``) passed: the scheduler ends it if it
    is still waiting for its first admission."""
    rid: str


@hot
class Aborted:
    rid: str
    reason: str = "abort"
    text: str = ""           # what the output stage still held back (the partial text's tail)


@hot
class Failed:
    rid: str
    error: str
    text: str = ""


@hot
class Delivered:
    """The client took the request's final output off its stream: the request is done."""
    rid: str


# -- scheduler <-> output stage -------------------------------------------------------------------


@hot
class Track:
    """A generation request starts: the output stage keeps its detokenizer and its actor's ref."""
    rid: str
    ref: Any                 # the request actor's ActorRef
    detokenizer: Any = None


@hot
class Forget:
    """The scheduler let go of a request that ended on its own: drop its output state."""
    rid: str


@hot
class StepOutputs:
    """One batched message per step (asked): the stage answers with the rids it finished
    (stop strings), before the scheduler plans the next step."""
    step: int
    items: tuple[TokenOut, ...]


@hot
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


@hot
class StepDone:
    step: int
    batch: list[tuple[Any, int]]
    outputs: list[Any] | None
    error: BaseException | None = None


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
