"""The lifecycles of actorserve, as data.

Requests do not all walk the generate path. After one shared entry they fork:

* generation  ``queued -> prefill -> decode -> detok -> done`` (health probes too, marked as probes);
* pooling     ``queued -> forward -> pool -> done`` (embedding, classify, score, cross-encoder rerank);
* control     ``received -> [asking | waiting_idle | working | probing ->] applied | rejected``
              (asking its actors for answers, waiting for idle when busy, a read off the loop);

and the long-lived actors have theirs:

* server      ``starting -> serving -> draining -> stopped`` (its run phase; whether generation is
              paused is the scheduler's machine alone, never a copy here);
* health      ``healthy <-> unhealthy``: the server's second, orthogonal region (the watchdog's
              verdict), so a server can be unhealthy while paused, draining or serving;
* scheduler   ``idle -> pending -> [windowing ->] stepping -> ...``, ``pausing`` while a pause waits
              for the step boundary, ``paused_{abort,retract,in_place}``;
* session     ``open -> closing -> closed`` (close deferred while a request of it runs);
* weights     ``serving -> updating -> serving`` (a weight update at a step barrier), ``updating ->
              failed -> serving`` (a bad load: the old weights keep serving), ``rename`` (a new
              version label, same weights);
* lora        a LoRA adapter: ``loading -> ready -> unloading -> unloaded`` (an unload waits for the
              requests that hold it), ``loading -> failed`` (a bad folder), ``ready -> unloaded``
              (``evict``: least recently used, unpinned, unheld, when a load needs its slot);
* response    a stored `/v1/responses` object: ``queued -> in_progress -> completed | incomplete |
              failed | cancelled``, then ``deleted`` (the client) or ``evicted`` (the store's bound).

Every live request state can end in ``aborted`` or ``failed``. Pause ``in_place`` parks a
running request in ``paused`` with its KV; the scheduler's ``Resumed`` says whether its prompt
is fully computed, and ``resume_decode`` / ``resume_prefill`` return it there. Pause
``retract`` (or KV pressure, or a better-ranked request) frees the KV: ``retract`` takes the
request straight back to ``queued`` (the scheduler puts it back in its lane in the same turn,
so no state lies between), recomputed when it is scheduled again; a pooling request caught
mid-forward the same way.

A generation request is in ``detok`` from the moment its last token is known (the scheduler saw
EOS or the length limit, or the output stage found a stop string) until its client has taken
the final text off its stream; a pooling request is in ``pool`` from the forward's end (the
pooling head runs) until its client has the result.
"""

from __future__ import annotations

import enum

from .core import Edge, Lifecycle


class GenState(enum.Enum):
    queued = "queued"
    prefill = "prefill"
    decode = "decode"
    paused = "paused"
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
    asking = "asking"
    waiting_idle = "waiting_idle"
    working = "working"
    probing = "probing"
    applied = "applied"
    rejected = "rejected"


class ServerState(enum.Enum):
    starting = "starting"
    serving = "serving"
    draining = "draining"
    stopped = "stopped"


class HealthState(enum.Enum):
    healthy = "healthy"
    unhealthy = "unhealthy"


class SchedulerState(enum.Enum):
    idle = "idle"
    pending = "pending"
    windowing = "windowing"
    stepping = "stepping"
    pausing = "pausing"
    isolating = "isolating"
    isolating_pausing = "isolating_pausing"
    paused_abort = "paused_abort"
    paused_retract = "paused_retract"
    paused_in_place = "paused_in_place"
    stopped = "stopped"


PAUSE_MODES = ("abort", "retract", "in_place")
#: the pause mode a paused state stands for: pause lives in the SCHEDULER machine only
PAUSED_MODE: dict[enum.Enum, str] = {SchedulerState[f"paused_{m}"]: m for m in PAUSE_MODES}


class SessionState(enum.Enum):
    open = "open"
    closing = "closing"
    closed = "closed"


class WeightsState(enum.Enum):
    serving = "serving"
    updating = "updating"
    failed = "failed"


class LoraState(enum.Enum):
    loading = "loading"
    ready = "ready"
    unloading = "unloading"
    unloaded = "unloaded"
    failed = "failed"


class ResponseState(enum.Enum):
    queued = "queued"
    in_progress = "in_progress"
    completed = "completed"
    incomplete = "incomplete"
    failed = "failed"
    cancelled = "cancelled"
    deleted = "deleted"
    evicted = "evicted"


