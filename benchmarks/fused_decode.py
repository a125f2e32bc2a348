"""The fused decode step against the per-op path, by batch size and weight format.

For each variant (float32; int4 with float32 activations, what ``dtype
auto`` picks on a CPU without bf16 hardware; int4 with bfloat16 activations)
one engine on the default model decodes batches of 1, 8, 16 and 32 random
64-token prompts x 24 tokens (greedy, EOS ignored) with the fused decode
layers on and off (``LlamaModel.fused_decode``), alternating, best of two
each. The per-op path is the baseline in the same process; rows above
``FUSED_MAX_ROWS`` are measured with the limit lifted, to show where it
should sit. Decode rate: output tokens after the first over first to last
token across the batch.

    python benchmarks/fused_decode.py [--out PATH]

Writes benchmarks/results/fused_decode.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "fused_decode.json"
VARIANTS = {
    "fp32": dict(dtype="float32"),
    "int4_fp32": dict(quantization="int4", dtype="float32"),
    "int4_bf16": dict(quantization="int4", dtype="bfloat16"),
}
BATCHES = (1, 8, 16, 32)
PROMPT_LEN, OUTPUT_LEN = 64, 24


def run_variant(name: str, queue) -> None:  # noqa: ANN001
    import inferd.layers.fused_decode as fd
    from inferd import LLM, SamplingParams

    llm = LLM(kv_cache_memory_gb=1.0, **VARIANTS[name])
    fd.FUSED_MAX_ROWS = max(BATCHES)  # measure past the limit too
    model = llm.engine.runner.model.model
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate([[rng.randrange(100, 49152) for _ in range(8)]], params, use_tqdm=False)  # warm-up, builds kernels
    rows = {}
    for batch in BATCHES:
        prompts = [[rng.randrange(100, 49152) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(2):
            for fused in (True, False):
                model.fused_decode = fused
                outs = llm.generate(prompts, params, use_tqdm=False)
                first = min(o.metrics.first_token_time for o in outs)
                finish = max(o.metrics.finish_time for o in outs)
                rates[fused].append(batch * (OUTPUT_LEN - 1) / (finish - first))
        rows[batch] = {"fused_tok_s": round(max(rates[True]), 1), "per_op_tok_s": round(max(rates[False]), 1)}
        rows[batch]["ratio"] = round(rows[batch]["fused_tok_s"] / rows[batch]["per_op_tok_s"], 3)
        print(f"{name} batch {batch}: fused {rows[batch]['fused_tok_s']} vs per-op {rows[batch]['per_op_tok_s']} tok/s", flush=True)
    queue.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    result: dict = {
        "benchmark": "fused_decode",
        "workload": f"default model, batches {list(BATCHES)}, {PROMPT_LEN}-token random prompts, "
        f"{OUTPUT_LEN} output tokens, greedy, EOS ignored; best of 2, fused and per-op alternating",
        "variants": {},
    }
    for name in VARIANTS:
        queue = ctx.Queue()
        proc = ctx.Process(target=run_variant, args=(name, queue))
        proc.start()
        result["variants"][name] = queue.get()
        proc.join()
    fp32, bf16 = result["variants"]["int4_fp32"], result["variants"]["int4_bf16"]
    result["int4_batch1_fp32_vs_bf16_activations"] = round(fp32[1]["fused_tok_s"] / bf16[1]["fused_tok_s"], 3)
    result["command"] = "python benchmarks/fused_decode.py " + " ".join(sys.argv[1:])
    result["machine"] = f"{platform.machine()} nproc={os.cpu_count()}"
    result["date"] = time.strftime("%Y-%m-%d")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"int4 batch 1, float32 vs bfloat16 activations: {result['int4_batch1_fp32_vs_bf16_activations']}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
