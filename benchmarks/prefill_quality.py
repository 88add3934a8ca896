"""What the bf16 prefill's arithmetic costs in quality: perplexity of a prompt scored in one
prefill (prompt logprobs), fp32 against bf16 with attention in query blocks
(`engine/runners/prefill_attention.py`) and with SDPA.

The embedded SmolLM2-135M-Instruct; ``--chunks`` prompts of ``--tokens`` tokens each (default 4
of 512 and 1,024) cut from English prose (the GPL-3 text Debian ships, else this repository's
README); each prompt is one prefill through the paged runner with ``prompt_logprobs=0``, and
its perplexity is exp of the mean negative logprob of its tokens 2..n. bf16 runs as `make
serve` loads it (``--quantization auto``; prefill is dense bf16 either way). Prints one JSON
line: the perplexities and their ratios to fp32.

    .venv/bin/python benchmarks/prefill_quality.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actorserve.omp import apply_defaults  # noqa: E402

apply_defaults()

import torch  # noqa: E402

from actorserve.engine.runners import prefill_attention as pa  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402
from actorserve.engine.weights.models import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPL = Path("/usr/share/common-licenses/GPL-3")


def perplexity(engine, ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    s = Sequence("p", ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0))
    s.block_table = list(range(-(-(len(ids) + 1) // engine.kv.block_size)))
    (out,) = engine.execute([(s, len(ids))])
    engine.release(s)
    lps = out.prompt_logprobs.logprobs[1:]
    return math.exp(-sum(lps) / len(lps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,1024")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    text = (GPL if GPL.exists() else ROOT / "README.md").read_text()
    sizes = [int(n) for n in args.tokens.split(",")]
    out: dict[str, float] = {}
    for name, dtype, quant in (("fp32", torch.float32, "none"), ("bf16", torch.bfloat16, "auto")):
        model, tok, _ = load_model("default", dtype=dtype, quantization=quant)
        need = max(sizes) * args.chunks
        engine = build_engine(model, num_blocks=-(-max(sizes) // 16) + 8, block_size=16)
        ids = tok.encode(text)[:need]
        for n in sizes:
            prompts = [ids[i:i + n] for i in range(0, args.chunks * n, n)]
            modes = [("", None)] if dtype is torch.float32 else [("_blocks", pa.MIN_ROWS), ("_sdpa", 10 ** 9)]
            for suffix, min_rows in modes:
                keep = pa.MIN_ROWS
                if min_rows is not None:
                    pa.MIN_ROWS = min_rows
                out[f"{name}{suffix}_{n}"] = round(statistics.mean(perplexity(engine, q) for q in prompts), 4)
                pa.MIN_ROWS = keep
        del engine, model
    for n in sizes:
        for mode in ("blocks", "sdpa"):
            out[f"bf16_{mode}_{n}_over_fp32"] = round(out[f"bf16_{mode}_{n}"] / out[f"fp32_{n}"], 4)
    print(json.dumps({"bench": "prefill_quality", **out}) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
