"""Prompts to send: synthetic ones of a given token length, a shared-prefix
workload (N system prompts x M questions), or a JSONL file."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

from inferd.bench.records import BenchRequest

# Short common words: with a leading space each is one token in the usual BPE
# vocabularies, so a word count is a close first guess at a token count.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this had are but not "
    "be have one all were when we there can an which their said if do will each about how up out "
    "them then she many some so these would other into has more two time like him see no could way "
    "my than first water been call who its now long down day did get come made may part over new "
    "sound take only little work know place year live me back give most very after thing our just "
    "name good sentence man think say great where help through much before line right too mean old"
).split()

# Counts a prompt's tokens (a local tokenizer file or the server's
# /tokenize); None when it cannot.
TokenCounter = Callable[[str], Awaitable[int | None]]


def local_counter(tokenizer_file: str | Path) -> TokenCounter:
    """Counts with a ``tokenizer.json`` on disk (the ``tokenizers`` library;
    nothing is downloaded), special tokens included as a server adds them."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # noqa: BLE001 - the library raises its own types
        raise ValueError(f"tokenizer {tokenizer_file}: cannot load ({e})") from None

    async def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    return count

_FIT_ROUNDS = 8  # /tokenize calls per prompt at most


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def _fit(words: list[str], target: int, rng: random.Random, count: TokenCounter) -> tuple[str, int | None]:
    """Add or drop words until the prompt is ``target`` tokens; the prompt and
    its count (None: no counter, the count is the word count's guess)."""
    best: tuple[int, str, int] | None = None
    for _ in range(_FIT_ROUNDS):
        text = " ".join(words)
        n = await count(text)
        if n is None:
            return text, None
        if best is None or abs(n - target) < best[0]:
            best = (abs(n - target), text, n)
        if n == target:
            break
        # Scale by the measured tokens per word, and move at least one word.
        k = max(1, round(len(words) * target / max(n, 1)))
        if k == len(words):
            k = len(words) + 1 if n < target else max(1, len(words) - 1)
        words = words[:k] + rng.choices(WORDS, k=max(0, k - len(words)))
    assert best is not None
    return best[1], best[2]


async def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, seed: int, count: TokenCounter
) -> tuple[list[BenchRequest], bool]:
    """``n`` prompts of random words and whether their lengths are exact
    (False: the server has no /tokenize and words stand in for tokens)."""
    rng = random.Random(seed)
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    drafts = [rng.choices(WORDS, k=k) for k in ins]
    # One rng per prompt, so the texts do not depend on the order the counts come back.
    rngs = [random.Random(rng.getrandbits(64)) for _ in range(n)]
    exact = await count(" ".join(drafts[0])) is not None
    if exact:
        limit = asyncio.Semaphore(8)

        async def fit(i: int) -> tuple[str, int | None]:
            async with limit:
                return await _fit(drafts[i], ins[i], rngs[i], count)

        fitted = await asyncio.gather(*(fit(i) for i in range(n)))
    else:
        fitted = [(" ".join(d), None) for d in drafts]
    requests = [
        BenchRequest(prompt=text, messages=None, max_tokens=out, input_len=got if got is not None else k, ignore_eos=True)
        for (text, got), k, out in zip(fitted, ins, outs)
    ]
    return requests, exact


async def shared_prefix_requests(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
    count: TokenCounter,
    chat: bool,
) -> tuple[list[BenchRequest], bool]:
    """``n`` requests, each one of ``num_prefixes`` shared system prompts of
    ``prefix_len`` tokens followed by a question of its own of ``input_len``
    tokens, in a seeded shuffled order: the workload a prefix cache (and a
    cache-aware router) is for. For chat the prefix is the system message;
    for completions it is the start of the prompt."""
    prefixes, exact = await random_requests(num_prefixes, prefix_len, 1, 0.0, seed, count)
    questions, _ = await random_requests(n, input_len, output_len, 0.0, seed + 1, count)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    requests = []
    for i in order:
        prefix, question = prefixes[i % num_prefixes], questions[i]
        known = prefix.input_len is not None and question.input_len is not None
        length = prefix.input_len + question.input_len if known else None
        if chat:
            messages = [{"role": "system", "content": prefix.prompt}, {"role": "user", "content": question.prompt}]
            requests.append(BenchRequest(None, messages, question.max_tokens, None, ignore_eos=True))
        else:
            text = f"{prefix.prompt}\n\n{question.prompt}"
            requests.append(BenchRequest(text, None, question.max_tokens, length, ignore_eos=True))
    return requests, exact


def jsonl_requests(path: str | Path, n: int, output_len: int, chat: bool) -> list[BenchRequest]:
    """The first ``n`` lines of a JSONL file as requests (fewer if the file is shorter)."""
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(requests) == n:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected an object")
            prompt, messages = obj.get("prompt"), obj.get("messages")
            if (prompt is None) == (messages is None):
                raise ValueError(f"{path}:{lineno}: give exactly one of prompt or messages")
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError(f"{path}:{lineno}: prompt must be a string")
            if messages is not None and not (isinstance(messages, list) and messages):
                raise ValueError(f"{path}:{lineno}: messages must be a non-empty list")
            if messages is not None and not chat:
                raise ValueError(f"{path}:{lineno}: a messages line needs --endpoint chat")
            max_tokens = obj.get("max_tokens", output_len)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{path}:{lineno}: max_tokens must be an integer >= 1")
            requests.append(BenchRequest(prompt=prompt, messages=messages, max_tokens=max_tokens))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests
