"""Request models of the Responses API (`/v1/responses`): the create body, the input-items
query, the path. Unknown fields are a 400 like everywhere; bookkeeping fields that change
nothing generated (``user``, ``safety_identifier``, ``prompt_cache_key`` ...) are dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictStr, WithJsonSchema

from ...engine.scheduling.params import SamplingParams
from ..edge.errors import FieldError
from ..edge.schemas import (
    Id, MaxTokens, Priority, RequestTimeout, Seed, Temperature, TopLogprobs, TopP, _Body, LogitBias,
)
from ..openai.reasoning_fields import ThinkingBudgetFields
from ..edge.sampling_fields import to_sampling

_INPUT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}, "minItems": 1}]}
Input = Annotated[Any, WithJsonSchema(_INPUT)]
_ANY_OBJECT = {"type": "object"}
Obj = Annotated[dict[str, Any], WithJsonSchema(_ANY_OBJECT)]
Metadata = Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)]

#: ``include`` values: the one that changes the output, and those that are vacuous here
#: (no reasoning items, no built-in tools) so asking for them changes nothing
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})


class TextConfig(_Body):
    format: Obj | None = None


class ResponsesRequest(_Body, ThinkingBudgetFields):     # + the thinking budget (`reasoning_fields`)
    ignored = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                         "service_tier"})
    model: StrictStr | None = None
    input: Input
    instructions: StrictStr | None = None
    previous_response_id: Id | None = None
    store: StrictBool = True
    stream: StrictBool = False
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[StrictStr] | None = None
    text: TextConfig | None = None
    tools: list[Obj] | None = Field(default=None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    metadata: Metadata | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    background: StrictBool = False
    reasoning: None = None                   # a reasoning config would go unhonoured: refused
    # actorserve / vLLM extras
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    request_timeout: RequestTimeout | None = None
    priority: Priority | None = None              # vLLM's Responses API takes it too
    ignore_eos: StrictBool = False                # vLLM's (`vllm bench serve` sends it)

    def check(self) -> None:
        if self.background and not self.store:      # vLLM's words (OpenAI keeps them too)
            raise FieldError("background", "background can only be used when `store` is true")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise FieldError(f"include.{i}", f"include {value!r} is not supported; supported: "
                                                 f"{', '.join(sorted(INCLUDABLE))}")

    @property
    def want_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def sampling(self, default_max: int, grammar: tuple[str, str] | None) -> SamplingParams:
        return to_sampling({"max_new_tokens": self.max_output_tokens, "temperature": self.temperature,
                            "top_p": self.top_p, "seed": self.seed, "logprobs": self.want_logprobs,
                            "top_logprobs": (self.top_logprobs or 0) if self.want_logprobs else 0,
                            "logit_bias": self.logit_bias, "ignore_eos": self.ignore_eos},
                           default_max, grammar=grammar)


class InputItemsQuery(_Body):
    after: Id | None = None
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


class RetrieveQuery(_Body):
    """``GET /v1/responses/{id}``: ``stream=true`` (with ``starting_after``, a sequence number)
    replays a background stream's events and follows it to its end."""
    stream: bool = False
    starting_after: Annotated[int, Field(ge=-1)] | None = None
    include: StrictStr | None = None            # one value (what this server can echo: see create)
    include_obfuscation: bool | None = None     # only false: no obfuscation field is ever added

    def check(self) -> None:
        if self.include is not None and self.include not in INCLUDABLE:
            raise FieldError("include", f"include {self.include!r} is not supported; supported: "
                                        f"{', '.join(sorted(INCLUDABLE))}")
        if self.include_obfuscation:
            raise FieldError("include_obfuscation", "stream obfuscation is not supported; send "
                                                    "include_obfuscation=false")
        if self.starting_after is not None and not self.stream:
            raise FieldError("starting_after", "starting_after needs stream=true")


class ResponsePath(BaseModel):
    response_id: str
