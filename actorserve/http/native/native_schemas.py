"""SGLang's native request bodies: `/generate` (`GenerateRequest`, its `NativeSampling`) and the
control routes' bodies (abort, pause, flush, sessions). The shared field types, `_Body` (unknown
fields are 400s; the peers' no-op values are accepted) and the conversion helpers are in
`schemas`, with the OpenAI bodies.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from ...engine.scheduling.params import SamplingParams
from ..edge.errors import FieldError
from ..edge.schemas import (
    INT32_MAX, MAX_BATCH, MAX_SESSION_TIMEOUT_S, MAX_TIMEOUT_S, Choices, ChoiceCount, Id, IdBatch,
    IdsBatch, LogitBias, LogprobIds, LogprobStart, MaxNewTokens, MinP, MinTokens, Number, ObjectOrJson,
    Penalty, Priority, RepetitionPenalty, RequestTimeout, Seed, SessionParams, Spec, Stop, StopRegex,
    StopTokenIds, StrBatch, Temperature, TokenIds, TopK, TopLogprobs, TopP, _Body,
)
from ..edge.sampling_fields import to_sampling


LoraPath = Annotated[StrictStr, Field(min_length=1, max_length=256)]


# what `sampling_params` sends under `SamplingParams`' own names, and SGLang's spellings in errors
SAMPLED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty", "stop", "stop_regex", "stop_token_ids", "logit_bias", "ignore_eos",
           "skip_special_tokens", "n", "seed")
NAMES = {"min_tokens": "sampling_params.min_new_tokens", "stop_regex": "sampling_params.stop_regex"}


class NativeSampling(_Body):
    max_new_tokens: MaxNewTokens | None = None
    min_new_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    stop: Stop | None = None
    stop_regex: StopRegex | None = None
    stop_token_ids: StopTokenIds | None = None
    logit_bias: LogitBias | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: ChoiceCount = 1
    seed: Seed | None = None
    # output constraints (one at most; `constraints`): SGLang's, and vLLM's aliases
    json_schema: Spec | None = None
    regex: Spec | None = None
    ebnf: Spec | None = None
    structural_tag: ObjectOrJson | None = None
    guided_json: ObjectOrJson | None = None
    guided_regex: Spec | None = None
    guided_grammar: Spec | None = None
    guided_choice: Choices | None = None
    no_stop_trim: StrictBool = False            # keep the stop string / stop token's text

    def to_params(self, default_max: int = 128, *, logprobs: bool = False, top: int = 0,
                  grammar: tuple[str, str] | None = None) -> SamplingParams:
        sent = {name: getattr(self, name) for name in SAMPLED}
        return to_sampling({**sent, "max_new_tokens": self.max_new_tokens, "min_tokens": self.min_new_tokens,
                            "include_stop": self.no_stop_trim, "logprobs": logprobs, "top_logprobs": top},
                           default_max, grammar=grammar, names=NAMES)


class GenerateRequest(_Body):
    text: StrictStr | StrBatch | None = None
    input_ids: TokenIds | IdsBatch | None = None
    sampling_params: NativeSampling | Annotated[list[NativeSampling], Field(max_length=MAX_BATCH)] = Field(default_factory=NativeSampling)
    stream: StrictBool = False
    rid: Id | IdBatch | None = None
    # SGLang's logprob fields: one value for every input, or a list with one per input
    return_logprob: StrictBool | Annotated[list[StrictBool], Field(max_length=MAX_BATCH)] = False
    top_logprobs_num: TopLogprobs | Annotated[list[TopLogprobs], Field(max_length=MAX_BATCH)] = 0
    logprob_start_len: LogprobStart | Annotated[list[LogprobStart], Field(max_length=MAX_BATCH)] = -1
    token_ids_logprob: LogprobIds | Annotated[list[LogprobIds], Field(max_length=MAX_BATCH)] | None = None
    return_text_in_logprobs: StrictBool = False
    session_params: SessionParams | None = None
    request_timeout: RequestTimeout | None = None
    priority: Priority | None = None
    # SGLang's: the LoRA adapter (a loaded adapter's name) for every input, or one per input (null: the base)
    lora_path: LoraPath | Annotated[list[LoraPath | None], Field(max_length=MAX_BATCH)] | None = None

    def items(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request is a batch (list in, list out)."""
        if (self.text is None) == (self.input_ids is None):
            raise FieldError("text", "exactly one of text or input_ids is required")
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], False
            if not self.text:
                raise FieldError("text", "text must not be an empty list")
            return list(self.text), True
        ids = self.input_ids or []
        if not ids:
            raise FieldError("input_ids", "input_ids must not be empty")
        if all(isinstance(x, int) for x in ids):
            return [list(ids)], False
        if not all(isinstance(x, list) for x in ids):
            raise FieldError("input_ids", "input_ids must be a list of ints or a list of lists of ints")
        return [list(x) for x in ids], True

    def params_for(self, i: int, n_items: int) -> NativeSampling:
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != n_items:
                raise FieldError("sampling_params", f"sampling_params has {len(sp)} entries for {n_items} inputs")
            return sp[i]
        return sp

    def rid_for(self, i: int, n_items: int, batch: bool) -> str | None:
        if self.rid is None:
            return None
        if isinstance(self.rid, str):
            if batch and n_items > 1:
                return f"{self.rid}-{i}"
            return self.rid
        if len(self.rid) != n_items:
            raise FieldError("rid", f"rid has {len(self.rid)} entries for {n_items} inputs")
        return self.rid[i]


class AbortBody(_Body):
    rid: Id | None = None
    prefix: StrictBool = False
    abort_all: StrictBool = False


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class FlushBody(_Body):
    timeout_s: Number | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class OpenSessionBody(_Body):
    session_id: Id | None = None
    capacity_of_str_len: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    timeout: Number | None = Field(default=None, gt=0, le=MAX_SESSION_TIMEOUT_S)


class CloseSessionBody(_Body):
    session_id: Id
