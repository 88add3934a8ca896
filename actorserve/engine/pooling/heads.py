"""Pooling heads: what a pooling request's result is, computed from its pooled value.

A head is named by the request's `PoolingParams.head` (plain data, so it crosses the runtime
boundary and the flight recording like any parameter) and runs inside the pooling actor's
``pool`` state. No torch import: the pooled value is anything indexable with ``tolist()``.

* ``vector``        the value as a list of floats (embeddings, classifier probabilities);
* ``last``          its last element as one float (a cross-encoder's relevance score);
* ``label_groups``  over a full-vocabulary log-softmax row: for each group of token ids, the log of
                    their summed probability (score, decoder-only rerank, classify by label words).
"""

from __future__ import annotations

import math
from typing import Any

from ..scheduling.params import PoolingParams


def label_groups(row: Any, groups: tuple[tuple[int, ...], ...]) -> list[float]:
    out = []
    for ids in groups:
        vals = [float(row[i]) for i in ids]
        top = max(vals)
        out.append(top + math.log(sum(math.exp(v - top) for v in vals)))
    return out


def apply_head(params: PoolingParams, value: Any) -> Any:
    if params.head == "last":
        return float(value[-1])
    if params.head == "label_groups":
        return label_groups(value, params.label_groups)
    return value.tolist() if hasattr(value, "tolist") else value
