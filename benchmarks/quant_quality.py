"""What quantization costs in quality: perplexity and greedy agreement, per engine mode.

On the embedded SmolLM2-135M-Instruct: fp32 dense, bf16 dense, q4 (bf16 activations: the GGUF's
own weights, so only bf16 rounding) and q4a8 (the same weights times activations rounded to
8 bits per 32, llama.cpp's arithmetic). Perplexity of ``--tokens`` tokens of English prose
(the GPL-3 text Debian ships, else this repository's README) fed in chunks of 8 tokens through
HF's forward with its KV cache, so every linear takes the decode kernels' path (at most 8 rows)
as a decode step would; greedy agreement of ``--new`` tokens on the 8 fixed prompts of
tests/test_dtype.py with the paged runner, against fp32: the first tokens that agree, the
shared prefix and the fraction of equal positions.

    .venv/bin/python benchmarks/quant_quality.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS = [("fp32", torch.float32, "none"), ("bf16", torch.bfloat16, "none"),
           ("q4_bf16", torch.bfloat16, "q4"), ("q4a8_bf16", torch.bfloat16, "q4a8")]


def text() -> str:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    return gpl.read_text()[2000:12000] if gpl.exists() else (ROOT / "README.md").read_text()


def perplexity(model: Any, ids: list[int], chunk: int = 8) -> float:
    from transformers import DynamicCache

    cache, nll, n = DynamicCache(), 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, chunk):
            out = model(input_ids=torch.tensor([ids[i:i + chunk]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tgt = ids[i + 1:i + 1 + chunk]
            lp = torch.log_softmax(out.logits[0].float()[:len(tgt)], dim=-1)
            nll -= lp[torch.arange(len(tgt)), torch.tensor(tgt)].sum().item()
            n += len(tgt)
    return math.exp(nll / n)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    prefix = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return {"first_token_same": sum(r[0] == g[0] for r, g in zip(ref, got)), "prompts": len(ref),
            "shared_prefix": prefix, "positionwise": round(same / sum(len(r) for r in ref), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine
    from test_dtype import PROMPTS, greedy

    result: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, dtype, q in CONFIGS:
        model, tok, _ = load_model("default", dtype=dtype, quantization=q)
        ids = tok.encode(text())[:args.tokens]
        engine = build_engine(model, num_blocks=64, block_size=16)
        tokens[name] = [greedy(engine, tok.encode(pr), args.new) for pr in PROMPTS]
        result[name] = {"perplexity": round(perplexity(model, ids), 4), "tokens": len(ids)}
        print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
        del engine, model
    for name, *_ in CONFIGS[1:]:
        result[name]["perplexity_vs_fp32"] = round(result[name]["perplexity"] / result["fp32"]["perplexity"], 4)
        result[name]["greedy_vs_fp32"] = agreement(tokens["fp32"], tokens[name])
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
