from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from inferd.engine.request import Request
from inferd.engine.runner import ModelRunner, RunnerOutput, kv_cache_bytes_per_block
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from inferd.models.config import ModelArchConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.sampling_params import SamplingParams

VOCAB = 128
CONFIG = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
BLOCK_SIZE = 4


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval()


def _runner(model: torch.nn.Module, dtype: torch.dtype = torch.float32, **kwargs) -> ModelRunner:
    return ModelRunner(model, CONFIG, num_blocks=16, block_size=BLOCK_SIZE, dtype=dtype, **kwargs)


def _request(rid: str, n: int, computed: int = 0) -> Request:
    req = Request(rid, [(7 * i + len(rid)) % VOCAB for i in range(n)], SamplingParams())
    req.num_computed_tokens = computed
    return req


def _mixed_step() -> tuple[SchedulerOutput, dict[str, Request]]:
    """A prefill that samples, a prefill chunk that does not, and a decode
    whose context was never computed (fine for shape checks)."""
    reqs = {"full": _request("full", 6), "part": _request("part", 9), "dec": _request("dec", 5, 4)}
    sched = SchedulerOutput(
        [
            ScheduledRequest(reqs["full"], 0, 6, [3, 8]),
            ScheduledRequest(reqs["part"], 0, 5, [0, 5, 9]),
            ScheduledRequest(reqs["dec"], 4, 1, [12, 1]),
        ]
    )
    return sched, reqs


def test_logits_only_at_sampled_rows_keyed_by_request() -> None:
    sched, reqs = _mixed_step()
    runner = _runner(_model())
    requests, logits = runner.compute_logits(sched)
    # Decodes run first inside the runner; sampling requests follow that order.
    assert [r.request_id for r in requests] == ["dec", "full"]
    assert logits.shape == (2, VOCAB)
    assert logits.dtype == torch.float32

    out = _runner(_model()).execute(sched)
    assert isinstance(out, RunnerOutput)
    assert set(out.sampled) == {"full", "dec"}
    for i, rid in enumerate(["dec", "full"]):
        assert out.sampled[rid] == [(int(logits[i].argmax()), None)]
    # The runner leaves request bookkeeping to the engine.
    assert [r.num_computed_tokens for r in reqs.values()] == [0, 0, 4]
    assert [r.num_output_tokens for r in reqs.values()] == [0, 0, 0]


def test_batch_order_does_not_change_results() -> None:
    sched, _ = _mixed_step()
    forward = _runner(_model()).execute(sched)
    backward = _runner(_model()).execute(SchedulerOutput(sched.scheduled[::-1]))
    assert forward.sampled == backward.sampled


def test_custom_sampler_gets_logits_and_requests() -> None:
    @dataclass
    class Out:
        token_ids: list[int]
        logprobs: list

    seen = []

    def sampler(logits: torch.Tensor, requests: list[Request]) -> Out:
        seen.append((logits.shape, [r.request_id for r in requests]))
        return Out([5, 6], [(-0.5, [(5, -0.5)]), None])

    sched, _ = _mixed_step()
    out = _runner(_model(), sampler=sampler).execute(sched)
    assert seen == [((2, VOCAB), ["dec", "full"])]
    assert out.sampled == {"dec": [(5, (-0.5, [(5, -0.5)]))], "full": [(6, None)]}


def test_bfloat16_runs_close_to_float32() -> None:
    reqs = [_request("a", 10), _request("b", 3)]
    sched = SchedulerOutput(
        [ScheduledRequest(reqs[0], 0, 10, [2, 6, 11]), ScheduledRequest(reqs[1], 0, 3, [4])]
    )
    _, ref = _runner(_model()).compute_logits(sched)
    runner = _runner(_model().to(torch.bfloat16), torch.bfloat16)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    _, got = runner.compute_logits(sched)
    assert got.dtype == torch.float32
    assert not torch.equal(got, ref)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_step_without_sampling_and_empty_step() -> None:
    req = _request("a", 9)
    runner = _runner(_model())
    assert runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 4, [1])])).sampled == {}
    assert runner.kv_caches[0][0][1].count_nonzero() > 0
    assert runner.execute(SchedulerOutput()).sampled == {}


def test_rejects_bad_schedules() -> None:
    runner = _runner(_model())
    req = _request("r", 6)
    with pytest.raises(ValueError, match=r"request r: block ids \[16\] are outside 0..15"):
        runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 6, [0, 16])]))
    too_few = "request r: 1 blocks cannot hold 6 tokens at block_size 4"
    with pytest.raises(ValueError, match=too_few):
        runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 6, [0])]))
    with pytest.raises(ValueError, match="request r: tokens 4..8 exceed its 6 known tokens"):
        runner.execute(SchedulerOutput([ScheduledRequest(req, 4, 4, [0, 1])]))


def test_kv_cache_bytes_per_block() -> None:
    smollm2 = ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
    # 2 (K and V) * 30 layers * 16 slots * 3 heads * 64 dims * 2 bytes.
    assert kv_cache_bytes_per_block(smollm2, 16, torch.bfloat16) == 368640
    assert kv_cache_bytes_per_block(smollm2, 16, torch.float32) == 737280
