"""The Batch API's job runner: one batch at a time, in the server's process.

Jobs run oldest first through ``run_plan`` on the server's ``OpenAIServing``
at batch priority, at most ``max_in_flight`` lines in the engine, so
interactive requests are admitted first and find seats. The result files are
the checkpoint: a job cut by a restart (or a 503 from the engine: draining,
overloaded, dead) is planned again from its input and result files, which
skips every answered line, so each ``custom_id`` is answered exactly once.
Of the servers sharing a data dir, the one holding ``worker.lock`` runs jobs.

States: validating -> in_progress -> finalizing -> completed; failed when no
line of the input can run; cancelling -> cancelled; expired when
``expires_at`` passes first (the lines not run become ``batch_expired`` errors).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from dataclasses import dataclass

from inferd.batch.format import BatchLine, LineError, error_line
from inferd.batch.journal import ResultFile
from inferd.batch.runner import BatchExecutor, Plan, Progress, plan, record_invalid, run_plan
from inferd.batch.store import BatchRecord, BatchStore
from inferd.server.serving import OpenAIServing

logger = logging.getLogger("inferd.batch")

COUNTS_INTERVAL_S = 0.5  # request_counts reach SQLite at most this often while a job runs
RETRY_S = 1.0  # after an interruption that was not the job's fault
POLL_S = 1.0  # how soon a batch created by another server on the same data dir is seen
WATCH_S = 0.5  # how soon a cancel made by another server on the same data dir is seen
LOCK_RETRY_S = 5.0
MAX_LISTED_ERRORS = 20  # line errors named in a failed batch's `errors`


class _Interrupted(Exception):
    """The engine could not take a line (503 or dead): run it again later."""


class _Executor(BatchExecutor):
    """Notes which lines started, and turns an answer that says the server,
    not the line, failed into an interruption instead of an error line."""

    def __init__(self, serving: OpenAIServing) -> None:
        super().__init__(serving)
        self.started: set[int] = set()
        self.interrupted = False

    async def answer(self, line: BatchLine, request_id: str) -> tuple[dict, bool]:
        self.started.add(line.line)
        entry, ok = await super().answer(line, request_id)
        if not ok and (entry["response"]["status_code"] == 503 or not self.serving.engine.is_running):
            self.interrupted = True
            raise _Interrupted(entry["error"]["message"])
        return entry, ok


@dataclass
class _Job:
    batch: BatchRecord
    out: ResultFile
    errors: ResultFile
    left: Plan

    def save_counts(self, store: BatchStore) -> None:
        # The result files' lines are the counts, so they never drift from the files.
        store.set_counts(self.batch.id, self.left.total, len(self.out.entries), len(self.errors.entries))


class BatchWorker:
    def __init__(self, store: BatchStore, serving: OpenAIServing, max_in_flight: int) -> None:
        self.store = store
        self.serving = serving
        self.max_in_flight = max_in_flight
        self.current: str | None = None  # the batch running now
        self._cancel: set[str] = set()
        self._stopping = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock_fd = -1

    @property
    def runs_jobs(self) -> bool:
        """Whether this server runs the data dir's jobs (one server at a time does)."""
        return self._lock_fd >= 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="inferd-batch")

    async def stop(self) -> None:
        """Stops at once; lines in flight are aborted and run again after a restart."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1

    def wake(self) -> None:
        self._wake.set()

    def sweep(self) -> None:
        """Ends the batches cancelled while queued, and flags the running one
        to stop feeding; only on the server that runs the jobs."""
        if not self.runs_jobs:
            return
        for batch in self.store.with_status("cancelling"):
            if batch.id == self.current:
                self._cancel.add(batch.id)
            else:
                self.store.finish(batch.id, "cancelled")

    def _try_lock(self) -> bool:
        """Two servers on one data dir would run each job twice: an exclusive
        lock (released by the OS however the process ends) picks one."""
        fd = os.open(self.store.root / "worker.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            self.sweep()

    async def _loop(self) -> None:
        logged = False
        while not self._try_lock():
            if not logged:
                logger.info("another server runs the batch jobs in %s; this one waits to take over", self.store.root)
                logged = True
            await asyncio.sleep(LOCK_RETRY_S)
        watcher = asyncio.get_running_loop().create_task(self._watch())
        try:
            await self._jobs()
        finally:
            watcher.cancel()

    async def _jobs(self) -> None:
        # A draining server takes no new work: what is left resumes after the restart.
        while not self._stopping and not self.serving.is_draining():
            self.sweep()
            batch = self.store.next_active()
            if batch is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass
                continue
            self.current = batch.id
            try:
                await self._run(batch)
            except _Interrupted as e:
                logger.warning("batch %s interrupted (%s): resuming in %.0fs", batch.id, e, RETRY_S)
                await asyncio.sleep(RETRY_S)
            except Exception:  # noqa: BLE001 - a bug must not stop the other jobs
                logger.exception("batch %s failed", batch.id)
                try:
                    self._give_up(batch.id)
                except Exception:  # noqa: BLE001 - e.g. the database is unwritable: try again later
                    logger.exception("batch %s could not be marked failed", batch.id)
                    await asyncio.sleep(RETRY_S)
            finally:
                self.current = None
                self._cancel.discard(batch.id)

    def _give_up(self, batch_id: str) -> None:
        """Ends a batch that hit a bug, keeping its result files on disk."""
        status = self.store.get_batch(batch_id).status
        if status == "cancelling":
            self.store.finish(batch_id, "cancelled")
        elif status in ("validating", "in_progress", "finalizing"):
            error = {"code": "internal_error", "message": "the batch failed in the server; see the server's log"}
            self.store.set_status(batch_id, "failed", [error])

    async def _run(self, batch: BatchRecord) -> None:
        try:
            job = await asyncio.to_thread(self._prepare, batch)
        except (OSError, ValueError) as e:  # the input is gone or unreadable
            error = {"code": "invalid_file", "message": f"input file {batch.input_file_id}: {e}"}
            self.store.set_status(batch.id, "failed", [error])
            return
        if job is None:
            return
        try:
            await self._execute(job)
        finally:
            job.out.close()
            job.errors.close()
        status = self.store.get_batch(batch.id).status
        if status == "cancelling":
            self.store.finish(batch.id, "cancelled")
        elif job.left.todo and (self._stopping or self.serving.is_draining()):
            return  # still in_progress: resumed after the restart
        elif job.left.todo:  # nothing else stops a job early
            await asyncio.to_thread(self._expire, job)
        else:
            if status != "finalizing":
                self.store.set_status(batch.id, "finalizing")
            self.store.finish(batch.id, "completed")
        logger.info("batch %s ended %s", batch.id, self.store.get_batch(batch.id).status)

    def _prepare(self, batch: BatchRecord) -> _Job | None:
        """Plans what is left of ``batch`` (in a thread: it parses the whole file)."""
        record = self.store.get_file(batch.input_file_id)
        if record is None:
            raise OSError("the file was deleted")
        out_path, err_path = self.store.result_paths(batch.id)
        out, errors = ResultFile(out_path), ResultFile(err_path)
        with open(self.store.content_path(record), encoding="utf-8") as f:
            left = plan(f, out, errors)
        runnable = []
        for line in left.todo:
            if line.url == batch.endpoint:
                runnable.append(line)
            else:
                message = f"url {line.url} does not match the batch endpoint {batch.endpoint}"
                left.invalid.append(LineError(line.line, line.custom_id, "mismatched_url", message))
        left.todo = runnable
        left.invalid.sort(key=lambda e: e.line)
        if not runnable and not left.answered:  # nothing in the file can run
            out.close()
            errors.close()
            self.store.remove_results(batch.id)
            listed = [{"code": e.code, "message": e.message, "line": e.line} for e in left.invalid[:MAX_LISTED_ERRORS]]
            empty = {"code": "empty_file", "message": "the input file holds no requests"}
            self.store.set_status(batch.id, "failed", listed or [empty])
            return None
        record_invalid(left.invalid, errors)
        if left.answered:
            logger.info("batch %s: resuming, %d of %d lines already answered", batch.id, left.answered, left.total)
        job = _Job(batch, out, errors, left)
        job.save_counts(self.store)
        self.store.mark_in_progress(batch.id)
        return job

    async def _execute(self, job: _Job) -> None:
        batch = job.batch
        executor = _Executor(self.serving)
        counted = time.monotonic()

        def on_result(_: Progress) -> None:
            nonlocal counted
            if time.monotonic() - counted >= COUNTS_INTERVAL_S:
                counted = time.monotonic()
                job.save_counts(self.store)

        def should_stop() -> bool:
            return (self._stopping or executor.interrupted or batch.id in self._cancel
                    or self.serving.is_draining() or self.store.now() >= batch.expires_at)  # fmt: skip

        try:
            await run_plan(executor, job.left.todo, job.out, job.errors, self.max_in_flight,
                           on_result, should_stop, id_prefix=batch.id)  # fmt: skip
        finally:
            job.left.todo = [line for line in job.left.todo if line.line not in executor.started]
            job.save_counts(self.store)

    def _expire(self, job: _Job) -> None:
        """Records every line not started as ``batch_expired``, then ends the batch."""
        with ResultFile(job.errors.path) as job.errors:
            for line in job.left.todo:
                message = "the request could not be executed before the completion window expired"
                job.errors.append(error_line(LineError(line.line, line.custom_id, "batch_expired", message)))
        job.save_counts(self.store)
        self.store.finish(job.batch.id, "expired")
