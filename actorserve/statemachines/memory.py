"""The memory lifecycle: one instance per memory tag (`kv_cache`, `weights`), as data.

``resident -> releasing -> released | discarded -> resuming -> resident``:

* ``release`` starts giving a tag's memory back (at a step barrier, on the step thread);
  ``released`` says it is gone and can be brought back as it was (the KV cache is simply
  reallocated empty; the weights were spilled to a private file first); ``discarded`` (vLLM's
  level-2 sleep) says the weights were dropped with nothing kept: a resume reloads them from
  the model folder.
* ``resume`` starts bringing it back; ``resumed`` says it is in place again.
* A release that fails (the spill could not be written) goes ``releasing -> failed ->
  resident`` (``keep_resident``: nothing was freed, the tag serves on); a resume that fails (the
  memory could not be allocated, the folder not read) goes ``resuming -> failed -> released``
  (``keep_released``, or ``keep_discarded`` for discarded weights: what was kept is kept, the
  resume can be tried again).

While any tag is not ``resident`` the scheduler starts no step: requests queue and run after
the resume. The models are the control actor's (`actors.memory_control`).
"""

from __future__ import annotations

import enum

from .core import Edge, Lifecycle

#: the memory tags, as SGLang's clients name them (``cuda_graph`` is accepted and means nothing here)
MEMORY_TAGS = ("kv_cache", "weights")


class MemoryState(enum.Enum):
    resident = "resident"
    releasing = "releasing"
    released = "released"
    discarded = "discarded"
    resuming = "resuming"
    failed = "failed"


M = MemoryState

MEMORY = Lifecycle(
    name="memory",
    states=MemoryState,
    initial=M.resident,
    terminal=frozenset(),
    edges=(
        Edge("release", (M.resident,), M.releasing),       # at a barrier: no request holds KV
        Edge("released", (M.releasing,), M.released),      # freed; kept to be restored (spill)
        Edge("discarded", (M.releasing,), M.discarded),    # freed, nothing kept (vLLM level 2)
        Edge("release_failed", (M.releasing,), M.failed),
        Edge("keep_resident", (M.failed,), M.resident),    # a failed release freed nothing
        Edge("resume", (M.released, M.discarded), M.resuming),
        Edge("resumed", (M.resuming,), M.resident),        # reallocated, the weights read back
        Edge("resume_failed", (M.resuming,), M.failed),
        Edge("keep_released", (M.failed,), M.released),    # a failed resume: try again
        Edge("keep_discarded", (M.failed,), M.discarded),  # (of discarded weights: reload again)
    ),
    doc="One memory tag (kv_cache, weights): released at a step barrier with no request "
        "holding KV and given back to the OS (the weights spilled to a private file, or "
        "discarded at vLLM's level 2), resumed in place; while any tag is not resident no "
        "model step runs and requests queue.",
)
