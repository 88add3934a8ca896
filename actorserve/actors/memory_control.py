"""Memory release and resume, the control actor's part (`MemoryControl`, a base of `ControlActor`):
`/release_memory_occupation`, `/resume_memory_occupation`, vLLM's `/sleep` and `/wake_up`.

Each memory tag (``kv_cache``, ``weights``) is a `MemoryModel` walking the MEMORY lifecycle
(`statemachines.memory`): ``resident -> releasing -> released | discarded -> resuming ->
resident``, with ``failed`` on the way back when a release or a resume could not be done. A
release is a control record like a flush: the control actor fires ``release`` on each resident
tag asked for and asks the scheduler `FreeMemory`, which refuses while any request holds KV (the
tags go ``releasing -> failed -> resident``: pause first) and otherwise frees them between two
steps on the step thread (`actors.scheduler_memory`, `engine.weights.memory_release`). A resume is the
same with `RestoreMemory`. Asking for a tag already released (or already resident) changes
nothing and answers success, saying so; a tag being released or resumed is a refusal.

The weights and their memory meet here: a weight update (or `/get_weights_by_name`) is refused
while the ``weights`` tag is not resident, and the ``weights`` tag is not released while an update
is under way; an update while only ``kv_cache`` is released is allowed (slime's colocated
sequence: resume weights, update them, resume the KV cache, continue).
"""

from __future__ import annotations

from typing import Any

from ..messages import ControlResult
from ..messages_memory import FreeMemory, ReleaseMemory, RestoreMemory, ResumeMemory
from ..statemachines import MEMORY, MEMORY_TAGS, MemoryState, ServerState, WeightsState
from .actor import Actor, handles

M = MemoryState
MEMORY_OPS = ("release_memory_occupation", "resume_memory_occupation")
IGNORED_TAGS = ("cuda_graph",)       # SGLang's: there are no CUDA graphs to release


class MemoryModel:
    __slots__ = ("rid", "tag", "state", "freed", "last_error", "was")

    def __init__(self, tag: str) -> None:
        self.rid = f"memory:{tag}"
        self.tag = tag
        self.state = MEMORY.initial
        self.freed = 0              # bytes the last release gave back
        self.last_error = ""
        self.was = M.resident       # a resume's source (released or discarded): where a failure returns


def memory_models() -> dict[str, MemoryModel]:
    return {tag: MemoryModel(tag) for tag in MEMORY_TAGS}


def resolve_tags(tags: Any) -> tuple[list[str], str | None]:
    """SGLang's rule: no tags (None or empty) is all of them; answers them in canonical order,
    or why they are not memory tags."""
    if not tags:
        return list(MEMORY_TAGS), None
    unknown = [t for t in tags if t not in MEMORY_TAGS + IGNORED_TAGS]
    if unknown:
        return [], (f"unknown memory tag(s) {unknown}; use {', '.join(MEMORY_TAGS)} "
                    f"({', '.join(IGNORED_TAGS)} is accepted and means nothing here)")
    return [t for t in MEMORY_TAGS if t in tags], None


