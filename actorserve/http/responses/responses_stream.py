"""A streamed `/v1/responses`: a request's outputs as the Responses API's events.

``response.created``, ``response.in_progress``; for a reasoning model's thinking (a server with
``--reasoning-parser``) first ``response.output_item.added`` (a ``reasoning`` item),
``response.content_part.added`` (a ``reasoning_text`` part), ``response.reasoning_text.delta``
..., ``response.reasoning_text.done``, ``response.content_part.done``,
``response.output_item.done`` (the item closes when the answer begins); for text ``response.output_item.added`` (a
message), ``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for a tool call ``response.output_item.added`` (a ``function_call``),
``response.function_call_arguments.delta`` ..., ``.done``, ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when it ran out of tokens or was aborted,
``response.failed`` when generation failed). Every event carries its ``sequence_number`` and
is sent with its type as the SSE ``event:`` too. Tool calls are found by the same incremental
parser the chat route streams with (`tools.DeltaStream`).

A background stream (``background: true``) goes to a ``sink`` (its `responses_background.EventLog`)
instead of a connection, so it can be read, and resumed, by any client; it begins
``response.created`` and ``response.queued`` (the response queued), and says
``response.in_progress`` (`progress`) when its first output arrives.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web

from ...messages import RequestOutput
from ..edge import sse
from ..openai.reasoning import ReasoningSplit
from .responses_items import call_item, message_item, reasoning_item
from ..tools.tools import DeltaStream, ToolPlan

#: a request's finish reason -> the response's status (an abort, a client gone, a deadline
#: passed: cancelled; only a failure of the generation itself is failed)
STATUS_OF = {"stop": "completed", "tool_calls": "completed", "length": "incomplete",
             "abort": "cancelled", "timeout": "cancelled", "error": "failed"}
END_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.incomplete", "failed": "response.failed"}


class EventStream:
    def __init__(self, resp: web.StreamResponse | None, plan: ToolPlan, want_logprobs: bool,
                 token_logprobs: Any, split: ReasoningSplit | None = None,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.resp = resp
        self.sink = sink                          # takes each event instead of `resp`
        self.deltas = DeltaStream(plan)
        self.split = split                        # reasoning split off the text (`reasoning`)
        self._think: int | None = None            # output index of the open reasoning item
        self.want_logprobs = want_logprobs
        self.token_logprobs = token_logprobs      # RequestOutput.logprobs -> Responses logprob dicts
        self.seq = 0
        self._texts: list[str] = []               # joined when read (`text`), not per token
        self.token_ids: list[int] = []
        self.logprobs: list[Any] | None = [] if want_logprobs else None
        self.output: list[dict[str, Any]] = []
        self._msg: int | None = None              # output index of the open message item
        self._calls: dict[int, int] = {}          # tool-call index -> output index (open ones)
        self._pending: list[dict[str, Any]] = []  # logprobs of text held back (a possible call)

    @property
    def text(self) -> str:
        return "".join(self._texts)

    async def _send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        if self.sink is not None:
            self.sink(event)
            return
        assert self.resp is not None
        await sse.send(self.resp, event, event=kind)

    async def begin(self, response: dict[str, Any]) -> None:
        await self._send("response.created", response=response)
        if response["status"] == "queued":
            await self._send("response.queued", response=response)
        else:
            await self._send("response.in_progress", response=response)

    async def progress(self, response: dict[str, Any]) -> None:
        """A queued (background) response's generation has begun."""
        await self._send("response.in_progress", response=response)

    async def feed(self, out: RequestOutput) -> None:
        self._texts.append(out.text)
        self.token_ids.extend(out.token_ids)
        if self.want_logprobs and out.logprobs:
            self._pending.extend(self.token_logprobs(out.logprobs))
        text = out.text
        if self.split is not None:
            thought, text = self.split.feed(text)
            if out.finished:
                more_t, more_c = self.split.finish()
                thought, text = thought + more_t, text + more_c
            if thought:
                await self._reasoning(thought)
        deltas = self.deltas.feed(text)
        if out.finished:
            deltas += self.deltas.finish()
        if deltas:
            await self._close_reasoning("completed")
        for d in deltas:
            if "content" in d:
                await self._content(d["content"])
            else:
                for call in d["tool_calls"]:
                    await self._call(call)

    # -- reasoning -------------------------------------------------------------------------
    async def _reasoning(self, text: str) -> None:
        if self._think is None:
            item = reasoning_item("", "in_progress")
            item["content"] = []
            self.output.append(item)
            self._think = len(self.output) - 1
            await self._send("response.output_item.added", output_index=self._think, item=_copy(item))
            item["content"] = [{"type": "reasoning_text", "text": ""}]
            await self._send("response.content_part.added", item_id=item["id"], output_index=self._think,
                             content_index=0, part=dict(item["content"][0]))
        item = self.output[self._think]
        item["content"][0]["text"] += text
        await self._send("response.reasoning_text.delta", item_id=item["id"], output_index=self._think,
                         content_index=0, delta=text)

    async def _close_reasoning(self, status: str) -> None:
        if self._think is None:
            return
        at, self._think = self._think, None
        item = self.output[at]
        item["status"] = status
        part = item["content"][0]
        await self._send("response.reasoning_text.done", item_id=item["id"], output_index=at,
                         content_index=0, text=part["text"])
        await self._send("response.content_part.done", item_id=item["id"], output_index=at,
                         content_index=0, part=dict(part))
        await self._send("response.output_item.done", output_index=at, item=_copy(item))

    # -- message text ----------------------------------------------------------------------
    async def _open_message(self) -> dict[str, Any]:
        item = message_item("", "in_progress", [] if self.want_logprobs else None)
        self.output.append(item)
        self._msg = len(self.output) - 1
        await self._send("response.output_item.added", output_index=self._msg, item=_copy(item))
        await self._send("response.content_part.added", item_id=item["id"], output_index=self._msg,
                         content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                "logprobs": []})
        return item

    async def _content(self, text: str) -> None:
        if not text:
            return
        item = self.output[self._msg] if self._msg is not None else await self._open_message()
        part = item["content"][0]
        part["text"] += text
        lps, self._pending = self._pending, []
        if self.logprobs is not None:
            part["logprobs"].extend(lps)
            self.logprobs.extend(lps)
        await self._send("response.output_text.delta", item_id=item["id"], output_index=self._msg,
                         content_index=0, delta=text, logprobs=lps)

    async def _close_message(self, status: str) -> None:
        if self._msg is None:
            return
        at, self._msg = self._msg, None
        item = self.output[at]
        part = item["content"][0]
        if self._pending and self.logprobs is not None:
            part["logprobs"].extend(self._pending)
            self.logprobs.extend(self._pending)
            self._pending = []
        item["status"] = status
        await self._send("response.output_text.done", item_id=item["id"], output_index=at,
                         content_index=0, text=part["text"], logprobs=part.get("logprobs") or [])
        await self._send("response.content_part.done", item_id=item["id"], output_index=at,
                         content_index=0, part=_copy(part))
        await self._send("response.output_item.done", output_index=at, item=_copy(item))

    # -- tool calls ------------------------------------------------------------------------
    async def _call(self, call: dict[str, Any]) -> None:
        fn = call.get("function") or {}
        if call.get("id") is not None:                # a new call: text before it is done
            self._pending = []                        # (held-back logprobs were the call's)
            await self._close_message("completed")
            item = call_item(call["id"], fn.get("name", ""), "", "in_progress")
            self.output.append(item)
            self._calls[call["index"]] = len(self.output) - 1
            await self._send("response.output_item.added", output_index=len(self.output) - 1,
                             item=_copy(item))
        at = self._calls[call["index"]]
        item = self.output[at]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            await self._send("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=at, delta=fn["arguments"])

    # -- the end ---------------------------------------------------------------------------
    async def close_items(self, status: str) -> None:
        """Close every open item (``status``: completed, or incomplete when it ran out)."""
        await self._close_reasoning(status)
        if not any(i["type"] != "reasoning" for i in self.output):
            await self._open_message()      # no text and no call: one empty message, as unstreamed
        await self._close_message(status)
        for at in sorted(self._calls.values()):
            item = self.output[at]
            item["status"] = "completed"
            await self._send("response.function_call_arguments.done", item_id=item["id"],
                             output_index=at, arguments=item["arguments"])
            await self._send("response.output_item.done", output_index=at, item=_copy(item))
        self._calls.clear()

    async def end(self, response: dict[str, Any]) -> None:
        await self._send(END_EVENT[response["status"]], response=response)

    async def conclude(self, rid: str, final: RequestOutput,
                       finish: Callable[[RequestOutput, list[dict[str, Any]]], dict[str, Any]]) -> None:
        """The request's last output was fed: close the items, send the final response object
        (``finish`` makes it from the whole output and the streamed items)."""
        merged = RequestOutput(rid, text=self.text, token_ids=self.token_ids, finished=True,
                               finish_reason=final.finish_reason, error=final.error,
                               prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                               cached_tokens=final.cached_tokens)
        status = STATUS_OF.get(final.finish_reason or "error", "failed")
        await self.close_items("incomplete" if status == "incomplete" else "completed")
        await self.end(finish(merged, self.output))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event (the item goes on changing as deltas arrive)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, logprobs=list(p["logprobs"])) if "logprobs" in p else dict(p)
                          for p in out["content"]]
    return out
