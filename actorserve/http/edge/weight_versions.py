"""Which weights made a response's tokens: ``weight_version`` and ``weight_versions``, SGLang's.

Every generated token carries the label of the weights its step ran with (the scheduler's
`step_version`); the request actor keeps them as spans (`RequestOutput.weight_versions`). The
answer says, as SGLang does:

* ``weight_versions``: ``[{"version", "start", "end"}, ...]``, half-open ranges over the
  answered output tokens, in order, one per run of tokens made by the same weights: a request
  that a retract pause put back in the queue, and that resumed after an update, has two;
* ``weight_version``: the version of the last answered token (the served version when none was
  generated).

Spans are cut to the tokens the answer holds (``max_new_tokens: 0`` answers none of the one it
sampled): a span that starts past them is left out, and an empty answer keeps one empty span
(the version that made the hidden token, else the served one), so the list is never empty.
"""

from __future__ import annotations

import json
from typing import Any, Iterable


def version_fields(spans: Iterable[tuple[str, int, int]], n_tokens: int, served: str) -> dict[str, Any]:
    """``{"weight_version", "weight_versions"}`` for an answer of `n_tokens` output tokens."""
    shown = [{"version": v, "start": a, "end": min(b, n_tokens)}
             for v, a, b in spans if a < n_tokens or a == 0]
    if not shown:
        shown = [{"version": served, "start": 0, "end": 0}]
    return {"weight_version": shown[-1]["version"], "weight_versions": shown}


def response_metadata(outs: list[Any], served: str) -> dict[str, str]:
    """An OpenAI response's ``metadata``, from its first choice as SGLang builds it, but with
    string values only, as the OpenAI API types ``metadata`` (the official client's models warn
    on anything else): ``weight_versions`` is the spans' compact JSON text."""
    if not outs:
        return {"weight_version": served}
    first = outs[0]
    fields = version_fields(first.weight_versions, first.completion_tokens, served)
    return {"weight_version": fields["weight_version"],
            "weight_versions": json.dumps(fields["weight_versions"], separators=(",", ":"))}
