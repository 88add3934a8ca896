"""`engine.runners.prefill_attention`: a bf16 prompt's causal attention in query blocks computes
what transformers' eager attention computes, never reads a key past the chunk, and the paged
runner takes it for long bf16 prompts only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.runners import prefill_attention as pa

NH, NKV, D = 9, 3, 64


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Transformers' eager attention over the whole ``n x n`` at once (bf16 products, float32
    softmax rounded to bf16), GQA by repeating K/V."""
    n = q.shape[0]
    g = NH // NKV
    qh = q.transpose(0, 1)                                        # [nh, n, d]
    kh = k[:n].transpose(0, 1).repeat_interleave(g, 0)
    vh = v[:n].transpose(0, 1).repeat_interleave(g, 0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, vh).transpose(0, 1)                    # [n, nh, d]


@pytest.mark.parametrize("n", [256, 300, 517])
def test_blocks_compute_the_eager_attention_and_read_no_key_past_the_chunk(n):
    torch.manual_seed(n)
    L = -(-n // 16) * 16 + 16                                     # whole blocks and one more
    q = torch.randn(n, NH, D).bfloat16()
    k, v = torch.randn(L, NKV, D).bfloat16(), torch.randn(L, NKV, D).bfloat16()
    k[n:], v[n:] = float("nan"), float("nan")                     # padding: must never be read
    out = torch.empty(n, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q, k, v, D ** -0.5, out)
    assert not out.isnan().any()
    eager = _eager(q, k, v, D ** -0.5).float()
    exact = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[:n].float().transpose(0, 1)[None],
                                           v[:n].float().transpose(0, 1)[None], is_causal=True,
                                           scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    assert (out.float() - eager).abs().max() < 0.02                # the same steps, other sum orders
    assert (out.float() - exact).abs().max() < 0.03                # bf16 scores: close to float32
    # a row's attention is its own: the first block's rows equal a chunk of just those rows
    head = torch.empty(pa.BLOCK, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q[:pa.BLOCK], k, v, D ** -0.5, head)
    assert torch.equal(head, out[:pa.BLOCK])


@pytest.mark.parametrize("start", [0, 100])
def test_a_power_of_two_scale_folded_into_the_queries_gives_the_same_bits(monkeypatch, start):
    """d = 64: the scale 1/8 multiplies the queries before the product instead of the scores
    after it, and every output bit is the same as scaling the scores (`power_of_two`)."""
    assert pa.power_of_two(D ** -0.5) and pa.power_of_two(256 ** -0.5)
    assert not pa.power_of_two(128 ** -0.5) and not pa.power_of_two(0.3)
    torch.manual_seed(7)
    n = 300
    L = start + n + 16
    q = (torch.randn(start + n, NH, D) * 3).bfloat16()
    k, v = (torch.randn(L, NKV, D) * 3).bfloat16(), torch.randn(L, NKV, D).bfloat16()
    folded = torch.empty(n, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q[start:], k, v, D ** -0.5, folded, start)
    monkeypatch.setattr(pa, "power_of_two", lambda scale: False)
    scaled_after = torch.empty(n, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q[start:], k, v, D ** -0.5, scaled_after, start)
    assert torch.equal(folded, scaled_after)


@pytest.mark.parametrize("start,n", [(165, 300), (500, 44), (16, 128), (859, 165)])
def test_a_chunk_after_cached_context_computes_its_rows_of_the_whole_prompt(start, n):
    """A chunk that continues `start` computed tokens: its rows are rows ``start..start+n`` of
    the whole prompt's eager attention, keys past ``start + n`` are never read."""
    torch.manual_seed(start + n)
    total = start + n
    L = -(-total // 16) * 16 + 16
    q = torch.randn(total, NH, D).bfloat16()
    k, v = torch.randn(L, NKV, D).bfloat16(), torch.randn(L, NKV, D).bfloat16()
    k[total:], v[total:] = float("nan"), float("nan")
    out = torch.empty(n, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q[start:], k, v, D ** -0.5, out, start)
    assert not out.isnan().any()
    eager = _eager(q, k, v, D ** -0.5)[start:].float()
    assert (out.float() - eager).abs().max() < 0.02
    # the same rows computed in one chunk from position 0 (other block edges, same values)
    whole = torch.empty(total, NH, D, dtype=torch.bfloat16)
    pa.causal_blocked(q, k, v, D ** -0.5, whole)
    assert (out.float() - whole[start:].float()).abs().max() < 0.02


def test_it_takes_long_bf16_chunks_only():
    bf, f32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert pa.takes(bf, pa.MIN_ROWS) and not pa.takes(bf, pa.MIN_ROWS - 1)
    assert not pa.takes(f32, 4096)
    # after cached context SDPA needs a mask (its slow path): shorter chunks take the blocks too
    assert pa.takes(bf, pa.MIN_ROWS_AFTER, start=100) and not pa.takes(bf, pa.MIN_ROWS_AFTER - 1, start=100)
    assert not pa.takes(f32, 4096, start=100)


@pytest.mark.model
def test_a_long_bf16_prompt_prefills_as_with_sdpa(monkeypatch):
    """SmolLM2 in bf16, a ~400-token prompt: `causal` is taken (counted) and the
    prompt's next-token logits stay within bf16's distance of SDPA's, same greedy token."""
    from actorserve.engine.runners.runner import build_engine
    from actorserve.engine.scheduling.params import SamplingParams
    from actorserve.engine.scheduling.sequence import Sequence
    from actorserve.engine.weights.models import load_model

    model, tok, _ = load_model("default", threads=2, dtype=torch.bfloat16, quantization="none")
    engine = build_engine(model, num_blocks=64, block_size=16)
    ids = tok.encode(" ".join(f"item {i} is a {['red', 'blue', 'green'][i % 3]} box;" for i in range(70)))
    assert 300 < len(ids) < 900

    calls = []
    real = pa.causal
    monkeypatch.setattr(pa, "causal", lambda *a: calls.append(1) or real(*a))

    def prefill_logits(chunks: tuple[int, ...] = (len(ids),)) -> tuple[torch.Tensor, int]:
        """The prompt's next-token logits and token, prefilled in `chunks` (token counts)."""
        seen = []
        seq = Sequence("p", ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
        seq.block_table = list(range(-(-len(ids) // 16)))
        logits = engine._logits
        engine._logits = lambda h: seen.append(logits(h)) or seen[-1]
        try:
            for n in chunks:
                (out,) = engine.execute([(seq, n)])
                seq.num_computed += n
        finally:
            del engine._logits
        engine.release(seq)
        return seen[-1][-1].float(), out.token_id

    min_rows = pa.MIN_ROWS
    blocked, tok_blocked = prefill_logits()
    assert len(calls) == len(engine.layers)                  # every layer took the path (kernel or blocks)
    monkeypatch.setattr(pa, "MIN_ROWS", 10 ** 9)
    loaded = pa.prefill_kernel.load
    monkeypatch.setattr(pa.prefill_kernel, "load", lambda mode=None: (None, "off"))
    sdpa, tok_sdpa = prefill_logits()
    assert len(calls) == len(engine.layers)                  # ...and not with the path off
    monkeypatch.setattr(pa.prefill_kernel, "load", loaded)
    top2 = sdpa.topk(2).values
    err = float((blocked - sdpa).abs().max())
    assert err < 0.05 * float(sdpa.max() - sdpa.min()), err
    if float(top2[0] - top2[1]) > 2 * err:
        assert tok_blocked == tok_sdpa
    monkeypatch.setattr(pa, "MIN_ROWS", min_rows)

    # the same prompt in two chunks (a chunked prefill, or a prefix-cache hit): the second
    # continues the first's KV through the blocks, and ends where one chunk ends
    calls.clear()
    chunked, _ = prefill_logits((100, len(ids) - 100))
    # the second chunk's layers; the first's too where the kernel runs (it takes any length)
    kernel = pa.prefill_kernel.load()[0] is not None
    assert len(calls) == len(engine.layers) * (2 if kernel else 1)
    err = float((chunked - blocked).abs().max())
    assert err < 0.05 * float(blocked.max() - blocked.min()), err
