"""Session and responses-store messages: `OpenSession`, `CloseSession` [control -> sessions],
`SessionBegin`, `SessionEnd`, `SessionReap`; `ResponseBegin` ... `ResponseCancel` [the responses
store]. Re-exported by `messages`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OpenSession", "CloseSession", "SessionBegin", "SessionEnd", "SessionReap", "ResponseBegin", "ResponseStarted", "ResponseEnd", "ResponseDelete", "ResponseCancel"]


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


# -- the responses store (/v1/responses with store) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseBegin:
    """A stored response is being made: note it ``queued``. With ``previous_id`` the answer
    carries that response's record (what a continuation is composed from), or refuses: unknown,
    deleted or evicted, still in progress. ``background``: made with ``background: true`` (only
    such a response can be cancelled, `ResponseCancel`)."""
    response_id: str
    previous_id: str | None = None
    body: Any = None              # the response object as it stands (queued)
    background: bool = False


@dataclass(frozen=True, slots=True)
class ResponseStarted:
    """From the response's request actor, when the scheduler first took it: ``in_progress``."""
    response_id: str


@dataclass(frozen=True, slots=True)
class ResponseEnd:
    """A stored response's generation ended: ``status`` is completed | incomplete | failed |
    cancelled; ``body`` the final response object; ``record`` what a continuation needs
    (its conversation, input items, session, rid and token ids)."""
    response_id: str
    status: str
    body: Any = None
    record: Any = None


@dataclass(frozen=True, slots=True)
class ResponseDelete:
    response_id: str


@dataclass(frozen=True, slots=True)
class ResponseCancel:
    """``POST /v1/responses/{id}/cancel``: a background response still queued or in progress is
    aborted (an `AbortRequest` to the control actor) and the answer waits for its end; an ended
    one is answered as it is; a synchronous one is refused."""
    response_id: str