class MemoryControl(Actor):
    # owned by ControlActor
    memory: dict[str, MemoryModel]
    weights: Any
    server: Any
    scheduler: Any          # the generation scheduler's ActorRef
    open: dict[str, Any]
    # and its `_new`, `_end`, `_ask`, `_rec`

    def _memory_fire(self, tag: str, event: str) -> None:
        MEMORY.fire(self.memory[tag], event, observer=self._rec)

    def _memory_start(self) -> None:
        if self._rec is not None:
            for m in self.memory.values():
                self._rec.created(MEMORY, m, {"tag": m.tag})

    def memory_snapshot(self) -> dict[str, str]:
        return {tag: m.state.name for tag, m in self.memory.items()}

    @property
    def memory_out(self) -> bool:
        """Some tag is not resident (no step runs: vLLM's ``is_sleeping``)."""
        return any(m.state is not M.resident for m in self.memory.values())

    def _memory_refusal(self) -> str | None:
        """Why the weights cannot be updated or read now, or None."""
        state = self.memory["weights"].state
        if state is M.resident:
            return None
        if state in (M.released, M.discarded):
            return (f"the weights' memory is {state.name}: resume_memory_occupation with tags "
                    "[\"weights\"] first")
        return f"the weights' memory is being {'released' if state is M.releasing else 'resumed'}"

    def _memory_check(self, rec: Any, tags: Any) -> list[str] | Any:
        """The tags, or the rejected record's answer."""
        todo, err = resolve_tags(tags)
        if err is not None:
            return self._end(rec, ControlResult(False, err))
        if self.server.state in (ServerState.draining, ServerState.stopped):
            return self._end(rec, ControlResult(False, f"cannot {rec.op.split('_')[0]} memory while the "
                                                       f"server is {self.server.state.name}"))
        moving = [t for t in todo if self.memory[t].state in (M.releasing, M.resuming, M.failed)]
        if moving:
            return self._end(rec, ControlResult(False, f"memory of {moving} is being released or resumed; "
                                                       "ask again when that is done"))
        return todo

    @handles(ReleaseMemory)
    def _release_memory(self, msg: ReleaseMemory) -> Any:
        rec = self._new(MEMORY_OPS[0])
        tags = self._memory_check(rec, msg.tags)
        if not isinstance(tags, list):
            return tags
        if msg.level not in (1, 2):
            return self._end(rec, ControlResult(False, f"level must be 1 or 2, got {msg.level}"))
        if "weights" in tags and self.weights.state is not WeightsState.serving:
            return self._end(rec, ControlResult(False, "a weight update is under way: release the weights "
                                                       "after it ends"))
        todo = [t for t in tags if self.memory[t].state is M.resident]
        if not todo:
            return self._end(rec, ControlResult(True, f"already released: {', '.join(tags)}",
                                                {"tags": {}, "memory": self.memory_snapshot()}))
        for tag in todo:
            self._memory_fire(tag, "release")
        rec.msg, rec.data = msg, todo
        self._ask(rec, self.scheduler, FreeMemory(tuple(todo), msg.level))
        return rec.reply

    @handles(ResumeMemory)
    def _resume_memory(self, msg: ResumeMemory) -> Any:
        rec = self._new(MEMORY_OPS[1])
        tags = self._memory_check(rec, msg.tags)
        if not isinstance(tags, list):
            return tags
        todo = [t for t in tags if self.memory[t].state in (M.released, M.discarded)]
        if not todo:
            return self._end(rec, ControlResult(True, f"already resident: {', '.join(tags)}",
                                                {"tags": {}, "memory": self.memory_snapshot()}))
        for tag in todo:
            self.memory[tag].was = self.memory[tag].state
            self._memory_fire(tag, "resume")
        rec.msg, rec.data = msg, todo
        self._ask(rec, self.scheduler, RestoreMemory(tuple(todo), msg.model_path))
        return rec.reply

    def _memory_done(self, rec: Any, res: ControlResult | None, error: BaseException | None) -> None:
        """The scheduler's answer to `FreeMemory` / `RestoreMemory`: each tag's outcome."""
        if error is not None or res is None:
            res = ControlResult(False, f"{rec.op} failed: {type(error).__name__}: {error}")
        per = res.detail.get("tags", {})
        release = rec.op == MEMORY_OPS[0]
        for tag in rec.data:
            m = self.memory[tag]
            r = per.get(tag) or {"ok": False, "error": res.message}
            if r["ok"] and release:
                self._memory_fire(tag, "discarded" if tag == "weights" and rec.msg.level >= 2 else "released")
                m.freed = int(r.get("bytes", 0))
            elif r["ok"]:
                self._memory_fire(tag, "resumed")
            else:
                m.last_error = str(r.get("error") or res.message)
                self._memory_fire(tag, "release_failed" if release else "resume_failed")
                self._memory_fire(tag, "keep_resident" if release else
                                  "keep_discarded" if m.was is M.discarded else "keep_released")
        detail = {**res.detail, "memory": self.memory_snapshot()}
        self._end(rec, ControlResult(res.ok, res.message, detail))
