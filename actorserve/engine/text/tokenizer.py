"""`TextTokenizer`: the one place the engine talks to a HF tokenizer.

Design
------
A thin wrapper that pins down the behaviour the rest of the server relies on:

* ``encode`` / ``decode`` return plain ``list[int]`` / ``str`` and always decode with
  ``clean_up_tokenization_spaces=False``, so a full decode agrees with the streaming
  `IncrementalDetokenizer` (clean-up rewrites text that a stream has already sent).
* ``apply_chat_template`` validates OpenAI-style messages *before* rendering (roles
  ``system | user | assistant | tool``, or any other non-empty role name, which goes to the
  template as it is: vLLM's custom roles; ``content`` a string or a list of
  ``{"type": "text", "text": ...}`` parts, flattened to a string because most templates
  concatenate ``message['content']``), renders the template to text and encodes that text
  without adding special tokens again (templates already contain BOS etc.). Bad shapes
  raise ``ValueError`` with a message fit for a 400 response.
* ``eos_token_ids`` merges the tokenizer's EOS with the generation config's
  ``eos_token_id`` (int or list), in order and de-duplicated.
* ``special_ids`` is computed once and handed to every detokenizer it creates.

No torch import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .detokenizer import IncrementalDetokenizer, special_token_ids

__all__ = ["TextTokenizer", "CHAT_ROLES"]

CHAT_ROLES = ("system", "user", "assistant", "tool")     # the known ones; others pass through
MAX_ROLE_CHARS = 256


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


class TextTokenizer:
    """Wraps a HF tokenizer (``.hf``) with the server's encode/decode/chat conventions."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        generation_config: Any = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        eos = _as_id_list(getattr(hf_tokenizer, "eos_token_id", None))
        if generation_config is not None:
            if isinstance(generation_config, Mapping):
                gen_eos = generation_config.get("eos_token_id")
            else:
                gen_eos = getattr(generation_config, "eos_token_id", None)
            eos += _as_id_list(gen_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.special_ids: frozenset[int] = special_token_ids(hf_tokenizer)

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, **kwargs: Any) -> "TextTokenizer":
        """Load a tokenizer (and, if present, the generation config) from a local directory."""
        from transformers import AutoTokenizer, GenerationConfig

        tok_kwargs = dict(kwargs)
        if gguf_file is not None:
            tok_kwargs["gguf_file"] = gguf_file
        hf = AutoTokenizer.from_pretrained(path, **tok_kwargs)
        gen = None
        if gguf_file is None:
            try:
                gen = GenerationConfig.from_pretrained(path)
            except (OSError, ValueError):
                gen = None
        return cls(hf, generation_config=gen)

    # ------------------------------------------------------------------ basics

    @property
    def vocab_size(self) -> int:
        """Size of the id space, added tokens included."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def new_detokenizer(self, **kwargs: Any) -> IncrementalDetokenizer:
        """An `IncrementalDetokenizer` over this tokenizer (kwargs: skip_special_tokens, stop, include_stop)."""
        kwargs.setdefault("special_ids", self.special_ids)
        return IncrementalDetokenizer(self.hf, **kwargs)

    def detokenizer_for(self, sp: Any) -> IncrementalDetokenizer:
        """The detokenizer a request with sampling parameters `sp` needs (the runtime's factory:
        stop strings and special-token skipping come from the request)."""
        return self.new_detokenizer(stop=sp.stop, skip_special_tokens=sp.skip_special_tokens,
                                    include_stop=sp.include_stop, stop_regex=sp.stop_regex,
                                    min_tokens=sp.min_tokens)

    # ------------------------------------------------------------ chat template

    @staticmethod
    def validate_messages(messages: Any) -> list[dict[str, Any]]:
        """Check OpenAI-style chat messages; return copies with ``content`` flattened to str."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(msg, Mapping):
                raise ValueError(f"{where} must be an object with 'role' and 'content', "
                                 f"got {type(msg).__name__}")
            role = msg.get("role")
            if role not in CHAT_ROLES and not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE_CHARS):
                raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)} or a custom role "
                                 f"name (1 to {MAX_ROLE_CHARS} characters); got {role!r}"[:400])
            content = msg.get("content")
            if content is None:
                if role == "assistant" and msg.get("tool_calls"):
                    content = ""
                else:
                    raise ValueError(f"{where}.content is required for role {role!r}")
            elif isinstance(content, list):
                texts: list[str] = []
                for j, part in enumerate(content):
                    if (not isinstance(part, Mapping) or part.get("type") != "text"
                            or not isinstance(part.get("text"), str)):
                        raise ValueError(f"{where}.content[{j}] must be {{\"type\": \"text\", "
                                         f"\"text\": <string>}}; got {part!r}"[:300])
                    texts.append(part["text"])
                content = "\n".join(texts)
            elif not isinstance(content, str):
                raise ValueError(f"{where}.content must be a string or a list of text parts, "
                                 f"got {type(content).__name__}")
            clean = dict(msg)
            clean["content"] = content
            out.append(clean)
        return out

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Validate ``messages`` and render the chat template to text."""
        clean = self.validate_messages(messages)
        template = self.chat_template or getattr(self.hf, "chat_template", None)
        if not template:
            raise ValueError("this model's tokenizer has no chat template; use the completions API")
        try:
            text = self.hf.apply_chat_template(
                clean, chat_template=template, add_generation_prompt=add_generation_prompt,
                tokenize=False, **template_kwargs)
        except Exception as exc:  # jinja2 errors (raise_exception in templates, bad fields)
            raise ValueError(f"chat template failed to render the messages: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError("chat template did not render to a string")
        return text

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        """Validate, render and encode chat ``messages``; returns prompt token ids."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)
