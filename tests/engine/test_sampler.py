import math

import pytest
import torch

from inferd.engine.request import Request
from inferd.engine.sampler import Sampler, SamplerOutput, seeded_uniform
from inferd.sampling_params import SamplingParams


def make_request(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    **params,
) -> Request:
    req = Request("r", prompt if prompt is not None else [0], SamplingParams(**params), eos)
    for token in output or []:
        req.append_output_token(token)
    return req


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_also_for_bf16():
    logits = random_logits(8, 300)
    requests = [make_request(temperature=0.0) for _ in range(8)]
    out = Sampler()(logits, requests)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    half = logits.bfloat16()
    assert Sampler()(half, requests).token_ids == half.float().argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = random_logits(6, 200)
    requests = [make_request(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    tokens = Sampler()(logits, requests).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.01),
    ],
)
def test_seeded_row_ignores_batch_and_order(params):
    vocab = 500
    logits = random_logits(4, vocab, seed=1) / 3  # flat enough that draws vary
    target = logits[0:1]
    others = [
        make_request(temperature=0.9),
        make_request(temperature=0.0),
        make_request(temperature=1.0, top_k=3, seed=99),
    ]
    alone, batched, shuffled = [], [], []
    for position in range(12):
        req = make_request(output=[7] * position, seed=1234, **params)
        alone += Sampler(seed=5)(target, [req]).token_ids
        batch = torch.cat([target, logits[1:]])
        batched.append(Sampler(seed=6)(batch, [req, *others]).token_ids[0])
        batch = torch.cat([logits[1:3], target, logits[3:]])
        shuffled.append(Sampler(seed=7)(batch, [others[0], others[1], req, others[2]]).token_ids[2])
    assert alone == batched == shuffled
    # The draws depend on the output position.
    assert len(set(alone)) > 3


def test_seeded_token_depends_on_position_not_on_token_values():
    # A recomputed request after preemption sees the same position again.
    logits = torch.zeros(1, 1000)
    first = make_request(output=[1, 2, 3], seed=42)
    again = make_request(output=[9, 9, 9], seed=42)
    assert Sampler(0)(logits, [first]).token_ids == Sampler(1)(logits, [again]).token_ids
    later = make_request(output=[1, 2, 3, 4], seed=42)
    assert Sampler(0)(logits, [later]).token_ids != Sampler(0)(logits, [first]).token_ids
    other_seed = make_request(output=[1, 2, 3], seed=43)
    assert Sampler(0)(logits, [other_seed]).token_ids != Sampler(0)(logits, [first]).token_ids


