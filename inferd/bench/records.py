"""The data objects that cross the bench's boundaries: a request to send, its result."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a request failed. An HTTP status becomes ``http_<status>``.
ERROR_EVENT = "error_event"  # a `data: {"error": ...}` event mid-stream
CONNECTION = "connection"  # refused, reset or dropped mid-stream
TIMEOUT = "timeout"  # no byte within the timeout
INCOMPLETE = "incomplete"  # the stream ended cleanly but without [DONE]
INVALID_EVENT = "invalid_event"  # a data line that is not JSON


@dataclass
class BenchRequest:
    # Exactly one of prompt (completions) and messages (chat).
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    # Prompt tokens as the dataset counted them; None when unknown. The
    # server's usage chunk, when it sends one, is the measured value.
    input_len: int | None = None
    ignore_eos: bool = False


@dataclass
class RequestResult:
    ok: bool = False
    error_kind: str | None = None
    error: str = ""
    start: float = 0.0  # seconds from the run's start to this request's send
    ttft: float | None = None  # s, send -> first chunk with text
    itl: list[float] = field(default_factory=list)  # s, gaps between text chunks
    e2el: float | None = None  # s, send -> [DONE]
    output_tokens: int = 0
    input_tokens: int | None = None
    # False when the server sent no usage chunk: output_tokens then counts text chunks.
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; undefined for <= 1 token."""
        if not self.ok or self.ttft is None or self.e2el is None or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str = "") -> RequestResult:
        self.ok, self.error_kind, self.error = False, kind, message
        return self
