"""Every message between actors, as a frozen dataclass.

Families (the receiving actor in brackets):

* client -> runtime:  `Submit` [scheduler]
* control plane:      `AbortRequest`, `PauseGeneration`, `ContinueGeneration`, `FlushCache`
                      [control], which become `Abort`, `Pause`, `Continue`, `Flush` [scheduler]
* scheduler -> request actor: `Scheduled`, `PrefillProgress`, `TokenOut`, `PoolOut`, `Paused`,
                      `Resumed`, `Retracted`, `Aborted`, `Failed`
* request actor -> scheduler: `Release` (finished early: stop string, own failure)
* scheduler -> itself: `StepDone` (a model step came back from its worker thread)
* watchdog:           `WatchdogTick` (its timer), `ProgressQuery` -> `Progress` [scheduler],
                      `WatchdogReport`, `WatchdogAck`; it moves the server with `ServerEvent`
* sessions:           `OpenSession`, `CloseSession` [control -> sessions], `SessionBegin` (a
                      request joins), `SessionEnd` (from the request actor), `SessionReap` (timer)

A message that concerns one request carries its `rid`, so the flight recorder files it under
that request. Dispatch is by type through each actor's handler table, never by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# -- submission ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    rid: str
    seq: Any            # engine.sequence.Sequence
    actor: Any          # the request actor that receives this request's outputs


@dataclass(frozen=True, slots=True)
class Release:
    """The request actor is done with its sequence (stop string, own failure): free it."""
    rid: str
    reason: str


# -- control plane (HTTP -> control actor) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str | None = None
    prefix: bool = False
    abort_all: bool = False


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


@dataclass(frozen=True, slots=True)
class Pause:
    mode: str


@dataclass(frozen=True, slots=True)
class Continue:
    pass


@dataclass(frozen=True, slots=True)
class Flush:
    wait: bool = False      # if busy, wait for idle (the control actor bounds the wait)


@dataclass(frozen=True, slots=True)
class FlushTimeout:
    pass


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
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None     # set on the last token: stop | length


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


@dataclass(frozen=True, slots=True)
class Retracted:
    rid: str


@dataclass(frozen=True, slots=True)
class Aborted:
    rid: str
    reason: str = "abort"


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    error: str


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
    logprobs: list[Any] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    pooled: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# -- control actor internals ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlDone:
    """The scheduler's answer to a control request came back to the control actor."""
    rid: str
    result: Any
    error: BaseException | None
    reply: Any          # the caller's future


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """Move the server lifecycle: ready, drain, stop, stall, recover."""
    event: str
    reason: str = ""


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
class WatchdogAck:
    event: str               # stall | recover
    ok: bool


# -- sessions -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenSession:
    session_id: str | None = None
    capacity_of_str_len: int | None = None
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class CloseSession:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionBegin:
    """A request wants to join a session: compose its prompt and mark it running."""
    session_id: str
    rid: str                 # the new request's id
    new_ids: tuple[int, ...]
    parent: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    bos_id: int | None = None


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """A session's request ended (or was never submitted): record its output, maybe close."""
    session_id: str
    rid: str
    output_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    submitted: bool = True


@dataclass(frozen=True, slots=True)
class SessionReap:
    session_id: str


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