G = GenState
_G_LIVE = (G.queued, G.prefill, G.decode, G.paused, G.detok)

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
        Edge("resume_decode", (G.paused,), G.decode),
        Edge("resume_prefill", (G.paused,), G.prefill),
        Edge("retract", (G.prefill, G.decode, G.paused), G.queued),   # KV freed: recomputed later
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

_C_LIVE = (C.received, C.asking, C.waiting_idle, C.working, C.probing)

CONTROL = Lifecycle(
    name="control",
    states=ControlState,
    initial=C.received,
    terminal=frozenset({C.applied, C.rejected}),
    edges=(
        # asked one actor or several (an abort: every scheduler); each answer but the last is
        # ``answered``, the last one ends the record
        Edge("ask", (C.received, C.working), C.asking),
        Edge("answered", (C.asking,), C.asking),
        # the scheduler answered busy (a flush with a timeout, a weight load): wait for its idle
        # answer, then ask again (``retry``); a drain waits for every scheduler's idle at once
        Edge("busy", (C.asking,), C.waiting_idle),
        Edge("wait_idle", (C.received,), C.waiting_idle),
        Edge("answered", (C.waiting_idle,), C.waiting_idle),
        Edge("retry", (C.waiting_idle,), C.asking),
        # work on a worker thread first (a weight update's read, a trainer group's join or close)
        Edge("work", (C.received,), C.working),
        # /health_generate: the HTTP layer runs the probe request and reports its end
        Edge("probe", (C.received,), C.probing),
        Edge("apply", _C_LIVE, C.applied),
        Edge("reject", _C_LIVE, C.rejected),
        Edge("time_out", (C.asking, C.waiting_idle), C.rejected),   # a flush's timeout_s ran out
    ),
    doc="A control request (abort_request, pause/continue_generation, flush_cache, sessions, "
        "weights, memory, LoRA adapters, drain, /health_generate): refused or applied at once, "
        "or asking its actor(s) until the answers are in, waiting for idle when busy, working "
        "off the loop first, or probing.",
)

S = ServerState

SERVER = Lifecycle(
    name="server",
    states=ServerState,
    initial=S.starting,
    terminal=frozenset({S.stopped}),
    edges=(
        Edge("ready", (S.starting,), S.serving),
        Edge("drain", (S.starting, S.serving), S.draining),
        Edge("stop", (S.starting, S.draining), S.stopped),
    ),
    doc="The whole server's run phase; its health is the orthogonal `health` lifecycle, and "
        "whether generation is paused is the scheduler's (paused_<mode>), not a copy here.",
)

H = HealthState

HEALTH = Lifecycle(
    name="health",
    states=HealthState,
    initial=H.healthy,
    terminal=frozenset(),
    edges=(
        Edge("stall", (H.healthy,), H.unhealthy),
        Edge("recover", (H.unhealthy,), H.healthy),
    ),
    doc="The server's health region, orthogonal to its run phase: the watchdog's verdict.",
)

K = SchedulerState
_K_PAUSED = (K.paused_abort, K.paused_retract, K.paused_in_place)
_K_OPEN = (K.idle, K.pending)     # no step in flight, no window open, not paused
#: a model step (or an isolation's re-run) is in flight: the KV it reads must stay put
STEP_IN_FLIGHT = frozenset({K.stepping, K.pausing, K.isolating, K.isolating_pausing})

