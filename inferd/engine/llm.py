"""The offline API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import fields

from tqdm import tqdm

from inferd.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.outputs import RequestOutput
from inferd.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate text for a batch of prompts at full throughput.

    ``LLM()`` loads the embedded default model; keyword arguments are the
    fields of ``EngineConfig`` (``dtype``, ``max_model_len``, ...).
    """

    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; allowed: {sorted(known - {'model'})}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Prompts are text or token-id lists. One ``SamplingParams`` applies to
        all, or pass one per prompt. All are validated before any runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
                )

        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        order = {rid: i for i, rid in enumerate(ids)}
        added = []
        try:
            for rid, prompt, params in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
            return self._run(order, use_tqdm)
        except BaseException:
            self.engine.abort_request(added)
            self.engine.step()  # drains the abort outputs
            raise

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm or len(order) < 2)
        start = time.perf_counter()
        generated = 0
        with bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if not out.finished or out.request_id not in order:
                        continue
                    results[order[out.request_id]] = out
                    generated += out.num_generated_tokens
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        missing = [rid for rid, i in order.items() if results[i] is None]
        assert not missing, f"requests never finished: {missing}"
        return results  # type: ignore[return-value]
