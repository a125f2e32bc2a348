import pytest

from inferd.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"5": 1})
    assert p.stop == ["###"] and p.top_k == 0 and p.logit_bias == {5: 1.0}
    assert not p.greedy and SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_children_get_distinct_reproducible_seeds():
    p = SamplingParams(n=3, seed=10, temperature=0.8)
    assert [p.child(i).seed for i in range(3)] == [10, 11, 12]
    assert all(p.child(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).child(1).seed is None