SCHEDULER = Lifecycle(
    name="scheduler",
    states=SchedulerState,
    initial=K.idle,
    terminal=frozenset({K.stopped}),
    edges=(
        Edge("admit", (K.idle,), K.pending),
        Edge("empty", (K.pending,), K.idle),
        Edge("window", (K.pending,), K.windowing),
        Edge("window_closed", (K.windowing,), K.pending),
        Edge("step", (K.pending,), K.stepping),
        Edge("step_done", (K.stepping, K.pausing), K.pending),
        # a request that outranks the step arrived: the engine gives the step up at its next
        # layer boundary (`engine.scheduling.base.StepPreempted`); its step_done then advances no member
        Edge("preempt_step", (K.stepping,), K.stepping),
        # a failed step's members re-run in halves until the culprits are known (isolation.py);
        # a pause that arrives meanwhile waits as it does for a step
        Edge("isolate", (K.stepping,), K.isolating),
        Edge("isolate", (K.pausing,), K.isolating_pausing),
        Edge("isolated", (K.isolating,), K.stepping),
        Edge("isolated", (K.isolating_pausing,), K.pausing),
        Edge("defer_pause", (K.stepping,), K.pausing),
        Edge("defer_pause", (K.isolating,), K.isolating_pausing),
        Edge("cancel_pause", (K.pausing,), K.stepping),
        Edge("cancel_pause", (K.isolating_pausing,), K.isolating),
        Edge("drain_step", (K.pending,), K.pausing),     # pause(wait): a step of running requests only
        Edge("pause_abort", _K_OPEN, K.paused_abort),
        Edge("pause_retract", _K_OPEN, K.paused_retract),
        Edge("pause_in_place", _K_OPEN, K.paused_in_place),
        Edge("resume", _K_PAUSED, K.pending),
        Edge("stop", tuple(s for s in K if s is not K.stopped), K.stopped),
    ),
    doc="A scheduler actor: stepping spans a model step and its output stage; a failed step "
        "of several members is isolating while its members re-run in halves; a pause that "
        "arrives mid-step waits in pausing (isolating_pausing) for the step boundary (a wait "
        "pause steps the running requests there, admitting none, until none is left); pending "
        "with no request left is idle.",
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

RS = ResponseState
_RS_LIVE = (RS.queued, RS.in_progress)
_RS_ENDED = (RS.completed, RS.incomplete, RS.failed, RS.cancelled)

RESPONSE = Lifecycle(
    name="response",
    states=ResponseState,
    initial=RS.queued,
    terminal=frozenset({RS.deleted, RS.evicted}),
    edges=(
        Edge("start", (RS.queued,), RS.in_progress),           # its request was scheduled
        Edge("complete", (RS.in_progress,), RS.completed),
        Edge("run_out", (RS.in_progress,), RS.incomplete),     # max_output_tokens, the context
        Edge("fail", _RS_LIVE, RS.failed),
        Edge("cancel", _RS_LIVE, RS.cancelled),    # the client left, an abort, POST .../cancel
        Edge("delete", _RS_ENDED, RS.deleted),
        Edge("evict", _RS_ENDED, RS.evicted),
    ),
    doc="A stored response (/v1/responses with store, background or not): queued until its "
        "request is scheduled, then its generation's outcome; the store keeps it until the "
        "client deletes it or the store's bound (--responses-store) evicts it, oldest ended first.",
)

W = WeightsState

WEIGHTS = Lifecycle(
    name="weights",
    states=WeightsState,
    initial=W.serving,
    terminal=frozenset(),
    edges=(
        Edge("update", (W.serving,), W.updating),       # waits for the step barrier, then loads
        Edge("loaded", (W.updating,), W.serving),       # the new weights (and version) serve
        Edge("load_failed", (W.updating,), W.failed),   # a bad folder, other shapes: nothing changed
        Edge("keep_old", (W.failed,), W.serving),       # the old weights go on serving
        Edge("rename", (W.serving,), W.serving),        # /update_weight_version: a new label only
    ),
    doc="The served weights and their version: an update loads in place between two model "
        "steps (no step mixes versions) and flushes the prefix cache; a failed load leaves the "
        "old weights serving.",
)

L = LoraState

LORA = Lifecycle(
    name="lora",
    states=LoraState,
    initial=L.loading,
    terminal=frozenset({L.unloaded, L.failed}),
    edges=(
        Edge("loaded", (L.loading,), L.ready),          # read off the loop, placed in a slot
        Edge("load_failed", (L.loading,), L.failed),    # a bad folder, no slot free: never served
        Edge("unload", (L.ready,), L.unloading),        # new requests refused; holders finish (or abort)
        Edge("unloaded", (L.unloading,), L.unloaded),   # the last holder left: the slot is freed
        Edge("evict", (L.ready,), L.unloaded),          # LRU, unpinned and unheld, for another load
    ),
    doc="A LoRA adapter: requests naming one that is loading wait for (and share) its one load; "
        "each request holds its adapter from admission to its end, so an unload waits for its "
        "holders and refuses new requests; a pinned adapter is never evicted.",
)

LIFECYCLES: dict[str, Lifecycle] = {
    lc.name: lc for lc in (GENERATION, POOLING, CONTROL, SERVER, HEALTH, SCHEDULER, SESSION, RESPONSE,
                           WEIGHTS, LORA)
}

from .memory import MEMORY  # noqa: E402  (memory release per tag: its own module)
from .replica import REPLICA  # noqa: E402  (a fleet's replicas: their own module)

LIFECYCLES[MEMORY.name] = MEMORY
LIFECYCLES[REPLICA.name] = REPLICA


def lifecycle(name: str) -> Lifecycle:
    try:
        return LIFECYCLES[name]
    except KeyError:
        raise KeyError(f"unknown lifecycle {name!r}; known: {', '.join(LIFECYCLES)}") from None
