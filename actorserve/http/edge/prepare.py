"""The preamble every generation route runs, once: `prepare` and `Prepared`.

Chat completions, completions, SGLang's `/generate` and `/v1/responses` all begin the same
way: refuse at once when the queue is full (before the body is read: a refusal must be
cheap), read and validate the body, resolve ``model`` (the served model or a LoRA adapter,
else a 404), refuse when the server is not accepting, and open the `RequestGroup` the request's
engine requests will run in (its deadline, priority and adapter). After building its prompts
and sampling parameters a route hands them to `Prepared.check_prompts` and `Prepared.ready`:
the checks that need the model, on every input before the first is submitted, and the
request's output constraints compiled (each distinct one once), so a request is refused
whole, with ``param`` naming the field, before any of it reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Iterable, TypeVar

from aiohttp import web
from pydantic import BaseModel

from ...engine.scheduling.params import SamplingParams
from .constraints import compile_constraint
from .errors import APIError
from .generation import (
    RequestGroup, check_accepting, check_admission, check_fanout, check_prompt, check_sampling,
)
from ..native.lora_routes import is_adapter, lora_for_model
from .schemas import read_json
from .state import CTX, ServerContext

B = TypeVar("B", bound=BaseModel)


def resolve_model(ctx: ServerContext, model: str | None) -> str:
    """The name the answer gives: the served model, or the LoRA adapter named (as sent,
    `lora_routes.lora_for_model` picks the adapter); else the 404."""
    if model is None or model in ctx.model_names():
        return ctx.served_name
    if is_adapter(ctx, model):
        return model
    raise APIError(404, f"The model `{model}` does not exist; served: {ctx.served_name!r} "
                        f"(alias {ctx.model_names()[1]!r})", type="invalid_request_error",
                   code="model_not_found", param="model")


@dataclass(slots=True)
class Prepared(Generic[B]):
    """A generation request past its preamble: its body, the model name its answer gives
    (None for a route without ``model``: `/generate` picks adapters per input) and its group."""

    ctx: ServerContext
    body: B
    model: str | None
    group: RequestGroup

    def check_prompts(self, prompts: Iterable[tuple[list[int], str]]) -> None:
        """Each (prompt ids, the field it came from): not empty, ids in the vocabulary, room
        left in the context to generate."""
        for ids, param in prompts:
            check_prompt(self.ctx, ids, param)

    async def ready(self, sampling: Iterable[tuple[SamplingParams, dict[str, Any] | None, str]],
                    constraints: Iterable[tuple[tuple[str, str], str]] = (),
                    fanout: tuple[int, str] | None = None) -> None:
        """The sampling parameters' checks that need the vocabulary (each with its logit_bias
        and its field prefix), the bound on engine requests (total, field), then each distinct
        output constraint (grammar, field) compiled: the last step before submitting."""
        for sp, logit_bias, prefix in sampling:
            check_sampling(self.ctx, sp, logit_bias, prefix)
        if fanout is not None:
            check_fanout(*fanout)
        compiled: set[tuple[str, str]] = set()
        for grammar, param in constraints:
            if grammar not in compiled:
                compiled.add(grammar)
                await compile_constraint(self.ctx.runtime, grammar, param)


async def prepare(request: web.Request, schema: type[B], kind: str, *, named: bool = True) -> Prepared[B]:
    """Run the preamble of a generation route of ``kind`` (the metrics' name) whose body is
    ``schema``; ``named``: the body's ``model`` names the model or adapter it runs under."""
    ctx = request.app[CTX]
    check_admission(ctx)           # before the body is even read: a refusal must be cheap
    body = schema.model_validate(await read_json(request))
    check = getattr(body, "check", None)
    if check is not None:
        check()
    model = resolve_model(ctx, body.model) if named else None     # type: ignore[attr-defined]
    check_accepting(ctx)
    group = RequestGroup(ctx, kind, deadline_s=body.request_timeout,       # type: ignore[attr-defined]
                         priority=body.priority)                            # type: ignore[attr-defined]
    if named:      # an adapter's KV is its own (the prefix cache's salt)
        group.lora = await lora_for_model(ctx, body.model)                  # type: ignore[attr-defined]
    return Prepared(ctx, body, model, group)
