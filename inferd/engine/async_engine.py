"""An asyncio facade over ``LLMEngine``, whose steps run on their own thread.

The engine is single-threaded: only the step thread touches it. Callers on
the event loop send it commands (add, abort) through a queue; the thread
applies them between steps, steps while anything is unfinished, and hands
each step's outputs back to the loop in one ``call_soon_threadsafe``. A
thread rather than a process: the forward pass releases the GIL in torch's
kernels, so HTTP and SSE work fits in the gaps, and outputs cross no pipe
(``benchmarks/serving_overhead.py`` measures what this costs).

    engine = AsyncLLMEngine(LLMEngine(config))
    engine.start()
    async for out in engine.generate("req-1", "Hello", SamplingParams()):
        print(out.outputs[0].text_delta, end="")
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from inferd.engine.engine import LLMEngine
from inferd.engine.outputs import RequestOutput
from inferd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutting down)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    done: Future  # resolves to None, or raises the engine's ValueError
    priority: int = 0


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """One request's outputs on the event loop."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False


class RequestStream:
    """One request's outputs, as an async iterator. ``aclose`` aborts the
    request unless it has finished, whether or not iteration ever began (an
    async generator's ``finally`` would not run if it had not)."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            await self.aclose()
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._stream.finished:  # closed early: free its blocks now
            self._engine.abort(self.request_id)
        self._engine._streams.pop(self.request_id, None)


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.5,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        """``on_step`` sees every step's outputs on the step thread (metrics);
        an exception in it is logged, never fatal."""
        self.engine = engine
        self._on_step = on_step
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Each written by one thread only; their difference is the adds in transit.
        self._adds_sent = 0
        self._adds_applied = 0
        self.dead_error: BaseException | None = None

    # Life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Starts the step thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the scheduler's queue or on their way to it."""
        return len(self.engine.scheduler.waiting) + self._adds_sent - self._adds_applied

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # Requests ---------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Queues a request; returns its output stream once the engine has
        accepted it. Raises the engine's ``ValueError`` for a bad request and
        ``EngineDeadError`` when the loop has stopped."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream()
        self._streams[request_id] = stream
        done: Future = Future()
        self._adds_sent += 1
        self._inbox.put(_Add(request_id, prompt, params, time.time(), done, priority))
        if self.dead_error is not None and not done.done():  # died as we sent it
            done.set_exception(self._dead())
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            self._streams.pop(request_id, None)
            if not done.done():  # cancelled while waiting: the add may still land
                self._inbox.put(_Abort(request_id))
            raise
        return RequestStream(self, request_id, stream)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its outputs in one call."""
        outputs = await self.add_request(request_id, prompt, params)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        """Stops a request; its KV blocks are free before the next step runs."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.finished = True
        self._inbox.put(_Abort(request_id))

    def abort_all(self, error: BaseException) -> None:
        """Ends every open stream with ``error`` and aborts its request."""
        for request_id, stream in list(self._streams.items()):
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(error)
                self._inbox.put(_Abort(request_id))

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"engine loop died: {self.dead_error!r}")

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self._dead()
        if not self.is_running:
            raise EngineDeadError("engine is not running")

    # The step thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._observe(outputs)  # first, so a client that got its answer sees it counted
                    if outputs:
                        self._to_loop(self._dispatch, outputs)
        except BaseException as e:  # noqa: BLE001 - report, then every stream fails
            logger.exception("engine loop died")
            self.dead_error = e
            error = self._dead()
            self._fail_pending_adds(error)
            self._to_loop(self.abort_all, error)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(outputs)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            logger.exception("step observer failed")

    def _fail_pending_adds(self, error: EngineDeadError) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and not cmd.done.done():
                cmd.done.set_exception(error)

    def _apply_commands(self, block: bool) -> None:
        timeout = self._idle_wait_s if block else None
        while True:
            try:
                cmd = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False  # after the first command, drain without waiting
            if cmd is None:
                return
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.priority)
            except Exception as e:  # noqa: BLE001 - a bad request goes back to its caller
                cmd.done.set_exception(e)
            else:
                cmd.done.set_result(None)
            finally:
                self._adds_applied += 1

    def _to_loop(self, fn, *args) -> None:  # noqa: ANN001
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue
            if out.finished:
                stream.finished = True
            stream.queue.put_nowait(out)
