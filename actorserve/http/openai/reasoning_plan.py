"""What a chat or Responses request's reasoning means on a server with ``--reasoning-parser``.

`plan_reasoning` reads the request once and returns a `ReasoningPlan`: whether the answer's
text is split (`reasoning.ReasoningSplit`; SGLang's ``separate_reasoning``, default true),
whether the output starts inside reasoning (the format, or a ``<think>`` the chat template
left open at the end of the prompt), whether reasoning streams as it comes (SGLang's
``stream_reasoning``), and the thinking budget (``max_thinking_tokens``; vLLM's
``thinking_token_budget``, SGLang's ``thinking_budget``), which becomes sampling parameters
the engine enforces (`engine.sampling.thinking`). A constraint (``response_format``, ``guided_*``, the
grammar of ``tool_choice`` required / named / auto, ...) starts after the reasoning: the
engine leaves ``<think>`` ... ``</think>`` free and constrains the answer (vLLM's and SGLang's
rule; `ReasoningPlan.sampling`), and the tool parser reads only the answer's text.

The answer carries the reasoning as ``reasoning_content`` (SGLang's and DeepSeek's name, which
most clients read) and as ``reasoning`` (vLLM's current name, OpenRouter's), on the message and
on each streamed delta, and ``usage.completion_tokens_details.reasoning_tokens`` (OpenAI's
place; SGLang's top-level ``usage.reasoning_tokens`` too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...engine.scheduling.params import SamplingParams
from ...engine.sampling.thinking import ThinkCounter, count_reasoning
from ..edge.errors import FieldError
from .reasoning import ReasoningFormat, ReasoningSplit, get_format, split_text
from ..tools.tools import DeltaStream, ToolPlan

__all__ = ["ReasoningPlan", "plan_reasoning", "ChoiceStream", "BUDGET_FIELDS", "template_kwargs"]

#: the thinking budget's names: ours, vLLM's, SGLang's (its custom_params key, Qwen's API)
BUDGET_FIELDS = ("max_thinking_tokens", "thinking_token_budget", "thinking_budget")
_TAIL = 64          # prompt tokens read back to see whether the template left <think> open


@dataclass(slots=True)
class ReasoningPlan:
    fmt: ReasoningFormat | None = None       # None: the text is not split
    opened: bool = False                     # the output starts inside reasoning
    stream_reasoning: bool = True
    think_ids: tuple[int, int] | None = None
    budget: int | None = None
    # a constraint waits for the end of reasoning: a reasoning parser is in effect and the prompt
    # did not close reasoning itself (Qwen3's ``enable_thinking: false`` ends it with </think>)
    after_think: bool = False

    @property
    def splits(self) -> bool:
        return self.fmt is not None

    def splitter(self) -> ReasoningSplit | None:
        if self.fmt is None:
            return None
        return ReasoningSplit(self.fmt, opened=self.opened, stream_reasoning=self.stream_reasoning)

    def sampling(self, sp: SamplingParams) -> SamplingParams:
        """The engine's view of the plan: the thinking budget, and a constraint (a grammar, the
        tool calls' included) that starts after reasoning (`engine.sampling.thinking.GrammarGate`). Tags
        that are not single tokens cannot be followed on token ids: the grammar then applies
        from the first token, as without a reasoning parser."""
        gated = sp.grammar is not None and self.after_think and self.think_ids is not None
        if self.budget is None and not gated:
            return sp
        return dataclasses.replace(sp, thinking_budget=self.budget, think_ids=self.think_ids,
                                   think_open=self.opened, grammar_after_think=gated)

    def split(self, text: str) -> tuple[str | None, str]:
        if self.fmt is None:
            return None, text
        return split_text(self.fmt, text, opened=self.opened)

    def message(self, plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A choice's assistant message from its whole text (reasoning split off first, tool
        calls parsed from the rest), and its finish reason."""
        reasoning, content = self.split(text)
        message, finish = plan.message(content, finish)
        if self.fmt is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message, finish

    def tokens(self, token_ids: list[int], reasoning: str | None, tokenizer: Any) -> int:
        """Output tokens spent reasoning: counted on the ids when the tags are single tokens,
        else the reasoning text's own token count."""
        if self.think_ids is not None:
            return count_reasoning(token_ids, *self.think_ids, self.opened)
        return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def add_usage(self, usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
        if self.fmt is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
            usage["reasoning_tokens"] = reasoning_tokens
        return usage


def _think_ids(ctx: Any, fmt: ReasoningFormat) -> tuple[int, int] | None:
    """The tags' token ids when each is one token of the vocabulary (cached per server)."""
    key = ("think_ids", fmt.name)
    if key not in ctx.extra:
        ids = []
        for tag in (fmt.start, fmt.end):
            enc = ctx.tokenizer.encode(tag, add_special_tokens=False)
            ids.append(enc[0] if len(enc) == 1 else None)
        ctx.extra[key] = (ids[0], ids[1]) if None not in ids else None
    return ctx.extra[key]


def _budget(body: Any) -> tuple[int | None, str]:
    given = [(f, getattr(body, f, None)) for f in BUDGET_FIELDS if getattr(body, f, None) is not None]
    if len({v for _, v in given}) > 1:
        raise FieldError(given[1][0], f"{given[0][0]} and {given[1][0]} name the same thinking budget; "
                                      "send one of them")
    return (given[0][1], given[0][0]) if given else (None, BUDGET_FIELDS[0])


def plan_reasoning(ctx: Any, body: Any, prompt_ids: list[int]) -> ReasoningPlan:
    """The `ReasoningPlan` of a request (a chat or Responses body) whose prompt is `prompt_ids`."""
    budget, param = _budget(body)
    name = getattr(ctx.config, "reasoning_parser", None)
    if name is None:
        if budget is not None:
            raise FieldError(param, f"{param} needs a reasoning model: start the server with "
                                    "--reasoning-parser qwen3|deepseek-r1")
        return ReasoningPlan()
    fmt = get_format(name)
    tail = ctx.tokenizer.decode(prompt_ids[-_TAIL:], skip_special_tokens=False)
    opened = fmt.opens(tail)
    ids = _think_ids(ctx, fmt)
    if budget is not None and ids is None:
        raise FieldError(param, f"{param} needs {fmt.start} and {fmt.end} to be single tokens of "
                                "this model's vocabulary; they are not")
    separate = getattr(body, "separate_reasoning", True)
    closed = not opened and tail.rstrip().endswith(fmt.end)
    return ReasoningPlan(fmt if separate else None, opened, getattr(body, "stream_reasoning", True),
                         ids, budget, after_think=not closed)


#: what a request may not set through chat_template_kwargs: the route's own arguments of the
#: tokenizer's apply_chat_template (the template's variables are anything else)
_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                       "add_generation_prompt", "continue_final_message", "sanitize_control_tokens",
                       "padding", "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(body: Any, plan: ToolPlan) -> dict[str, Any]:
    """The chat template's extra variables: the request's ``chat_template_kwargs`` (Qwen3's
    ``enable_thinking``, ...) under the tool plan's own."""
    own = dict(getattr(body, "chat_template_kwargs", None) or {})
    bad = sorted(_RESERVED.intersection(own))
    if bad:
        raise FieldError(f"chat_template_kwargs.{bad[0]}", f"chat_template_kwargs may not set {bad[0]!r}")
    return {**own, **plan.template_kwargs}


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


class ChoiceStream:
    """One streamed chat choice: reasoning deltas first, then content and tool-call deltas
    (`tools.DeltaStream` sees only the content)."""

    def __init__(self, plan: ToolPlan, rplan: ReasoningPlan) -> None:
        self.rplan = rplan
        self.deltas = DeltaStream(plan)
        self.split = rplan.splitter()
        ids = rplan.think_ids
        self.counter = ThinkCounter(*ids, rplan.opened) if ids is not None else None

    def feed(self, text: str, token_ids: list[int], finished: bool) -> list[dict[str, Any]]:
        if self.counter is not None:
            self.counter.feed(token_ids)
        if self.split is None:
            return self.deltas.feed(text) + (self.deltas.finish() if finished else [])
        reasoning, content = self.split.feed(text)
        if finished:
            more_r, more_c = self.split.finish()
            reasoning, content = reasoning + more_r, content + more_c
        out = [reasoning_delta(reasoning)] if reasoning else []
        out += self.deltas.feed(content)
        if finished:
            out += self.deltas.finish()
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return self.deltas.finish_reason(reason)

    def reasoning_tokens(self, tokenizer: Any) -> int:
        if self.counter is not None:
            return self.counter.count
        text = self.split.reasoning if self.split is not None else ""
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
