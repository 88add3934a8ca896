"""Reasoning models: splitting ``<think>`` ... ``</think>`` out of a choice's text.

Pure text, no tokens: `ReasoningSplit` is a streaming state machine over the detokenized
deltas of one choice (tags may arrive split across any number of deltas), and `split_text` the
same rule over a whole text. The server's ``--reasoning-parser`` picks a `ReasoningFormat`:

* ``qwen3``: the output is reasoning when it starts with ``<think>`` (whitespace before it
  allowed) or when the prompt left a ``<think>`` open (a chat template that opens it, Qwen3's
  2507 thinking models); otherwise it is all content (``enable_thinking: false``: Qwen3's
  template closes an empty ``<think></think>`` in the prompt).
* ``deepseek-r1``: the output starts inside reasoning whatever the prompt (DeepSeek-R1's
  template opened ``<think>``, or the model writes none); a leading ``<think>`` is dropped.

Inside reasoning, everything up to the first ``</think>`` is reasoning and everything after
it content (a later ``<think>`` is content's text). An output cut before ``</think>`` (length,
abort) is all reasoning, its content empty: SGLang's and vLLM's rule. The tags themselves
are in neither part; the text between them is kept as the model wrote it.

While streaming, text that may be the beginning of a tag is held back until the next delta
decides (at most ``len("</think>") - 1`` characters); `finish` releases it. With
``stream_reasoning: false`` (SGLang's) reasoning is held whole and sent in one piece when
``</think>`` arrives or the output ends.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReasoningFormat", "FORMATS", "get_format", "ReasoningSplit", "split_text", "prompt_opens"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False        # the output starts inside reasoning whatever the prompt

    def opens(self, prompt_text: str) -> bool:
        """Does an output after this prompt start inside reasoning?"""
        return self.always or prompt_opens(prompt_text, self.start, self.end)


FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", always=True),
}
# other spellings of the same parsers (vLLM's deepseek_r1; SGLang's qwen3-thinking, which
# the qwen3 rule covers: its template opens <think> in the prompt)
ALIASES = {"deepseek_r1": "deepseek-r1", "qwen3-thinking": "qwen3", "qwen3_thinking": "qwen3"}
CHOICES = tuple(FORMATS) + tuple(ALIASES)


def get_format(name: str) -> ReasoningFormat:
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; use one of {', '.join(CHOICES)}")
    return FORMATS[key]


def prompt_opens(prompt_text: str, start: str, end: str) -> bool:
    """The prompt's last ``start`` tag comes after its last ``end`` tag (left open)."""
    at = prompt_text.rfind(start)
    return at >= 0 and prompt_text.rfind(end) < at


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """One choice's text, fed delta by delta -> (reasoning, content) pieces of each delta.

    States only move forward: ``start`` (nothing decided: the output may open with the start
    tag) -> ``reasoning`` -> ``content``. So within one delta any reasoning comes before any
    content."""

    def __init__(self, fmt: ReasoningFormat, *, opened: bool, stream_reasoning: bool = True) -> None:
        self.fmt = fmt
        self.opened = opened              # reasoning unless the output proves otherwise
        self.stream_reasoning = stream_reasoning
        self.state = "start"
        self._buf = ""                    # text not yet given out (a possible tag, or held reasoning)
        self.reasoning = ""               # all reasoning so far (what was given out)
        self.content = ""
        self.closed = False               # the end tag was seen

    def feed(self, delta: str) -> tuple[str, str]:
        buf = self._buf + delta
        self._buf = ""
        reasoning = content = ""
        if self.state == "start":
            lead = buf.lstrip()
            if self.fmt.start.startswith(lead) and len(lead) < len(self.fmt.start):
                self._buf = buf           # blank, or a beginning of <think>: wait
                return "", ""
            if lead.startswith(self.fmt.start):
                self.state, buf = "reasoning", lead[len(self.fmt.start):]
            elif self.opened:
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = buf.find(self.fmt.end)
            if at >= 0:
                reasoning, buf = buf[:at], buf[at + len(self.fmt.end):]
                self.state, self.closed = "content", True
            elif self.stream_reasoning:
                keep = _held(buf, self.fmt.end)
                reasoning, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                buf = ""
            else:
                self._buf, buf = buf, ""
        if self.state == "content":
            content = buf
        return self._out(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """The end of the output: whatever was held back, where it belongs."""
        buf, self._buf = self._buf, ""
        if self.state == "start":
            if self.opened:
                lead = buf.lstrip()
                return self._out(lead[len(self.fmt.start):] if lead.startswith(self.fmt.start) else buf, "")
            return self._out("", buf)
        if self.state == "reasoning":
            return self._out(buf, "")
        return self._out("", buf)

    def _out(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


def split_text(fmt: ReasoningFormat, text: str, *, opened: bool) -> tuple[str | None, str]:
    """A whole output -> (reasoning, content); reasoning is None when the output has none."""
    s = ReasoningSplit(fmt, opened=opened)
    s.feed(text)
    s.finish()
    return s.reasoning or None, s.content
