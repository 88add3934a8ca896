"""Request bodies as pydantic models, and their conversion to `SamplingParams`.

OpenAI: `ChatCompletionRequest`, `CompletionRequest` (``max_tokens`` / ``max_completion_tokens``,
``stop`` str | list, ``seed``, ``n``, ``logprobs`` / ``top_logprobs``,
``stream_options.include_usage``), the field types every body shares, and `_Body`. SGLang's
native bodies (`GenerateRequest`, the control bodies) are in `native_schemas`, the tokenizer
routes' in `tokenize_routes`. Wrong types are 400s, and so is a field the server does not know: every field
accepted has its effect (`docs/api.md`, "Accepted fields"). The one exception is each body's
`ignored` set, vendor extras with no effect on the output (``user``, ``metadata``, ``store``,
...), dropped before validation.

Output constraints (``response_format``, SGLang's ``regex`` / ``json_schema`` / ``ebnf`` /
``structural_tag``, vLLM's ``guided_*``) and tools are read here and turned into a grammar by
`constraints` and `tools`.

Validation at the edge, in two layers, each a 400 naming the field (``param``):

* here, what a value alone decides: each field's range is a constraint on its type (the
  `Annotated` aliases below; they also appear in any schema generated from these models), list
  sizes are bounded (`MAX_BATCH` inputs, `MAX_MESSAGES`, `MAX_STOP` stop strings of at most
  `MAX_STOP_CHARS`), ids are 32-bit, seeds 64-bit; `SamplingParams` then checks the rest
  (``top_k != 0``; `ParamError`) as the engine's own source of truth;
* in `generation` (``check_*``), what needs the model: token ids within the vocabulary, a
  prompt within the context, ``logit_bias`` keys, inputs × ``n`` per request.

`read_json` (from `safe_json`) reads a body: within the size limit, depth-limited, no NaN, no
lone surrogates, an object.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, WithJsonSchema,
    model_validator,
)

from ...engine.scheduling.params import SamplingParams
from .errors import FieldError
from .noop_fields import drop_noop_fields
from ..openai.reasoning_fields import ChatReasoningFields
from .safe_json import read_json
from .sampling_fields import to_sampling

__all__ = ["read_json"]      # re-exported: the routes read bodies through here

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1        # a seed: what torch.Generator and vLLM take
MAX_BATCH = 1024           # inputs of one /generate or /v1/completions request
MAX_MESSAGES = 2048        # chat messages
MAX_STOP = 16              # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 512       # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_ID_CHARS = 256         # a rid, a session id
MAX_TOP_LOGPROBS = 20      # OpenAI's top_logprobs bound; completions' logprobs as vLLM (OpenAI: 5)
MAX_TEMPERATURE = 100.0    # OpenAI: 2; vLLM and SGLang: none
MAX_TIMEOUT_S = 3600.0     # /flush_cache's wait
MAX_SESSION_TIMEOUT_S = 30 * 86400.0

Number = Union[StrictInt, StrictFloat]
Seed = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]   # 0 would still produce one token
# SGLang's max_new_tokens: 0 runs the prompt only (its logprobs), no token generated
MaxNewTokens = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
MinTokens = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]   # vLLM's min_tokens, SGLang's min_new_tokens
DEFAULT_COMPLETION_TOKENS = 16     # /v1/completions without max_tokens: OpenAI's, vLLM's, SGLang's
# A request's own deadline in seconds (actorserve extra; else --request-timeout): past it the
# request is aborted, finish_reason "timeout".
RequestTimeout = Annotated[Number, Field(gt=0, le=MAX_TIMEOUT_S)]
# Scheduling priority (vLLM's and SGLang's field): ordered under --scheduling-policy priority;
# a non-zero one under FCFS is vLLM's 400. null and 0 are the default.
Priority = Annotated[StrictInt, Field(ge=-INT32_MAX, le=INT32_MAX)]
Temperature = Annotated[Number, Field(ge=0, le=MAX_TEMPERATURE)]
TopP = Annotated[Number, Field(gt=0, le=1)]
TopK = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)]       # -1 = off; 0 is refused by SamplingParams
MinP = Annotated[Number, Field(ge=0, le=1)]
RepetitionPenalty = Annotated[Number, Field(gt=0, le=2)]      # SGLang's bound
Penalty = Annotated[Number, Field(ge=-2, le=2)]               # frequency / presence (OpenAI)
ChoiceCount = Annotated[StrictInt, Field(ge=1, le=64)]        # n (generation.MAX_N)
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)]   # SGLang's; -1 = output only
LogprobIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]], Field(max_length=128)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]     # the vocabulary bound needs the model
TokenIds = list[TokenId]
TruncatePrompt = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)]   # -1: the context size
StopStr = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]
Stop = Union[StopStr, Annotated[list[StopStr], Field(max_length=MAX_STOP)]]
# SGLang's stop_regex: patterns searched in the output text (checked in full by `stop_patterns`)
StopRegex = Union[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)],
                  Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                            Field(max_length=MAX_STOP)]]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
Id = Annotated[StrictStr, Field(max_length=MAX_ID_CHARS)]
# What a chat message is (checked in full by `TextTokenizer.validate_messages`, which names the
# field); the JSON schema says so too, so the OpenAPI document and a fuzzer built on it send
# messages the server can serve.
_MESSAGE_SCHEMA = {
    "type": "object", "required": ["role", "content"], "additionalProperties": True,
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": {"type": "string", "maxLength": MAX_ID_CHARS},
        # an assistant's calls (its content may then be null) and a tool's answer to one
        "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
            "id": {"type": "string"}, "type": {"const": "function"},
            "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
        "tool_call_id": {"type": "string"}}}
Message = Annotated[dict[str, Any], WithJsonSchema(_MESSAGE_SCHEMA)]
Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
# token id (as a string) -> bias; the keys are checked against the vocabulary in `generation`
LogitBias = dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]]
StrBatch = Annotated[list[StrictStr], Field(max_length=MAX_BATCH)]
IdsBatch = Annotated[list[TokenIds], Field(max_length=MAX_BATCH)]
IdBatch = Annotated[list[Id], Field(max_length=MAX_BATCH)]


# What the constraint fields look like (checked in full by `constraints`, which names the field).
_OBJECT_OR_JSON = {"anyOf": [{"type": "object"}, {"type": "string"}]}
_RESPONSE_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
    "json_schema": {"type": "object", "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"},
        "description": {"type": "string"}}}}}
ResponseFormat = Annotated[Any, WithJsonSchema(_RESPONSE_FORMAT)]
ObjectOrJson = Annotated[Any, WithJsonSchema(_OBJECT_OR_JSON)]
# vLLM's structured_outputs (checked in full by `constraints`)
StructuredOutputs = Annotated[Any, WithJsonSchema({"type": "object", "properties": {
    "json": _OBJECT_OR_JSON, "regex": {"type": "string"}, "choice": {"type": "array", "items": {"type": "string"}},
    "grammar": {"type": "string"}, "json_object": {"type": "boolean"}, "structural_tag": {"type": "string"}}})]
Spec = Annotated[StrictStr, Field(min_length=1, max_length=1 << 20)]
Choices = Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1024)]
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean"}}}}}
Tools = Annotated[list[Annotated[dict[str, Any], WithJsonSchema(_TOOL)]], Field(max_length=128)]
_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
ToolChoice = Annotated[Any, WithJsonSchema(_TOOL_CHOICE)]


class _Body(BaseModel):
    """A request body: unknown fields are a 400, except the vendor extras in `ignored`."""
    model_config = ConfigDict(extra="forbid")
    ignored: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        data = drop_noop_fields(data, cls.model_fields)     # the peers' no-op fields
        if isinstance(data, dict) and cls.ignored and not cls.ignored.isdisjoint(data):
            data = {k: v for k, v in data.items() if k not in cls.ignored}
        return data


# OpenAI fields that change nothing in what is generated (bookkeeping, billing, caching hints).
OPENAI_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier"})


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False     # vLLM's: usage on every chunk (with include_usage)


class SessionParams(_Body):
    """SGLang's ``session_params``: continue a session's chain (see `actors.session`)."""
    id: Id
    rid: Id | None = None
    offset: StrictInt | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)   # < 0: from the end
    replace: StrictBool = False
    drop_previous_output: StrictBool = False


# what an OpenAI body sends under `SamplingParams`' own names (None: not sent)
SAMPLED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty", "stop", "stop_regex", "stop_token_ids", "min_tokens", "logit_bias",
           "ignore_eos", "seed", "n", "skip_special_tokens")


class _OpenAICommon(_Body):
    ignored = OPENAI_IGNORED
    model: StrictStr | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Stop | None = None
    stop_regex: StopRegex | None = None                    # SGLang's
    stop_token_ids: StopTokenIds | None = None
    min_tokens: MinTokens = 0                              # vLLM's
    logit_bias: LogitBias | None = None
    ignore_eos: StrictBool = False
    seed: Seed | None = None
    n: ChoiceCount = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    rid: Id | None = None
    # output constraints (one at most; `constraints`)
    response_format: ResponseFormat | None = None
    regex: Spec | None = None
    ebnf: Spec | None = None
    guided_json: ObjectOrJson | None = None
    guided_regex: Spec | None = None
    guided_grammar: Spec | None = None
    guided_choice: Choices | None = None
    structured_outputs: StructuredOutputs | None = None    # vLLM's current form of the guided_* fields
    skip_special_tokens: StrictBool = True
    request_timeout: RequestTimeout | None = None
    priority: Priority | None = None
    truncate_prompt_tokens: TruncatePrompt | None = None   # vLLM's: keep the last k prompt tokens
    include_stop_str_in_output: StrictBool = False         # vLLM's name,
    no_stop_trim: StrictBool = False                       # and SGLang's: keep the stop in the text

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling(self, max_tokens: int | None, default_max: int, grammar: tuple[str, str] | None,
                  **more: Any) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options can only be set with stream: true")
        sent = {name: getattr(self, name) for name in SAMPLED}
        return to_sampling({**sent, "max_new_tokens": max_tokens,
                            "include_stop": self.include_stop_str_in_output or self.no_stop_trim, **more},
                           default_max, grammar=grammar)


class ChatCompletionRequest(_OpenAICommon, ChatReasoningFields):     # reasoning: `reasoning_fields`
    messages: Messages
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    session_params: SessionParams | None = None
    session_id: Id | None = None                 # shorthand for session_params {id}
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None   # vLLM's; the response's top-level prompt_logprobs
    # vLLM's template controls: the reply's header (default) or the last message left open
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # chat_template_kwargs: `reasoning_fields.ChatReasoningFields` (checked in `reasoning_plan`)

    def generation_prompt_kwargs(self) -> dict[str, Any]:
        """``add_generation_prompt`` / ``continue_final_message`` for the chat template."""
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise FieldError("continue_final_message",
                             "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        kw: dict[str, Any] = {}
        if self.continue_final_message:
            if self.messages[-1].get("role") != "assistant":
                raise FieldError("continue_final_message", "continue_final_message needs the last "
                                 "message to be the assistant's, to continue")
            kw["continue_final_message"] = True
        kw["add_generation_prompt"] = self.add_generation_prompt and not self.continue_final_message
        return kw

    def sampling(self, default_max: int, grammar: tuple[str, str] | None = None) -> SamplingParams:
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = self.top_logprobs or 0
        if top and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs: true")
        return self._sampling(mt, default_max, grammar, logprobs=self.logprobs, top_logprobs=top,
                              prompt_logprobs=self.prompt_logprobs)


class CompletionRequest(_OpenAICommon):
    prompt: StrictStr | StrBatch | TokenIds | IdsBatch
    logprobs: TopLogprobs | None = None
    echo: StrictBool = False
    prompt_logprobs: TopLogprobs | None = None   # vLLM's; each choice's prompt_logprobs (echo: logprobs)
    suffix: StrictStr | None = None              # refused unless empty (no fill-in-the-middle)
    # OpenAI's: generate best_of candidates, answer the n with the highest log probability
    best_of: Annotated[StrictInt, Field(ge=1, le=64)] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise FieldError("prompt", "prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]          # one prompt of token ids
        return list(p)

    def sampling(self, default_max: int, grammar: tuple[str, str] | None = None) -> SamplingParams:
        mt = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        if mt is None:
            default_max = min(DEFAULT_COMPLETION_TOKENS, default_max)
        lp = self.logprobs
        plp = lp if self.prompt_logprobs is None and self.echo else self.prompt_logprobs   # vLLM's rule
        return self._sampling(mt, default_max, grammar, logprobs=lp is not None, top_logprobs=lp or 0,
                              prompt_logprobs=plp)
