"""Running a batch file: plan what is left, feed it to the engine, record results.

The whole file goes to the continuous-batching scheduler through the same
``OpenAIServing`` the HTTP routes use, so a line's response body is what
``POST`` of its body would return, and up to ``max_in_flight`` requests are
in the engine at once (twice ``max_num_seqs`` keeps its queue fed). Results
are appended to the output file as they finish; a failed request or an
invalid line goes to the errors file. Both files are the checkpoint (see
``journal.py``): ``plan`` skips every line they already answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inferd.batch.format import BatchLine, LineError, error_line, parse_line, result_line
from inferd.batch.journal import ResultFile
from inferd.server.errors import APIError
from inferd.server.serving import OpenAIServing

BATCH_PRIORITY = 1  # below interactive requests (0) in the scheduler


@dataclass
class Plan:
    todo: list[BatchLine] = field(default_factory=list)
    invalid: list[LineError] = field(default_factory=list)  # not yet recorded
    total: int = 0  # requests in the file
    answered: int = 0  # already in the output or errors file


def plan(lines: Iterable[str], out: ResultFile, errors: ResultFile) -> Plan:
    """What is left of a batch file, given the result files so far."""
    answered_ids = {e.get("custom_id") for e in out.entries}
    answered_lines = {e.get("line") for e in errors.entries}
    result = Plan()
    seen: set[str] = set()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        result.total += 1
        parsed = parse_line(text, number)
        if isinstance(parsed, BatchLine) and parsed.custom_id in seen:
            parsed = LineError(number, parsed.custom_id, "duplicate_custom_id",
                               f"custom_id {parsed.custom_id!r} repeats an earlier line; each must be unique")
        if isinstance(parsed, BatchLine):
            seen.add(parsed.custom_id)
        if number in answered_lines or (isinstance(parsed, BatchLine) and parsed.custom_id in answered_ids):
            result.answered += 1
        elif isinstance(parsed, LineError):
            result.invalid.append(parsed)
        else:
            result.todo.append(parsed)
    return result


@dataclass
class Progress:
    done: int = 0
    failed: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(1e-9, time.monotonic() - self.started)


class BatchExecutor:
    """Answers batch lines on an ``OpenAIServing``, as its routes would."""

    def __init__(self, serving: OpenAIServing, priority: int = BATCH_PRIORITY) -> None:
        self.serving = serving
        self.priority = priority

    async def answer(self, line: BatchLine, request_id: str) -> tuple[dict, bool]:
        """The line's result entry, and whether it succeeded."""
        # Any model name is served by this engine and echoed back.
        request = line.request.model_copy(update={"model": None})
        try:
            if line.url == "/v1/chat/completions":
                body = await self.serving.create_chat_completion(request, request_id, priority=self.priority)
            else:
                body = await self.serving.create_completion(request, request_id, priority=self.priority)
        except APIError as e:
            entry = result_line(line.custom_id, e.status, request_id, e.body())
            entry["error"] = {"code": e.code or e.type, "message": e.message}
            entry["line"] = line.line
            return entry, False
        body["model"] = line.request.model or self.serving.model_name
        return result_line(line.custom_id, 200, request_id, body), True


async def run_plan(
    executor: BatchExecutor,
    todo: list[BatchLine],
    out: ResultFile,
    errors: ResultFile,
    max_in_flight: int,
    on_result: Callable[[Progress], None] = lambda p: None,
    should_stop: Callable[[], bool] = lambda: False,
    id_prefix: str = "batch",
) -> Progress:
    """Runs ``todo`` with at most ``max_in_flight`` in the engine; stops
    feeding when ``should_stop()`` (what is in flight finishes)."""
    progress = Progress()
    slots = asyncio.Semaphore(max_in_flight)

    async def one(line: BatchLine) -> None:
        try:
            entry, ok = await executor.answer(line, f"{id_prefix}-{line.line}")
            (out if ok else errors).append(entry)
            progress.done += 1
            progress.failed += not ok
            if ok:
                progress.completion_tokens += entry["response"]["body"].get("usage", {}).get("completion_tokens", 0)
            on_result(progress)
        finally:
            slots.release()

    tasks: list[asyncio.Task] = []
    try:
        for line in todo:
            await slots.acquire()
            if should_stop():
                slots.release()
                break
            tasks.append(asyncio.ensure_future(one(line)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.sync()
        errors.sync()
    return progress


def record_invalid(invalid: list[LineError], errors: ResultFile) -> None:
    for error in invalid:
        errors.append(error_line(error))
    errors.sync()
