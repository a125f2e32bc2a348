"""inferd.bench.datasets: synthetic prompts of a token length, and JSONL files."""

from __future__ import annotations

import asyncio
import json

import pytest

from inferd.bench.datasets import WORDS, jsonl_requests, random_requests


async def two_tokens_per_word(text: str) -> int:
    return 2 * len(text.split()) + 1  # a BOS, and every word split in two


async def no_tokenizer(text: str) -> None:
    return None


def test_prompts_are_trimmed_to_the_servers_count():
    requests, exact = asyncio.run(random_requests(4, 21, 8, 0.0, seed=0, count=two_tokens_per_word))
    assert exact
    assert [r.input_len for r in requests] == [21] * 4
    assert all(len(r.prompt.split()) == 10 for r in requests)
    assert all(r.max_tokens == 8 and r.ignore_eos and r.messages is None for r in requests)
    assert len({r.prompt for r in requests}) == 4  # distinct prompts: no shared prefix to cache


def test_an_unreachable_length_keeps_the_closest_prompt():
    requests, _ = asyncio.run(random_requests(2, 20, 8, 0.0, seed=0, count=two_tokens_per_word))
    assert [r.input_len for r in requests] == [21, 21]  # odd counts only: 21, then 19, is as near as it gets


def test_without_a_tokenizer_words_stand_in_for_tokens():
    requests, exact = asyncio.run(random_requests(3, 16, 8, 0.0, seed=0, count=no_tokenizer))
    assert not exact
    assert [r.input_len for r in requests] == [16] * 3
    assert all(len(r.prompt.split()) == 16 and set(r.prompt.split()) <= set(WORDS) for r in requests)


def test_range_ratio_spreads_lengths_and_the_seed_fixes_them():
    a, _ = asyncio.run(random_requests(50, 100, 40, 0.5, seed=3, count=no_tokenizer))
    assert all(50 <= r.input_len <= 150 and 20 <= r.max_tokens <= 60 for r in a)
    assert len({r.input_len for r in a}) > 10
    b, _ = asyncio.run(random_requests(50, 100, 40, 0.5, seed=3, count=no_tokenizer))
    assert [r.prompt for r in a] == [r.prompt for r in b]


def write(tmp_path, *lines: object) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_jsonl_reads_prompts_messages_and_max_tokens(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    path = write(tmp_path, {"prompt": "a"}, "", {"messages": msgs, "max_tokens": 3}, {"prompt": "c"})
    reqs = jsonl_requests(path, 2, output_len=16, chat=True)
    assert [(r.prompt, r.messages, r.max_tokens) for r in reqs] == [("a", None, 16), (None, msgs, 3)]
    assert not any(r.ignore_eos for r in reqs)
    assert len(jsonl_requests(path, 100, 16, chat=True)) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "data.jsonl:1: not JSON"),
        ({"prompt": "a", "messages": []}, "exactly one of prompt or messages"),
        ({"other": 1}, "exactly one of prompt or messages"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"messages": [{"role": "user", "content": "x"}]}, "needs --endpoint chat"),
        ([1, 2], "expected an object"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        jsonl_requests(write(tmp_path, line), 10, 16, chat=False)


def test_shared_prefix_requests_share_their_system_prompts():
    import asyncio

    from inferd.bench.datasets import shared_prefix_requests

    async def words(text: str) -> int:
        return len(text.split())

    reqs, exact = asyncio.run(shared_prefix_requests(12, 3, 20, 5, 7, seed=1, count=words, chat=False))
    assert exact and len(reqs) == 12
    prefixes = {r.prompt.split("\n\n")[0] for r in reqs}
    assert len(prefixes) == 3 and all(len(p.split()) == 20 for p in prefixes)
    assert all(len(r.prompt.split("\n\n")[1].split()) == 5 and r.input_len == 25 for r in reqs)
    assert all(r.max_tokens == 7 and r.ignore_eos for r in reqs)
    assert len({r.prompt for r in reqs}) == 12  # each question its own

    chats, _ = asyncio.run(shared_prefix_requests(6, 2, 20, 5, 7, seed=1, count=words, chat=True))
    assert len({c.messages[0]["content"] for c in chats}) == 2
    assert all(c.messages[0]["role"] == "system" and c.messages[1]["role"] == "user" for c in chats)
    again, _ = asyncio.run(shared_prefix_requests(6, 2, 20, 5, 7, seed=1, count=words, chat=True))
    assert [c.messages for c in again] == [c.messages for c in chats]
