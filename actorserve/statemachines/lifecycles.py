"""The five lifecycles of actorserve, as data.

Requests do not all walk the generate path. After one shared entry they fork:

* generation  ``queued -> prefill -> decode -> detok -> done`` (health probes too, marked as probes);
* pooling     ``queued -> forward -> pool -> done`` (embedding, classify, score, cross-encoder rerank);
* control     ``received -> applied | rejected`` (flush with a timeout may wait for idle first);
* server      ``starting -> serving <-> paused -> draining -> stopped`` (+ ``unhealthy``);
* session     ``open -> closing -> closed`` (close deferred while a request of it runs).

Every live request state can end in ``aborted`` or ``failed``. Pause ``in_place`` parks a
running request in ``paused`` with its KV; ``resume`` returns it to ``prefill`` or ``decode``
depending on whether its prompt is fully computed (the model's ``prefill_complete``). Pause
``retract`` (or KV pressure) frees the KV: ``retracted -> queued``, recomputed later. A
pooling request caught mid-forward by a retract goes straight back to ``queued``.
"""

from __future__ import annotations

import enum

from .core import Edge, Lifecycle


class GenState(enum.Enum):
    queued = "queued"
    prefill = "prefill"
    decode = "decode"
    paused = "paused"
    retracted = "retracted"
    detok = "detok"
    done = "done"
    aborted = "aborted"
    failed = "failed"


class PoolState(enum.Enum):
    queued = "queued"
    forward = "forward"
    pool = "pool"
    done = "done"
    aborted = "aborted"
    failed = "failed"


class ControlState(enum.Enum):
    received = "received"
    waiting = "waiting"
    applied = "applied"
    rejected = "rejected"


class ServerState(enum.Enum):
    starting = "starting"
    serving = "serving"
    paused = "paused"
    unhealthy = "unhealthy"
    draining = "draining"
    stopped = "stopped"


class SessionState(enum.Enum):
    open = "open"
    closing = "closing"
    closed = "closed"


G = GenState
_G_LIVE = (G.queued, G.prefill, G.decode, G.paused, G.retracted, G.detok)

GENERATION = Lifecycle(
    name="generation",
    states=GenState,
    initial=G.queued,
    terminal=frozenset({G.done, G.aborted, G.failed}),
    edges=(
        Edge("schedule", (G.queued,), G.prefill),
        Edge("prefill_chunk", (G.prefill,), G.prefill),
        Edge("first_token", (G.prefill,), G.decode),
        Edge("finish", (G.decode,), G.detok),
        Edge("deliver", (G.detok,), G.done),
        Edge("pause", (G.prefill, G.decode), G.paused),
        Edge("resume", (G.paused,), G.decode, condition="prefill_complete"),
        Edge("resume", (G.paused,), G.prefill),
        Edge("retract", (G.prefill, G.decode, G.paused), G.retracted),
        Edge("requeue", (G.retracted,), G.queued),
        Edge("abort", _G_LIVE, G.aborted),
        Edge("fail", _G_LIVE, G.failed),
    ),
    doc="Generation requests (chat, completions, /generate) and health_generate probes.",
)

P = PoolState
_P_LIVE = (P.queued, P.forward, P.pool)

POOLING = Lifecycle(
    name="pooling",
    states=PoolState,
    initial=P.queued,
    terminal=frozenset({P.done, P.aborted, P.failed}),
    edges=(
        Edge("schedule", (P.queued,), P.forward),
        Edge("forward_chunk", (P.forward,), P.forward),
        Edge("forward_done", (P.forward,), P.pool),
        Edge("retract", (P.forward,), P.queued),
        Edge("deliver", (P.pool,), P.done),
        Edge("abort", _P_LIVE, P.aborted),
        Edge("fail", _P_LIVE, P.failed),
    ),
    doc="Embedding, classify, score and cross-encoder rerank requests.",
)

C = ControlState

CONTROL = Lifecycle(
    name="control",
    states=ControlState,
    initial=C.received,
    terminal=frozenset({C.applied, C.rejected}),
    edges=(
        Edge("apply", (C.received, C.waiting), C.applied),
        Edge("reject", (C.received, C.waiting), C.rejected),
        Edge("wait", (C.received,), C.waiting),
    ),
    doc="abort_request, pause/continue_generation, flush_cache, open/close_session: applied at once.",
)

S = ServerState

SERVER = Lifecycle(
    name="server",
    states=ServerState,
    initial=S.starting,
    terminal=frozenset({S.stopped}),
    edges=(
        Edge("ready", (S.starting,), S.serving),
        Edge("pause", (S.serving,), S.paused),
        Edge("resume", (S.paused,), S.serving),
        Edge("stall", (S.serving, S.paused), S.unhealthy),
        Edge("recover", (S.unhealthy,), S.serving),
        Edge("drain", (S.starting, S.serving, S.paused, S.unhealthy), S.draining),
        Edge("stop", (S.starting, S.draining), S.stopped),
    ),
    doc="The whole server: paused carries its mode (abort, retract, in_place).",
)

SS = SessionState

SESSION = Lifecycle(
    name="session",
    states=SessionState,
    initial=SS.open,
    terminal=frozenset({SS.closed}),
    edges=(
        Edge("close", (SS.open, SS.closing), SS.closed),
        Edge("defer_close", (SS.open,), SS.closing),
        Edge("expire", (SS.open,), SS.closed),
    ),
    doc="Sessions: close is deferred while one of the session's requests runs; idle ones expire.",
)

LIFECYCLES: dict[str, Lifecycle] = {
    lc.name: lc for lc in (GENERATION, POOLING, CONTROL, SERVER, SESSION)
}


def lifecycle(name: str) -> Lifecycle:
    try:
        return LIFECYCLES[name]
    except KeyError:
        raise KeyError(f"unknown lifecycle {name!r}; known: {', '.join(LIFECYCLES)}") from None
