"""``inferd batch IN.jsonl OUT.jsonl``: a batch file through an in-process
engine at full throughput, resumable (rerun the same command after a crash
or Ctrl-C and it picks up where it stopped)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from tqdm import tqdm

from inferd.batch.journal import ResultFile
from inferd.batch.runner import BatchExecutor, Progress, plan, record_invalid, run_plan
from inferd.batch.config import BatchJobConfig


def run_batch(config: BatchJobConfig) -> int:
    with ResultFile(config.output) as out, ResultFile(config.errors) as errors:
        with open(config.input, encoding="utf-8") as f:
            left = plan(f, out, errors)
        record_invalid(left.invalid, errors)
        if left.answered:
            print(f"resuming: {left.answered} of {left.total} requests already answered", file=sys.stderr)
        if left.todo:
            try:
                progress = asyncio.run(_run(config, left.todo, out, errors, left.total, left.answered + len(left.invalid)))
            except KeyboardInterrupt:
                print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
                return 130
            elapsed = time.monotonic() - progress.started
            print(
                f"{progress.completion_tokens} output tokens in {elapsed:.1f}s after the model loaded "
                f"({progress.tokens_per_s:.1f} tok/s)",
                file=sys.stderr,
            )
        print(
            f"{left.total} requests: {len(out.entries)} answered in {config.output}, "
            f"{len(errors.entries)} errors in {config.errors}",
            file=sys.stderr,
        )
    return 0


async def _run(config: BatchJobConfig, todo: list, out: ResultFile, errors: ResultFile, total: int, initial: int) -> Progress:
    from inferd.engine.async_engine import AsyncLLMEngine
    from inferd.engine.engine import LLMEngine
    from inferd.server.serving import OpenAIServing

    engine = LLMEngine(config.engine)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    try:
        name = Path(engine.model_path).stem
        serving = OpenAIServing(async_engine, name, max_waiting_requests=1 << 30, is_draining=lambda: False)
        window = config.max_in_flight or 2 * config.engine.max_num_seqs
        bar = tqdm(total=total, initial=initial, desc="batch", unit="req", disable=not config.progress, smoothing=0.1)

        def on_result(p: Progress) -> None:
            bar.update(1)
            bar.set_postfix_str(f"{p.tokens_per_s:.1f} tok/s, {p.failed} failed", refresh=False)

        try:
            # Interactive priority: nothing else shares this engine.
            return await run_plan(BatchExecutor(serving, priority=0), todo, out, errors, window, on_result)
        finally:
            bar.close()
    finally:
        async_engine.shutdown()
