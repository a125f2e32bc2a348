"""``BatchJobConfig``: what ``inferd batch`` runs (no torch import, so the
CLI stays quick to start)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferd.config import EngineConfig


@dataclass
class BatchJobConfig:
    input: str
    output: str
    engine: EngineConfig
    errors: str | None = None  # None: OUT.errors.jsonl beside the output
    # Requests in the engine at once; None: twice max_num_seqs.
    max_in_flight: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not Path(self.input).is_file():
            raise ValueError(f"input: no such file {self.input!r}")
        if self.errors is None:
            self.errors = str(default_errors_path(self.output))
        paths = {Path(self.input).resolve(), Path(self.output).resolve(), Path(self.errors).resolve()}
        if len(paths) != 3:
            raise ValueError("input, output and errors must be three different files")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


def default_errors_path(output: str | Path) -> Path:
    """``OUT.jsonl`` -> ``OUT.errors.jsonl`` beside it."""
    output = Path(output)
    return output.with_name(f"{output.name.removesuffix('.jsonl')}.errors.jsonl")
