"""A context over 4k tokens through the paged engine, against transformers' own forward.

The tiny model's config declares ``max_position_embeddings = 2048``, which `engine_info`
turns into a 2048-token ``max_model_len``. Its RoPE is the default kind, though: fixed
frequencies, and HF's rotary module computes cos/sin for any position, so 2048 is a
declared limit, not one of the weights. The fixture loads its own copy of the model and
raises the declared limit to 8192; the reference is the same HF model computing the same
positions, so what is checked is that the engine's paged KV, chunked prefill, decode and
prefix cache over 4.5k positions give transformers' own answer.
"""

from __future__ import annotations

import math

import pytest
import torch

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams

from engine_driver import RecordingGreedy

PROMPT_LEN = 4500           # > 4096
NEW = 8
BLOCK = 16
NUM_BLOCKS = 320            # 5120 slots: the prompt, its output and a second prompt's tail
CHUNK = 512                 # the scheduler's largest prefill chunk


@pytest.fixture(scope="module")
def tiny():
    from actorserve.engine.weights.models import load_model

    model, tok, _ = load_model("tiny", threads=2)
    assert model.config.max_position_embeddings == 2048
    assert getattr(model.model.rotary_emb, "rope_type", "default") == "default"
    model.config.max_position_embeddings = 8192      # this copy only; see the module docstring
    return model, tok


def long_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, 32000, (n - 1,), generator=g).tolist()   # BOS, then no special ids


TOL = 2e-6                  # on raw logits; the checks below show what it can see


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate (its own KV cache, one forward over the whole prompt):
    the tokens and the raw logits ``[n, V]`` each one was chosen from."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def hf_last_logits(model, prompt: list[int], positions: torch.Tensor | None = None) -> torch.Tensor:
    with torch.inference_mode():
        kw = {} if positions is None else {"position_ids": positions[None]}
        return model(torch.tensor([prompt]), logits_to_keep=1, **kw).logits[0, -1].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_the_tolerance_sees_a_4k_window_and_capped_positions(tiny):
    # The tiny model's logits are small (std ~0.08), so the check needs a tight tolerance;
    # this shows that TOL would see a context cut to its last 4096 tokens, or positions
    # capped at 4095, in the reference itself.
    model, _ = tiny
    prompt = long_prompt(PROMPT_LEN, 0)
    full = hf_last_logits(model, prompt)
    assert max_diff(hf_last_logits(model, prompt[-4096:]), full) > 50 * TOL
    capped = torch.arange(PROMPT_LEN).clamp(max=4095)
    assert max_diff(hf_last_logits(model, prompt, capped), full) > 5 * TOL


async def test_a_4500_token_context_equals_transformers(tiny):
    from actorserve.engine.runners.runner import build_engine

    model, tok = tiny
    rec = RecordingGreedy()               # argmax, and keeps every logits row it is given
    engine = build_engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, tokenizer=tok, model_name="tiny",
                          sampler=rec)
    assert engine.info.max_model_len == NUM_BLOCKS * BLOCK == 5120      # the KV cache is the limit now
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_prefill_chunk=CHUNK),
                                                step_in_thread=False), clock=ManualClock())
    await rt.start()
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)

    prompt = long_prompt(PROMPT_LEN, 0)
    h = rt.generate(prompt, sp)
    out = await h.stream.final()
    want, want_logits = hf_greedy(model, prompt, NEW)
    assert out.token_ids == want and out.finish_reason == "length"
    got = torch.stack(rec.logits[h.rid])
    assert got.shape == want_logits.shape and max_diff(got, want_logits) < TOL
    await rt.quiesce()
    # The prompt went in 512-token chunks (the last one yields the first token), then decodes.
    assert rt.stats().steps == math.ceil(PROMPT_LEN / CHUNK) + NEW - 1

    # A second prompt sharing the first 4400 tokens: its prefix comes from the cache, blocks
    # written 4k positions earlier, and it still gives transformers' answer.
    shared = 4400
    second = prompt[:shared] + long_prompt(60, 1)[1:]
    h2 = rt.generate(second, sp)
    out2 = await h2.stream.final()
    assert out2.cached_tokens == (shared // BLOCK) * BLOCK == 4400
    want2, want2_logits = hf_greedy(model, second, NEW)
    assert out2.token_ids == want2
    assert max_diff(torch.stack(rec.logits[h2.rid]), want2_logits) < TOL
    assert max_diff(want2_logits[0], want_logits[0]) > 50 * TOL     # a different context counts
    await rt.quiesce()
    assert rt.stats().kv_used_blocks == 0
    await rt.shutdown()