def test_seeded_uniform_is_a_fixed_function_in_range():
    values = [seeded_uniform(seed, pos) for seed in (-3, 0, 7, 2**70) for pos in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert values == [seeded_uniform(seed, pos) for seed in (-3, 0, 7, 2**70) for pos in range(50)]
    assert len(set(values)) == len(values)


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(16, 1000)
    requests = [make_request(temperature=1.0) for _ in range(16)]
    assert Sampler(3)(logits, requests).token_ids == Sampler(3)(logits, requests).token_ids
    assert Sampler(3)(logits, requests).token_ids != Sampler(4)(logits, requests).token_ids


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(10, 400, seed=2)
    argmax = logits.argmax(dim=-1).tolist()
    top_k = [make_request(temperature=1.5, top_k=1, seed=i) for i in range(10)]
    top_p = [make_request(temperature=1.5, top_p=1e-6) for _ in range(10)]
    assert Sampler()(logits, top_k).token_ids == argmax
    assert Sampler()(logits, top_p).token_ids == argmax


def draws(probs: list[float], rows: int, **params) -> list[int]:
    logits = torch.tensor(probs).log().expand(rows, -1).contiguous()
    return Sampler(0)(logits, [make_request(**params) for _ in range(rows)]).token_ids


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_min_p_top_k_top_p_keep_the_expected_tokens():
    # min_p 0.2 keeps p >= 0.1.
    assert set(draws(PROBS, 400, min_p=0.2)) == {0, 1, 2}
    assert set(draws(PROBS, 400, top_k=2)) == {0, 1}
    # Smallest set reaching top_p: 0.5 + 0.3 >= 0.75, 0.5 + 0.3 + 0.15 >= 0.85.
    assert set(draws(PROBS, 400, top_p=0.75)) == {0, 1}
    assert set(draws(PROBS, 400, top_p=0.85)) == {0, 1, 2}
    assert set(draws(PROBS, 400, top_k=3, top_p=0.6)) == {0, 1}
    assert set(draws(PROBS, 400)) == {0, 1, 2, 3}


def test_top_p_nucleus_wider_than_the_first_candidates():
    # Slowly decaying logits: the 0.9 nucleus holds ~2600 of 3000 likely
    # tokens, beyond the candidates looked at first.
    vocab = 5000
    logits = torch.full((1, vocab), -40.0)
    logits[0, :3000] = -torch.arange(3000) * 1e-4
    probs = logits[0].double().softmax(dim=-1)
    nucleus = int((probs.cumsum(dim=0) < 0.9).sum()) + 1
    batch = logits.expand(64, -1).contiguous()
    requests = [make_request(top_p=0.9) for _ in range(63)] + [make_request(top_k=10)]
    tokens = Sampler(0)(batch, requests).token_ids
    assert max(tokens[:63]) > 2048
    assert all(t < nucleus for t in tokens[:63])
    assert tokens[63] < 10


def test_sampling_frequencies_match_the_distribution():
    for temperature, expected in ((1.0, 0.7), (0.5, 0.49 / 0.58)):
        tokens = draws([0.7, 0.3], 2000, temperature=temperature)
        assert abs(tokens.count(0) / 2000 - expected) < 0.04
    # Seeded rows: the hashed uniforms are spread as well.
    logits = torch.tensor([0.7, 0.3]).log().expand(2000, -1).contiguous()
    requests = [make_request(seed=s) for s in range(2000)]
    assert abs(Sampler(0)(logits, requests).token_ids.count(0) / 2000 - 0.7) < 0.04


def test_penalties_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 3)
    requests = [
        make_request(
            prompt=[0, 1], output=[3, 3, 4],
            repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
        ),
        make_request(prompt=[0, 1], output=[3, 3, 4], frequency_penalty=-1.0),
        make_request(prompt=[0, 1], output=[3, 3, 4]),
    ]
    out = Sampler.process_logits(logits, requests)
    # Repetition: prompt and output tokens, positive / 2, negative * 2; then
    # -0.25 * count - 0.5 for output tokens 3 (twice) and 4 (once).
    assert out[0].tolist() == [1.0, -2.0, 0.5, 0.5, -4.75, 0.0]
    assert out[1].tolist() == [2.0, -1.0, 0.5, 5.0, -1.0, 0.0]
    assert out[2].tolist() == logits[2].tolist()
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    requests = [make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0)]
    assert Sampler()(logits, requests).token_ids == [1]


def test_logit_bias_forces_a_token_and_ignores_out_of_range_ids():
    logits = random_logits(2, 100, seed=3)
    bias = {5: 100.0, 100: 50.0, 10**6: -50.0}
    requests = [make_request(temperature=1.0, logit_bias=bias), make_request(temperature=0.0)]
    out = Sampler.process_logits(logits, requests)
    expected = logits.clone()
    expected[0, 5] += 100.0
    assert torch.equal(out, expected)
    for seed in range(5):
        assert Sampler(seed)(logits, requests).token_ids[0] == 5


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 200.0]])

    def request(num_output: int) -> Request:
        return make_request(
            output=[0] * num_output, eos=frozenset({3, 6000}), temperature=0.0,
            min_tokens=2, max_tokens=10, stop_token_ids=[4],
        )

    masked = Sampler.process_logits(logits, [request(1)])
    assert masked[0].tolist() == [0.0, 1.0, 2.0, -math.inf, -math.inf, 200.0]
    logits[0, 5] = -1.0
    assert Sampler()(logits, [request(1)]).token_ids == [2]
    assert Sampler()(logits, [request(2)]).token_ids == [3]


def test_logprobs_are_of_the_raw_distribution():
    logits = random_logits(3, 50, seed=4)
    requests = [
        make_request(temperature=0.0, logprobs=3, logit_bias={7: 100.0}),
        make_request(temperature=1.0, logprobs=0, seed=1),
        make_request(temperature=1.0),
    ]
    out = Sampler()(logits, requests)
    raw = logits.log_softmax(dim=-1)
    assert out.token_ids[0] == 7
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(raw[0, 7].item(), abs=1e-6)
    values, ids = raw[0].topk(3)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    chosen, top = out.logprobs[1]
    assert chosen == pytest.approx(raw[1, out.token_ids[1]].item(), abs=1e-6)
    assert top == []
    assert out.logprobs[2] is None


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), [make_request()])
