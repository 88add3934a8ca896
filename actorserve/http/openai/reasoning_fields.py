"""The request fields of reasoning models (`reasoning_plan` reads them), as mixins of the
request bodies: the thinking budget under its three names (chat and Responses), and chat's
split switches and chat-template variables."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

INT32_MAX = 2**31 - 1
ThinkingBudget = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]        # tokens inside <think>
TemplateKwargs = Annotated[dict[StrictStr, Any], Field(max_length=64)]   # extra chat-template variables


class ThinkingBudgetFields(BaseModel):
    max_thinking_tokens: ThinkingBudget | None = None      # ours
    thinking_token_budget: ThinkingBudget | None = None    # vLLM's
    thinking_budget: ThinkingBudget | None = None          # SGLang's custom_params key, Qwen's API


class ChatReasoningFields(ThinkingBudgetFields):
    chat_template_kwargs: TemplateKwargs | None = None     # e.g. Qwen3's enable_thinking
    separate_reasoning: StrictBool = True                  # SGLang's: split reasoning_content off
    stream_reasoning: StrictBool = True                    # SGLang's: stream it as it comes
