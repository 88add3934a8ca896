"""Request bodies as pydantic models, and their conversion to `SamplingParams`.

OpenAI: `ChatCompletionRequest`, `CompletionRequest` (``max_tokens`` / ``max_completion_tokens``,
``stop`` str | list, ``seed``, ``n``, ``logprobs`` / ``top_logprobs``,
``stream_options.include_usage``). Native (SGLang): `GenerateRequest` (text | input_ids, single
or list = batch, ``sampling_params``, ``stream``, ``rid``), tokenize / detokenize and the
control bodies. Unknown fields are ignored (clients send vendor extras), wrong types are 400s.
Range checks live in `SamplingParams` itself (`ParamError`), so there is one source of truth.
`read_json` reads a body (within the app's size limit; bad JSON raises for a 400).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..engine.params import ParamError, SamplingParams

Number = Union[StrictInt, StrictFloat]


async def read_json(request: web.Request) -> Any:
    raw = await request.read()          # raises 413 past client_max_size
    if not raw.strip():
        raise ParamError("request body is empty; expected a JSON object")
    return json.loads(raw)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SessionParams(_Body):
    """SGLang's ``session_params``: continue a session's chain (see `actors.session`)."""
    id: StrictStr
    rid: StrictStr | None = None
    offset: StrictInt | None = Field(default=None, ge=0)
    replace: StrictBool = False
    drop_previous_output: StrictBool = False


class _OpenAICommon(_Body):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    rid: StrictStr | None = None
    skip_special_tokens: StrictBool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _base(self, max_tokens: int | None, default_max: int, logprobs: bool, top: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw: dict[str, Any] = {
            "max_new_tokens": default_max if max_tokens is None else max_tokens,
            "stop": tuple(stop), "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos, "seed": self.seed, "n": self.n,
            "logprobs": logprobs, "top_logprobs": top,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw


class ChatCompletionRequest(_OpenAICommon):
    messages: list[dict[str, Any]]
    session_params: SessionParams | None = None
    session_id: StrictStr | None = None          # shorthand for session_params {id}
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def sampling(self, default_max: int) -> SamplingParams:
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = self.top_logprobs or 0
        if top and not self.logprobs:
            raise ParamError("top_logprobs requires logprobs: true")
        return SamplingParams(**self._base(mt, default_max, self.logprobs, top))


class CompletionRequest(_OpenAICommon):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParamError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]          # one prompt of token ids
        return list(p)

    def sampling(self, default_max: int) -> SamplingParams:
        mt = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        lp = self.logprobs
        if lp is not None and not 0 <= lp <= 20:
            raise ParamError(f"logprobs must be in [0, 20], got {lp}")
        return SamplingParams(**self._base(mt, default_max, lp is not None, lp or 0))


# -- native (SGLang) ----------------------------------------------------------------------------


class NativeSampling(_Body):
    max_new_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    min_p: Number = 0.0
    repetition_penalty: Number = 1.0
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: StrictInt = 1
    seed: StrictInt | None = None

    def to_params(self, default_max: int = 128, *, logprobs: bool = False, top: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=default_max if self.max_new_tokens is None else self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, n=self.n, seed=self.seed,
            logprobs=logprobs, top_logprobs=top)


class GenerateRequest(_Body):
    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: NativeSampling | list[NativeSampling] = Field(default_factory=NativeSampling)
    stream: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0
    session_params: SessionParams | None = None

    def items(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request is a batch (list in, list out)."""
        if (self.text is None) == (self.input_ids is None):
            raise ParamError("exactly one of text or input_ids is required")
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], False
            if not self.text:
                raise ParamError("text must not be an empty list")
            return list(self.text), True
        ids = self.input_ids or []
        if not ids:
            raise ParamError("input_ids must not be empty")
        if all(isinstance(x, int) for x in ids):
            return [list(ids)], False
        if not all(isinstance(x, list) for x in ids):
            raise ParamError("input_ids must be a list of ints or a list of lists of ints")
        return [list(x) for x in ids], True

    def params_for(self, i: int, n_items: int) -> NativeSampling:
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != n_items:
                raise ParamError(f"sampling_params has {len(sp)} entries for {n_items} inputs")
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
            raise ParamError(f"rid has {len(self.rid)} entries for {n_items} inputs")
        return self.rid[i]


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    text: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt] | None = None
    input_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = False


class AbortBody(_Body):
    rid: StrictStr | None = None
    prefix: StrictBool = False
    abort_all: StrictBool = False


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class FlushBody(_Body):
    timeout_s: Number | None = Field(default=None, ge=0)


class OpenSessionBody(_Body):
    session_id: StrictStr | None = None
    capacity_of_str_len: StrictInt | None = None
    timeout: Number | None = None


class CloseSessionBody(_Body):
    session_id: StrictStr
