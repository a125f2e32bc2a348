"""Accuracy retention of weight-only quantization on the default model.

Variants, each in its own child process (so peak RSS is its own):
  * fp32: no quantization, float32 (the reference);
  * bf16: no quantization, bfloat16 activations (what the quantized variants
    also run in, so their gap to fp32 splits into bf16 and quantization);
  * int8: --quantization int8 (dtype auto: bfloat16 with bf16 hardware, else float32);
  * int4: --quantization int4 (dtype auto; Q4_1 blocks loaded as is);
  * int4_head4: int4 with the LM head int4 as well (group 32; the tied
    embedding then stays a float table), to show what LM_HEAD_METHOD = int8 buys.

Measured for each:
  * perplexity on benchmarks/data/english.txt (~3,000 words of original
    prose), in windows of 512 tokens with a stride of 256: every token after
    the first is scored once, with at least 256 tokens of context after the
    first window. The model's forward runs directly on the engine's runner
    (its KV cache, the real attention metadata), logits at every position;
  * the same perplexity over the text's first DECODE_TOKENS tokens scored
    one token at a time, each a decode step of one row: the path batch-1
    decoding takes (the fused decode layers, the C kernels with the int4
    kernel's int8-rounded inputs), where the windows above run the matmul
    path of prefill chunks;
  * greedy decoding of 32 prompts (the first 12 words of 32 sentences spread
    over the text) x 64 tokens with ignore_eos, compared with fp32 position
    by position: the fraction of identical tokens, the fraction of prompts
    identical in full, and the mean length of the identical prefix;
  * peak RSS of the process through loading and the greedy run (taken
    before the perplexity pass, whose full-vocabulary logits would dominate
    it), and the bytes of the model's parameters and buffers (the weights it
    holds; the KV cache is not counted).

    python benchmarks/accuracy.py [--quick]

Writes benchmarks/results/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import re
import resource
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "accuracy.json"
TEXT = Path(__file__).parent / "data" / "english.txt"
WINDOW, STRIDE = 512, 256
DECODE_TOKENS = 512
NUM_PROMPTS, PROMPT_WORDS, MAX_TOKENS = 32, 12, 64
VARIANTS = {
    "fp32": dict(quantization="none", dtype="float32"),
    "bf16": dict(quantization="none", dtype="bfloat16"),
    "int8": dict(quantization="int8", dtype="auto"),
    "int4": dict(quantization="int4", dtype="auto"),
    "int4_head4": dict(quantization="int4", dtype="auto", lm_head_method="int4"),
}


def make_prompts(text: str, n: int) -> list[str]:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) > PROMPT_WORDS + 4]
    step = len(sentences) / n
    return [" ".join(sentences[int(i * step)].split()[:PROMPT_WORDS]) for i in range(n)]


def perplexity(llm, token_ids: list[int]) -> tuple[float, int]:  # noqa: ANN001
    """exp(mean NLL) over every token after the first, in strided windows."""
    import torch

    from inferd.layers.attention import SeqChunk, build_attention_metadata

    runner = llm.engine.runner
    blocks = list(range(-(-WINDOW // runner.block_size)))
    nll, scored, start = 0.0, 0, 0
    with torch.inference_mode():
        while True:
            window = token_ids[start : start + WINDOW]
            # Score targets not scored by the previous window.
            first = 1 if start == 0 else WINDOW - STRIDE
            if len(window) <= first:
                break
            meta = build_attention_metadata([SeqChunk(0, len(window), blocks)], runner.block_size, runner.device)
            ids = torch.tensor(window, device=runner.device)
            hidden = runner.model(ids, torch.arange(len(window), device=runner.device), runner.kv_caches, meta)
            logprobs = torch.log_softmax(runner.model.compute_logits(hidden[first - 1 : -1]), dim=-1)
            targets = ids[first:]
            nll -= logprobs.gather(1, targets[:, None]).sum().item()
            scored += len(targets)
            if start + WINDOW >= len(token_ids):
                break
            start += STRIDE
    return math.exp(nll / scored), scored


def decode_perplexity(llm, token_ids: list[int]) -> float:  # noqa: ANN001
    """exp(mean NLL) of tokens 1.. of ``token_ids``, each predicted by a
    one-row decode step over the cache of the tokens before it."""
    import torch

    from inferd.layers.attention import SeqChunk, build_attention_metadata

    runner = llm.engine.runner
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    nll = 0.0
    with torch.inference_mode():
        for pos in range(len(token_ids) - 1):
            meta = build_attention_metadata(
                [SeqChunk(pos, 1, blocks)], runner.block_size, runner.device, runner.decode_kernel
            )
            ids = torch.tensor(token_ids[pos : pos + 1], device=runner.device)
            hidden = runner.model(ids, torch.tensor([pos], device=runner.device), runner.kv_caches, meta)
            logprobs = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            nll -= logprobs[0, token_ids[pos + 1]].item()
    return math.exp(nll / (len(token_ids) - 1))


def weight_bytes(model) -> int:  # noqa: ANN001
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variant(name: str, quick: bool, queue) -> None:  # noqa: ANN001
    from inferd import LLM, SamplingParams
    from inferd.models.default import default_model_path
    from inferd.models.loader import load_checkpoint
    from inferd.models.quantize import quantize_model

    spec = dict(VARIANTS[name])
    head = spec.pop("lm_head_method", None)
    start = time.perf_counter()
    if head is None:
        llm = LLM(**spec, kv_cache_memory_gb=0.5)
    else:
        # The engine has no switch for the head: quantize a bf16 engine's model in place.
        llm = LLM(dtype="bfloat16", kv_cache_memory_gb=0.5)
        source = load_checkpoint(default_model_path()).source
        quantize_model(llm.engine.runner.model, spec["quantization"], 32, source, lm_head_method=head)
    load_s = time.perf_counter() - start
    text = TEXT.read_text()
    prompts = make_prompts(text, 4 if quick else NUM_PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=16 if quick else MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Peak RSS of loading and serving 32 streams, before the perplexity pass
    # adds its own (512 x 49152 float32 logits and their log-softmax).
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # After generation: the pass writes blocks 0..31 of the KV cache behind
    # the engine's back, so nothing may run on the engine afterwards.
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    if quick:
        ids = ids[: WINDOW + STRIDE]
    ppl, scored = perplexity(llm, ids)
    decode_ppl = decode_perplexity(llm, ids[: 64 if quick else DECODE_TOKENS])
    queue.put(
        {
            "ppl": ppl,
            "decode_ppl": decode_ppl,
            "scored_tokens": scored,
            "text_tokens": len(ids),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "peak_rss_mb": round(peak_rss_mb, 1),
            "weight_bytes": weight_bytes(llm.engine.runner.model),
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "load_s": round(load_s, 2),
        }
    )


def in_child(name: str, quick: bool) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_variant, args=(name, quick, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, float]:
    same = total = identical = prefix = 0
    for ref, ours in zip(reference, tokens, strict=True):
        same += sum(a == b for a, b in zip(ref, ours))
        total += len(ref)
        identical += ref == ours
        n = 0
        while n < min(len(ref), len(ours)) and ref[n] == ours[n]:
            n += 1
        prefix += n
    return {
        "token_agreement": round(same / total, 4),
        "prompts_identical": round(identical / len(reference), 4),
        "mean_identical_prefix": round(prefix / len(reference), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one window and 4 short prompts, to check the script runs")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    runs = {}
    for name in VARIANTS:
        runs[name] = in_child(name, a.quick)
        print(f"{name:10s} ppl {runs[name]['ppl']:.4f}  peak RSS {runs[name]['peak_rss_mb']:.0f} MB  "
              f"weights {runs[name]['weight_bytes'] / 1e6:.0f} MB  ({runs[name]['dtype']}, load {runs[name]['load_s']}s)", flush=True)  # fmt: skip
    reference = runs["fp32"]
    result: dict = {
        "benchmark": "accuracy",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, Q8_0 embedding)",
        "text": f"{TEXT.relative_to(Path(__file__).parent.parent)}: {len(TEXT.read_text().split())} words, "
                f"{reference['text_tokens']} tokens, {reference['scored_tokens']} scored, window {WINDOW} stride {STRIDE}",  # fmt: skip
        "decode": f"the first {DECODE_TOKENS} tokens scored one decode step (one row) at a time",
        "greedy": f"{NUM_PROMPTS} prompts x {MAX_TOKENS} tokens, temperature 0, ignore_eos",
    }
    for name, run in runs.items():
        result[f"{name}_ppl"] = round(run["ppl"], 4)
        result[f"{name}_decode_ppl"] = round(run["decode_ppl"], 4)
        if name != "fp32":
            result[f"{name}_ppl_ratio"] = round(run["ppl"] / reference["ppl"], 4)
            result[f"{name}_decode_ppl_ratio"] = round(run["decode_ppl"] / reference["decode_ppl"], 4)
            for key, value in agreement(reference["tokens"], run["tokens"]).items():
                result[f"{name}_{key}"] = value
    result["variants"] = {
        name: {k: run[k] for k in ("dtype", "peak_rss_mb", "weight_bytes", "load_s")} for name, run in runs.items()
    }
    result["targets"] = {
        "int8_ppl_ratio_max": 1.01,
        "int4_ppl_ratio_max": 1.05,
        "int8_met": max(result["int8_ppl_ratio"], result["int8_decode_ppl_ratio"]) <= 1.01,
        "int4_met": max(result["int4_ppl_ratio"], result["int4_decode_ppl_ratio"]) <= 1.05,
    }
    result["command"] = "python benchmarks/accuracy.py " + " ".join(sys.argv[1:])
    result["machine"] = f"{platform.machine()} nproc={__import__('os').cpu_count()}"
    result["date"] = time.strftime("%Y-%m-%d")
    for name in VARIANTS:
        if name != "fp32":
            print(f"{name:10s} ppl ratio {result[f'{name}_ppl_ratio']:.4f} (decode {result[f'{name}_decode_ppl_ratio']:.4f}), tokens agreeing "
                  f"{result[f'{name}_token_agreement']:.1%}, prompts identical {result[f'{name}_prompts_identical']:.1%}")  # fmt: skip
    if not a.quick:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
