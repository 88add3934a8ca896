"""The reasoning split (`http.openai.reasoning`) as pure text, and the thinking budget's counter and
mask (`engine.sampling.thinking`) on scripted token streams: every split point of the tags, in two and
three deltas and character by character, gives what the whole text gives."""

from __future__ import annotations

import itertools

import pytest
import torch

from actorserve.engine.scheduling.params import ParamError, SamplingParams
from actorserve.engine.sampling.sampling import sample
from actorserve.engine.scheduling.sequence import Sequence
from actorserve.engine.sampling.thinking import ThinkCounter, count_reasoning, over_budget
from actorserve.http.openai.reasoning import FORMATS, ReasoningSplit, get_format, prompt_opens, split_text

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]

# (format, opened, text) -> (reasoning, content), as the peers' parsers answer
CASES = [
    (QWEN3, False, "<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
    (QWEN3, False, "\n<think>a<b</think>c", ("a<b", "c")),                # blank before the tag
    (QWEN3, False, "It is 4.", (None, "It is 4.")),                      # no <think>: all content
    (QWEN3, False, "It is <think>4</think>.", (None, "It is <think>4</think>.")),   # not at the start
    (QWEN3, False, "<think>cut before the end", ("cut before the end", "")),        # truncated
    (QWEN3, False, "<thin", (None, "<thin")),                            # a tag's beginning, then EOS
    (QWEN3, True, "opened by the template</think>answer", ("opened by the template", "answer")),
    (QWEN3, True, "no end <tag> </thin", ("no end <tag> </thin", "")),
    (QWEN3, False, "<think></think>", (None, "")),
    (QWEN3, False, "<think>x</think>y</think>z<think>w", ("x", "y</think>z<think>w")),
    (R1, True, "R1 starts inside</think>The answer", ("R1 starts inside", "The answer")),
    (R1, True, "<think>0528 writes the tag</think>ok", ("0528 writes the tag", "ok")),
    (R1, True, "never closed", ("never closed", "")),
    (R1, True, "", (None, "")),
]


@pytest.mark.parametrize("fmt,opened,text,want", CASES)
def test_whole_text(fmt, opened, text, want):
    assert split_text(fmt, text, opened=opened) == want


def _stream(fmt, opened, pieces, stream_reasoning=True):
    s = ReasoningSplit(fmt, opened=opened, stream_reasoning=stream_reasoning)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    for r, c in out:       # a tag never leaks into either part, reasoning never after content
        assert "</think>" not in r
    return out


def _joined(out):
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("fmt,opened,text,want", CASES)
def test_every_split_point_streams_the_same(fmt, opened, text, want):
    reasoning, content = want
    expect = (reasoning or "", content)
    n = len(text)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        out = _stream(fmt, opened, [text[:i], text[i:j], text[j:]])
        assert _joined(out) == expect, (i, j)
        seen_content = False
        for r, c in out:
            assert not (seen_content and r), (i, j)      # reasoning only before content
            seen_content = seen_content or bool(c)
    assert _joined(_stream(fmt, opened, list(text))) == expect


def test_reasoning_streams_as_it_comes_holding_back_only_a_possible_tag():
    s = ReasoningSplit(QWEN3, opened=False)
    assert s.feed("<th") == ("", "")                  # may be <think>: wait
    assert s.feed("ink>Hmm, let") == ("Hmm, let", "")
    assert s.feed(" me </th") == (" me ", "")          # "</th" may be the end tag: held
    assert s.feed("eory") == ("</theory", "")          # it was not
    assert s.feed("</") == ("", "")
    assert s.feed("think>\n\nFour") == ("", "\n\nFour")
    assert s.feed(" <think>") == ("", " <think>")      # content now, tags and all
    assert s.finish() == ("", "")


def test_stream_reasoning_false_sends_reasoning_in_one_piece():
    text = "<think>one two three</think>answer"
    for i in range(len(text) + 1):
        out = _stream(QWEN3, False, list(text[:i]) + [text[i:]], stream_reasoning=False)
        pieces = [r for r, _ in out if r]
        assert pieces == ["one two three"], i
    cut = _stream(QWEN3, False, ["<think>never ", "closed"], stream_reasoning=False)
    assert [r for r, _ in cut if r] == ["never closed"]      # released at the end


def test_prompt_opens_and_names():
    assert prompt_opens("<|im_start|>assistant\n<think>\n", "<think>", "</think>")
    assert not prompt_opens("assistant\n<think>\n\n</think>\n\n", "<think>", "</think>")   # enable_thinking false
    assert not prompt_opens("assistant\n", "<think>", "</think>")
    assert QWEN3.opens("x<think>") and not QWEN3.opens("x") and R1.opens("x<think></think>")
    assert get_format("deepseek_r1") is R1 and get_format("qwen3-thinking") is QWEN3
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_format("gpt-oss")


# -- the thinking budget (engine) ---------------------------------------------------------------
S, E = 5, 6           # the <think> and </think> token ids of these scripts


def test_counter_counts_tokens_inside_reasoning_only():
    assert count_reasoning([S, 1, 2, 3, E, 4, 4], S, E, False) == 3
    assert count_reasoning([1, 2, E, 3], S, E, True) == 2            # opened by the prompt
    assert count_reasoning([1, 2, 3], S, E, False) == 0               # never opened
    assert count_reasoning([S, 1, E, 2, S, 3, 3], S, E, False) == 3   # a second block spends too
    c = ThinkCounter(S, E, False)
    for t in [S, 1, 2]:
        c.feed([t])
    assert (c.open, c.count, c.seen) == (True, 2, 3)


def _seq(budget, output, *, opened=False, temperature=0.0, **kw):
    sp = SamplingParams(temperature=temperature, thinking_budget=budget, think_ids=(S, E),
                        think_open=opened, **kw)
    seq = Sequence("r", [1, 2, 3], sampling=sp)
    seq.output_ids = list(output)
    return seq


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_spent_budget_forces_the_end_tag_whatever_the_logits(temperature):
    logits = torch.zeros(3, 16)
    logits[:, 9] = 50.0                       # the model wants token 9 everywhere
    seqs = [_seq(2, [S, 1, 2], temperature=temperature),      # spent: 2 inside
            _seq(2, [S, 1], temperature=temperature),          # one left
            _seq(0, [], opened=True, temperature=temperature, seed=3)]   # opened, budget 0
    picks = [t for t, _, _ in sample(logits, seqs)]
    assert picks == [E, 9, E]
    after = _seq(2, [S, 1, 2, E])             # closed: free again
    assert over_budget(after) is None and over_budget(seqs[0]) == E


def test_forcing_is_a_function_of_the_output_alone():
    seq = _seq(3, [S, 1, 2])
    assert over_budget(seq) is None
    seq.output_ids.append(7)
    assert over_budget(seq) == E
    seq.output_ids[:] = [S, 1]                # a shorter output (re-executed): counted again
    assert over_budget(seq) is None


def test_budget_parameters_are_validated():
    with pytest.raises(ParamError, match="think tag ids"):
        SamplingParams(thinking_budget=3)
    with pytest.raises(ParamError, match=">= 0"):
        SamplingParams(thinking_budget=-1, think_ids=(S, E))
    with pytest.raises(ParamError, match="distinct"):
        SamplingParams(think_ids=(S, S))
    assert SamplingParams(thinking_budget=1, think_ids=[S, E]).think_ids == (S, E)
