"""The pieces written once that several places use: the final-output merge, the context
capacity, the mapping of a body's sampling fields to `SamplingParams`."""

from __future__ import annotations

import pytest

from actorserve.engine.scheduling.base import EngineInfo, context_capacity
from actorserve.http.edge.errors import FieldError
from actorserve.http.native.native_schemas import NativeSampling
from actorserve.http.responses.responses_schemas import ResponsesRequest
from actorserve.http.edge.sampling_fields import to_sampling
from actorserve.http.edge.schemas import ChatCompletionRequest
from actorserve.messages import RequestOutput, merge_outputs


def test_merge_joins_the_deltas_and_takes_the_last_items_verdict():
    items = [RequestOutput("r", text="he", token_ids=[1], logprobs=[(1, -0.5, None, None)],
                           prompt_logprobs="P"),
             RequestOutput("r", text="llo", token_ids=[2], logprobs=[(2, -0.25, None, None)]),
             RequestOutput("r", text="!", token_ids=[3], logprobs=[(3, -1.0, None, None)], finished=True,
                           finish_reason="stop", matched_stop=3, completion_tokens=3, prompt_tokens=5,
                           timings={"decode": 0.5})]
    out = merge_outputs(items)
    assert (out.text, out.token_ids) == ("hello!", [1, 2, 3])
    assert [lp[0] for lp in out.logprobs] == [1, 2, 3]
    assert out.prompt_logprobs == "P"            # it came with the first token only
    assert (out.finished, out.finish_reason, out.matched_stop) == (True, "stop", 3)
    assert (out.completion_tokens, out.prompt_tokens, out.timings) == (3, 5, {"decode": 0.5})
    assert items[0].text == "he"                 # the items themselves are left as they were
    assert merge_outputs(items[:1]) is items[0]
    assert merge_outputs([RequestOutput("r", text="a"), RequestOutput("r", finished=True)]).logprobs is None
    with pytest.raises(ValueError):
        merge_outputs([])


def test_context_capacity_is_the_model_context_at_most_the_kv_cache():
    assert context_capacity(4096, 10, 16) == 160
    assert context_capacity(100, 10, 16) == 100
    assert context_capacity(None, 10, 16) == 160
    assert EngineInfo("m", 16, 10, 100, (0,), 50).capacity == 100


def test_every_body_maps_through_one_function_with_its_own_field_names():
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "stop": "x", "min_tokens": 2,
         "logit_bias": {"7": 5}, "temperature": 0.5})
    sp = chat.sampling(default_max=30)
    assert (sp.stop, sp.min_tokens, sp.logit_bias, sp.temperature, sp.max_new_tokens) == \
        (("x",), 2, ((7, 5.0),), 0.5, 30)
    native = NativeSampling.model_validate({"stop": ["a", "b"], "min_new_tokens": 1, "max_new_tokens": 4})
    sp = native.to_params(128)
    assert (sp.stop, sp.min_tokens, sp.max_new_tokens) == (("a", "b"), 1, 4)
    resp = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 9, "top_p": 0.5})
    sp = resp.sampling(64, None)
    assert (sp.max_new_tokens, sp.top_p, sp.temperature) == (9, 0.5, 1.0)
    # the errors name the field as each client spells it
    with pytest.raises(FieldError) as err:
        NativeSampling.model_validate({"min_new_tokens": 5, "max_new_tokens": 2}).to_params(128)
    assert err.value.param == "sampling_params.min_new_tokens"
    with pytest.raises(FieldError) as err:
        to_sampling({"stop_regex": ["ok", "a*"]}, 8)
    assert err.value.param == "stop_regex.1"
