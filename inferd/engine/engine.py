"""The engine: add requests, step, abort. One step is schedule -> run -> update."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable

import torch

from inferd.config import EngineConfig
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.draft import DraftModelProposer
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.output_processor import RequestState, check_stop, make_output
from inferd.engine.outputs import RequestOutput
from inferd.engine.request import Request, RequestStatus
from inferd.engine.runner import ModelRunner, kv_cache_bytes_per_block
from inferd.engine.sampler import Sampler
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.engine.spec_decode import AdaptiveSpeculation, NgramProposer, Proposer
from inferd.models.default import default_model_path
from inferd.models.gguf_loader import GGUFCheckpoint
from inferd.models.loader import load_checkpoint
from inferd.models.quantize import quantize_model, weights_from_file
from inferd.models.registry import build_model
from inferd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        start = time.perf_counter()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)

        path = config.model if config.model is not None else default_model_path()
        checkpoint = load_checkpoint(path)
        self.model_path = str(checkpoint.path)
        self.model_config = arch = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        model = build_model(arch, self.dtype, self.device)
        gguf = checkpoint.source if isinstance(checkpoint.source, GGUFCheckpoint) else None
        # Weights the quantizer reads from a GGUF itself are never loaded as floats.
        deferred = weights_from_file(checkpoint.weight_names(), arch.tie_word_embeddings) if gguf and config.quantization != "none" else set()
        model.load_weights(checkpoint.weights(self.dtype, skip=deferred), deferred)
        if config.quantization != "none":
            layers = quantize_model(model, config.quantization, config.quantization_group_size, gguf)
            logger.info("quantized %d layers: %s", len(layers), sorted(set(layers.values())))
        model.eval()

        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}"
            )
        per_block = kv_cache_bytes_per_block(arch, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes() // per_block)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
            ),
            self.kv_cache,
        )
        self.runner = ModelRunner(
            model,
            arch,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=self.dtype,
            device=self.device,
            sampler=Sampler(seed=config.seed),
        )
        self._proposer: Proposer | None = None
        self._speculation: AdaptiveSpeculation | None = None
        if config.speculative is not None:
            self._proposer = self._build_proposer(config)
            self._speculation = AdaptiveSpeculation()
        self._states: dict[str, RequestState] = {}
        self._child_to_state: dict[str, RequestState] = {}
        # Outputs produced outside a step (aborts), returned by the next step.
        self._pending: list[RequestOutput] = []
        # What loading left alive (modules, tensors, tokenizer tables) lives as
        # long as the engine: out of the collector's sight, a full collection
        # no longer walks it every few hundred steps.
        gc.collect()
        gc.freeze()
        self.load_time_s = time.perf_counter() - start
        logger.info(
            "loaded %s (%s, %s) in %.2fs: %d KV blocks of %d tokens",
            self.model_path, self.dtype, self.device, self.load_time_s, num_blocks, config.block_size,
        )

    def _build_proposer(self, config: EngineConfig) -> Proposer:
        method, draft_path = config.speculative_method()
        if method == "ngram":
            return NgramProposer(config.num_speculative_tokens)
        draft = load_checkpoint(str(draft_path))
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative: draft model {draft_path} has a vocabulary of {draft.config.vocab_size} "
                f"tokens, the target {self.model_config.vocab_size}; they must share a tokenizer"
            )
        model = build_model(draft.config, self.dtype, self.device)
        model.load_weights(draft.weights(self.dtype))
        model.eval()
        runner = ModelRunner(
            model,
            draft.config,
            num_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
            dtype=self.dtype,
            device=self.device,
        )
        return DraftModelProposer(runner, self.kv_cache, config.num_speculative_tokens)

    # Requests in ------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises ValueError, leaving the engine untouched,
        when the request is invalid or can never fit. A lower ``priority``
        is admitted first and preempted last (0: interactive, 1: batch)."""
        params = params or SamplingParams()
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad[0]}")
        max_tokens = self.scheduler.check_fits(len(ids), params.max_tokens)
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.child(i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, ids, child_params, self.tokenizer.eos_token_ids, arrival, priority)
            child.max_tokens = max_tokens
            children.append(child)
        state = RequestState(
            request_id=request_id,
            prompt=text,
            children=children,
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, ids, c.sampling_params) for c in children
            ],
        )
        self._states[request_id] = state
        for child in children:
            self._child_to_state[child.request_id] = state
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; their blocks are free before this returns and a
        final output with finish_reason "abort" comes with the next step."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is None:
                continue
            for child in state.children:
                if not child.is_finished:
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                self._forget(child)
            self._pending.append(make_output(state))

    def has_unfinished_requests(self) -> bool:
        return bool(self._states) or bool(self._pending)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    # One step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the engine
            logger.exception("engine step failed; failing its %d requests", len(sched.scheduled))
            return outputs + self._fail([s.request for s in sched.scheduled], e)
        self.scheduler.update_after_step(sched, result.num_rejected(sched))

        now = time.time()
        touched: dict[str, RequestState] = {}
        for s in sched.scheduled:
            req = s.request
            sampled = result.sampled.get(req.request_id)
            if sampled is None:
                continue
            if s.spec_token_ids and self._speculation is not None:
                self._speculation.observe(req.request_id, len(s.spec_token_ids), len(sampled) - 1)
            if req.first_token_time is None:
                req.first_token_time = now
            state = self._child_to_state[req.request_id]
            detok = state.detokenizers[state.children.index(req)]
            for token, logprobs in sampled:
                req.append_output_token(token)
                if logprobs is not None:
                    req.output_logprobs.append(logprobs)
                status = check_stop(req, detok, self.max_model_len)
                if status is not None:
                    # Tokens accepted after a stop are dropped, as if never drawn.
                    self.scheduler.finish_request(req, status)
                    break
            touched[state.request_id] = state
        for state in touched.values():
            outputs.append(self._emit(state))
        self._propose()
        return outputs

    def _propose(self) -> None:
        """Draft tokens for the next step of each decoding request."""
        if self._proposer is None or self._speculation is None:
            return
        running = self.scheduler.running
        if not running or len(running) > self.config.speculative_max_batch:
            return
        requests: list[Request] = []
        limits: list[int] = []
        for req in running:
            # Room for the drafts and the token after them within max_tokens
            # (which admission already fitted in the context length).
            room = (req.max_tokens or 0) - req.num_output_tokens - 1
            if room <= 0 or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if not self._speculation.should_propose(req.request_id):
                continue
            requests.append(req)
            limits.append(min(room, self.config.num_speculative_tokens))
        if not requests:
            return
        for req, drafts in zip(requests, self._proposer.propose(requests, limits), strict=True):
            req.spec_token_ids = drafts

    def _emit(self, state: RequestState) -> RequestOutput:
        out = make_output(state)
        if out.finished:
            self._states.pop(state.request_id, None)
            for child in state.children:
                self._forget(child)
        return out

    def _forget(self, child: Request) -> None:
        self._child_to_state.pop(child.request_id, None)
        if self._speculation is not None and self._proposer is not None:
            self._speculation.forget(child.request_id)
            self._proposer.forget(child.request_id)

    def _fail(self, requests: list[Request], error: Exception) -> list[RequestOutput]:
        states: dict[str, RequestState] = {}
        for req in requests:
            state = self._child_to_state[req.request_id]
            state.error = f"{type(error).__name__}: {error}"
            states[state.request_id] = state
        for state in states.values():
            for child in state.children:
                if not child.is_finished:
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
        return [self._emit(state) for state in states.values()]
