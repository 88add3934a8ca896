"""Sampling and pooling parameters: plain data, validated once at the edge.

No torch here: the HTTP layer builds these, the scheduler carries them, the runner reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ParamError(ValueError):
    """A parameter value the client sent is out of range (becomes a 400)."""


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
MAX_TOKEN_IDS_LOGPROB = 128      # vLLM's bound on logprob_token_ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # SGLang's stop_regex: patterns searched in the output text; the earliest match ends the
    # request like a stop string (the text is cut before it unless `include_stop`).
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's min_tokens / SGLang's min_new_tokens: until this many tokens are out, EOS and
    # `stop_token_ids` cannot be drawn (masked) and stop strings and patterns are not looked for.
    min_tokens: int = 0
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # Prompt logprobs (`engine.sampling.prompt_logprobs`): None = off; k >= 0 = the logprob of each prompt
    # token from `logprob_start_len` on, with the k most likely tokens at each position (0: the
    # token's own only). The first reported token has no logprob (None): nothing before it was
    # scored. The prefix cache reuses KV only for positions before `logprob_start_len`.
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    # Logprobs of these token ids at every reported position, prompt and output (SGLang's
    # token_ids_logprob; output positions only when `logprobs` is set).
    token_ids_logprob: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    # Keep a stop string (and a stop token's text) in the output: SGLang's no_stop_trim, vLLM's
    # include_stop_str_in_output. The stop itself still ends the request.
    include_stop: bool = False
    # Additive biases on the logits before sampling: ((token_id, bias), ...), bias in [-100, 100]
    # (OpenAI semantics: -100 bans a token, +100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A constraint on the output: (kind, spec) with kind in GRAMMAR_KINDS and spec its text (a
    # JSON schema, a regex, an EBNF grammar, an xgrammar structural tag as JSON). The engine
    # masks every token the grammar cannot accept next (`engine.sampling.grammar`); `json_object` takes
    # an empty spec. Plain data, so a recording holds it and re-execution rebuilds it.
    grammar: tuple[str, str] | None = None
    # A reasoning model's thinking budget (`engine.sampling.thinking`): after this many tokens inside
    # ``<think>`` the next token is forced to the end tag. ``think_ids``: (start, end) tag ids;
    # ``think_open``: the output begins inside reasoning (the prompt opened it).
    thinking_budget: int | None = None
    think_ids: tuple[int, int] | None = None
    think_open: bool = False
    # A reasoning model's constraint starts after its reasoning (`engine.sampling.thinking.GrammarGate`):
    # with ``think_open`` the grammar neither masks nor advances until the first ``</think>``
    # has been drawn; without it the first token may also be ``<think>`` (which opens reasoning
    # the same way), else the grammar applies from the first token. Needs ``think_ids``.
    grammar_after_think: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ParamError(f"max_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ParamError(f"min_tokens must be in [0, max_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            raise ParamError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ParamError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ParamError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.n < 1:
            raise ParamError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= 20:
            raise ParamError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ParamError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logprob_start_len < 0:
            raise ParamError(f"logprob_start_len must be >= 0, got {self.logprob_start_len}")
        if self.token_ids_logprob:
            ids = tuple(int(t) for t in self.token_ids_logprob)
            if len(ids) > MAX_TOKEN_IDS_LOGPROB or min(ids) < 0:
                raise ParamError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} token ids >= 0")
            object.__setattr__(self, "token_ids_logprob", ids)
        if self.logit_bias:
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
            if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
                raise ParamError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
            object.__setattr__(self, "logit_bias", bias)
        if self.grammar is not None:
            kind, spec = self.grammar
            if kind not in GRAMMAR_KINDS or not isinstance(spec, str):
                raise ParamError(f"unknown grammar kind {kind!r}; use one of {GRAMMAR_KINDS}")
            object.__setattr__(self, "grammar", (kind, spec))
        if self.think_ids is not None:
            start, end = (int(t) for t in self.think_ids)
            if min(start, end) < 0 or start == end:
                raise ParamError("think_ids are two distinct token ids >= 0 (start, end)")
            object.__setattr__(self, "think_ids", (start, end))
        if self.grammar_after_think and (self.think_ids is None or self.grammar is None):
            raise ParamError("grammar_after_think needs a grammar and the model's think tag ids "
                             "(a reasoning parser)")
        if self.thinking_budget is not None:
            if self.thinking_budget < 0:
                raise ParamError(f"the thinking budget must be >= 0, got {self.thinking_budget}")
            if self.think_ids is None:
                raise ParamError("a thinking budget needs the model's think tag ids (a reasoning parser)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


HEADS = ("vector", "last", "label_groups")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What to compute from the last hidden states of a pooling request."""

    task: str = "embed"            # embed | classify | score | rerank
    normalize: bool = True
    dimensions: int | None = None
    label_token_ids: tuple[int, ...] = field(default=())
    # What the request's pooling head makes of the pooled value (`engine.pooling.heads`), as data:
    # vector (a list of floats), last (the last value as one float), label_groups (for each group
    # of token ids, the log of their summed probability in a log-softmax row).
    head: str = "vector"
    label_groups: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify", "score", "rerank"):
            raise ParamError(f"unknown pooling task {self.task!r}")
        if self.head not in HEADS:
            raise ParamError(f"unknown pooling head {self.head!r}; use one of {HEADS}")
        object.__setattr__(self, "label_groups", tuple(tuple(int(t) for t in g) for g in self.label_groups))
        if self.head == "label_groups" and not all(self.label_groups):
            raise ParamError("the label_groups head needs non-empty groups of token ids")
        if self.dimensions is not None and self.dimensions < 1:
            raise ParamError(f"dimensions must be >= 1, got {self.dimensions}")
