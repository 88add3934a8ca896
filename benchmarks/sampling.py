"""The sampler alone: ms for one step's draw of ``--rows`` rows over a ``--vocab``-token
vocabulary (SmolLM2's 49,152 by default), greedy and under each sampling setting, one JSON
line. The logits are random (scaled by 3, so flat rows: top-p keeps many tokens, the slow case
for truncation); the best of ``--repeats`` runs of ``--iters`` draws.

    .venv/bin/python benchmarks/sampling.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()

import torch  # noqa: E402

from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.sampling.sampling import sample  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402

SETTINGS = {"greedy": dict(temperature=0.0), "temperature_1": dict(temperature=1.0),
            "top_p_0.9": dict(temperature=1.0, top_p=0.9), "top_k_50": dict(temperature=0.7, top_k=50),
            "min_p_0.1": dict(temperature=1.0, min_p=0.1), "seeded": dict(temperature=1.0, seed=1),
            "frequency_penalty": dict(temperature=1.0, frequency_penalty=0.5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    out: dict[str, object] = {"bench": "sampling", "rows": args.rows, "vocab": args.vocab,
                              "threads": torch.get_num_threads()}
    for name, kw in SETTINGS.items():
        seqs = [Sequence(f"s{i}", [1, 2, 3], sampling=SamplingParams(max_new_tokens=16, **kw))
                for i in range(args.rows)]
        sample(logits, seqs)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                sample(logits, seqs)
            best = min(best, (time.perf_counter() - t0) / args.iters)
        out[f"{name}_ms"] = round(best * 1e3, 2)
    out["temperature_1_over_greedy"] = round(out["temperature_1_ms"] / out["greedy_ms"], 2)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
