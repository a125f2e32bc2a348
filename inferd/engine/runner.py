"""Runs one scheduled step on the model: owns the KV cache tensors.

The scheduler's ``SchedulerOutput`` names the requests, how many of each
one's tokens run this step and their block tables; the runner turns that into
flat input ids, positions and one ``AttentionMetadata``, runs the model, and
computes logits only at the last token of each chunk that samples (and at
each draft token of a speculative chunk, whose drafts it then verifies: see
``spec_decode``). Rows are reordered so single-token chunks (decodes) come
first, longest first, which lets attention batch them by length; the output
is keyed by request id, so the order never leaks. The runner never mutates
requests: the engine advances them after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from inferd.engine.request import Request
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from inferd.engine.spec_decode import DraftPosition, num_accepted
from inferd.layers.attention import SeqChunk, build_attention_metadata
from inferd.layers.cpu_kernels import kernels_available
from inferd.layers.host_memory import move_to_huge_pages, zeroed
from inferd.models.config import ModelArchConfig
from inferd.types import TopLogprobs

# (chosen token's logprob, top alternatives)
LogprobsEntry = tuple[float, TopLogprobs]


class SamplerResult(Protocol):
    token_ids: list[int]
    logprobs: list[LogprobsEntry | None]


Sampler = Callable[[Tensor, list[Request]], SamplerResult]


@dataclass
class GreedyOutput:
    token_ids: list[int]
    logprobs: list[LogprobsEntry | None]


def greedy_sample(logits: Tensor, requests: list[Request]) -> GreedyOutput:
    """Argmax per row, no logprobs: the fallback when no sampler is given."""
    token_ids = logits.argmax(dim=-1).tolist()
    return GreedyOutput(token_ids, [None] * len(token_ids))


@dataclass
class RunnerOutput:
    # request id -> its new tokens, each (token id, logprobs entry or None),
    # for requests that sampled: one token, or with draft tokens the accepted
    # drafts and the token sampled after them.
    sampled: dict[str, list[tuple[int, LogprobsEntry | None]]]

    def num_rejected(self, sched: SchedulerOutput) -> dict[str, int]:
        """Per request with drafts: how many the model did not confirm."""
        return {
            s.request.request_id: len(s.spec_token_ids) - (len(self.sampled[s.request.request_id]) - 1)
            for s in sched.scheduled
            if s.spec_token_ids and s.request.request_id in self.sampled
        }


def kv_cache_bytes_per_block(config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    per_layer = block_size * config.num_key_value_heads * config.head_dim
    return 2 * config.num_hidden_layers * per_layer * dtype.itemsize


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero-filled tensor; on CPU anonymous memory (4 KiB pages), whose
    pages read as zero and are committed only when first written, so the
    unused part of a KV budget costs no resident memory.

    Zeroed, not empty: padded decode rows read never-written slots, and
    masked-out NaN garbage would still poison the attention sum.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeroed(shape, dtype, huge_pages=False)


@dataclass
class _StepInputs:
    input_ids: Tensor  # (T,)
    positions: Tensor  # (T,)
    chunks: list[SeqChunk]
    # Rows whose logits are sampled, and their requests in the same order
    # (a draft position's row gets the request as of that position).
    sample_rows: Tensor  # (N,)
    sample_requests: list[Request | DraftPosition]
    ordered: list[ScheduledRequest]  # the step's chunks in row order


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelArchConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        sampler: Sampler | None = None,
        decode_kernel: bool | None = None,
    ) -> None:
        """``decode_kernel``: attend decode rows with the compiled CPU kernel;
        None uses it wherever it applies (CPU, float32 or bfloat16) and builds."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if torch.device(device).type == "cpu":
            # Decoding streams every weight each step: huge pages, fewer TLB misses.
            move_to_huge_pages(model)
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.sampler: Sampler = sampler if sampler is not None else greedy_sample
        applies = self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        if decode_kernel and not applies:
            raise ValueError(f"the CPU decode kernel does not run on {self.device} in {dtype}")
        self.decode_kernel = applies and decode_kernel is not False and kernels_available()
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        pool = _zeroed((config.num_hidden_layers, 2, *shape), dtype, self.device)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [(layer[0], layer[1]) for layer in pool]
        self._block_numel = block_size * config.num_key_value_heads * config.head_dim
        # Gather scratch shared by all layers; grows to the largest step seen.
        self._workspace: Tensor | None = None

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Runs one step and samples a token for each request whose chunk
        reaches the end of its known tokens."""
        inputs, logits = self._forward(sched)
        requests = inputs.sample_requests if inputs is not None else []
        if not requests:
            return RunnerOutput(sampled={})
        result = self.sampler(logits, requests)
        if len(result.token_ids) != len(requests) or len(result.logprobs) != len(requests):
            raise ValueError(
                f"sampler returned {len(result.token_ids)} tokens and "
                f"{len(result.logprobs)} logprobs for {len(requests)} requests"
            )
        sampled: dict[str, list[tuple[int, LogprobsEntry | None]]] = {}
        row = 0
        for item in inputs.ordered:
            rows = item.num_sample_rows
            if not rows:
                continue
            tokens = [int(t) for t in result.token_ids[row : row + rows]]
            keep = 1 + num_accepted(item.spec_token_ids, tokens)
            sampled[item.request.request_id] = list(zip(tokens[:keep], result.logprobs[row : row + keep]))
            row += rows
        return RunnerOutput(sampled=sampled)

    def compute_logits(self, sched: SchedulerOutput) -> tuple[list[Request], Tensor]:
        """Runs the step's forward; returns the sampling requests and their
        (N, vocab) float32 logits."""
        inputs, logits = self._forward(sched)
        return (inputs.sample_requests if inputs is not None else []), logits

    def _forward(self, sched: SchedulerOutput) -> tuple[_StepInputs | None, Tensor]:
        empty = torch.empty(0, self.config.vocab_size, device=self.device)
        if sched.is_empty:
            return None, empty
        inputs = self._prepare(sched)
        meta = build_attention_metadata(inputs.chunks, self.block_size, self.device, self.decode_kernel)
        meta.workspace = self._workspace_for(meta.gather_blocks)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            if not inputs.sample_requests:
                return inputs, empty
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        return inputs, logits

    def _workspace_for(self, gather_blocks: int) -> Tensor | None:
        needed = 2 * gather_blocks * self._block_numel
        if needed == 0:
            return None
        if self._workspace is None or self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        return self._workspace

    def _prepare(self, sched: SchedulerOutput) -> _StepInputs:
        for item in sched.scheduled:
            self._check(item)
        input_ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        sample_rows: list[int] = []
        sample_requests: list[Request | DraftPosition] = []
        ordered = self._ordered(sched)
        for item in ordered:
            request, drafts = item.request, item.spec_token_ids
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            input_ids.extend(request.all_token_ids[start : end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            chunks.append(SeqChunk(start, item.num_new_tokens, item.block_ids))
            rows = item.num_sample_rows
            sample_rows.extend(range(len(input_ids) - rows, len(input_ids)))
            if rows:
                sample_requests.append(request)
                sample_requests.extend(DraftPosition(request, drafts[: i + 1]) for i in range(len(drafts)))
        return _StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            chunks=chunks,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sample_requests=sample_requests,
            ordered=ordered,
        )

    @staticmethod
    def _ordered(sched: SchedulerOutput) -> list[ScheduledRequest]:
        """Decodes first, longest first, so attention can group rows of
        similar length; then multi-token chunks in the scheduler's order."""
        return sorted(
            sched.scheduled,
            key=lambda s: (s.num_new_tokens != 1, -s.num_computed_tokens if s.num_new_tokens == 1 else 0),
        )

    def _check(self, item: ScheduledRequest) -> None:
        rid = item.request.request_id
        if item.num_new_tokens <= len(item.spec_token_ids):
            raise ValueError(
                f"request {rid}: num_new_tokens must exceed its {len(item.spec_token_ids)} "
                f"draft tokens, got {item.num_new_tokens}"
            )
        end = item.num_computed_tokens + item.num_new_tokens
        known_end = end - len(item.spec_token_ids)
        if item.num_computed_tokens < 0 or known_end > item.request.num_tokens:
            raise ValueError(
                f"request {rid}: tokens {item.num_computed_tokens}..{known_end} exceed "
                f"its {item.request.num_tokens} known tokens"
            )
        if item.spec_token_ids and known_end != item.request.num_tokens:
            raise ValueError(f"request {rid}: draft tokens must follow its last known token")
        needed = -(-end // self.block_size)
        if len(item.block_ids) < needed:
            raise ValueError(
                f"request {rid}: {len(item.block_ids)} blocks cannot hold {end} tokens "
                f"at block_size {self.block_size}"
            )
        bad = [b for b in item.block_ids[:needed] if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {rid}: block ids {bad} are outside 0..{self.num_blocks - 1}")
