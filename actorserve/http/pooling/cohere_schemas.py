"""Request bodies of Cohere's v2 API (`/v2/rerank`, `/v2/embed`), as the official client sends them.

Like every body here, an unknown field is a 400 naming it. The fields are Cohere's; the few
that name something actorserve does not do (images, relevant spans, priorities) are accepted
only at the value that asks for nothing, and the handlers in `cohere_routes` say why otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .pooling_routes import MAX_INPUTS
from ..edge.schemas import INT32_MAX, _Body

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
Truncate = Literal["NONE", "START", "END"]
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Priority = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class RelevantSpans(_Body):
    """Cohere's context compression (Rerank v5): only ``mode: "disabled"`` is served."""
    mode: Literal["enabled", "disabled"]
    threshold: StrictFloat | StrictInt | None = None
    max_spans: Count | None = None


class CohereRerankRequest(_Body):
    model: StrictStr | None = None
    query: StrictStr
    documents: Annotated[list[StrictStr | dict[str, Any]], Field(max_length=MAX_INPUTS)]
    top_n: Count | None = None
    max_tokens_per_doc: Count | None = None
    # v1 fields that LiteLLM's v2 adapter still sends
    return_documents: StrictBool = False
    rank_fields: Annotated[list[StrictStr], Field(max_length=16)] | None = None
    relevant_spans: RelevantSpans | None = None
    priority: Priority | None = None


class EmbedContent(_Body):
    """One part of an `EmbedInput`: ``{"type": "text", "text": ...}`` (images are refused)."""
    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: dict[str, Any] | StrictStr | None = None


class EmbedInput(_Body):
    """One input of ``inputs``: its text parts are embedded together, as one text."""
    content: Annotated[list[EmbedContent], Field(min_length=1, max_length=MAX_INPUTS)]


class CohereEmbedRequest(_Body):
    model: StrictStr | None = None
    texts: Annotated[list[StrictStr], Field(max_length=MAX_INPUTS)] | None = None
    inputs: Annotated[list[EmbedInput], Field(max_length=MAX_INPUTS)] | None = None
    images: Annotated[list[StrictStr], Field(max_length=MAX_INPUTS)] | None = None
    input_type: InputType | None = None
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1, max_length=16)] | None = None
    truncate: Truncate | None = None
    max_tokens: Count | None = None
    output_dimension: Count | None = None
    priority: Priority | None = None
