"""Building a ``tokenizers.Tokenizer`` from the tokenizer a GGUF file describes.

A GGUF carries no ``tokenizer.json``: it has llama.cpp's ``tokenizer.ggml.*``
metadata (tokens, merges or scores, token types, special ids), and the name
of a pre-tokenizer in ``tokenizer.ggml.pre``. Two models are supported:
``gpt2`` (byte-level BPE) and ``llama`` (SentencePiece BPE with byte
fallback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inferd.tokenizer import Tokenizer

# llama.cpp's token types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level vocabularies, by their ``tokenizer.ggml.pre`` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies trained on single digits, then GPT-2's split: SmolLM's
# tokenizer.json is Digits(individual) + ByteLevel, as llama.cpp does for these.
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})

Metadata = Callable[[str], Any]  # GGUF key -> value, or None when absent


def tokenizer_from_gguf(meta: Metadata, source: str, name: str = "") -> Tokenizer:
    """The tokenizer described by a GGUF's metadata; ``source`` names the file in errors."""
    model = meta("tokenizer.ggml.model")
    tokens = meta("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ValueError(f"{source}: GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    types = meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    try:
        if model == "gpt2":
            backend = _byte_level_bpe(meta, tokens, types)
        elif model == "llama":
            backend = _sentencepiece_bpe(meta, tokens, types)
        else:
            raise ValueError(f"tokenizer model {model!r} is not supported (supported: gpt2, llama)")
        _add_special_tokens(backend, tokens, types)
    except Exception as e:
        raise ValueError(f"{source}: cannot build the tokenizer: {e}") from e

    def token(key: str) -> str | None:
        token_id = meta(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{source}: tokenizer.ggml.{key} {token_id} is outside the vocabulary")
        return tokens[token_id]

    # end-of-turn / end-of-message ids also end generation (Llama 3 and others).
    eos_ids = {meta(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")}
    eos_ids.discard(None)
    if any(not 0 <= i < len(tokens) for i in eos_ids):
        raise ValueError(f"{source}: an end-of-sequence token id is outside the vocabulary")
    add_bos = meta("tokenizer.ggml.add_bos_token")
    bos, eos = token("bos_token_id"), token("eos_token_id")
    try:
        return Tokenizer(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=frozenset(eos_ids),
            chat_template=meta("tokenizer.chat_template"),
            # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
            add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def _byte_level_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> BackendTokenizer:
    merges = meta("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("a gpt2 tokenizer needs tokenizer.ggml.merges")
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # llama.cpp stores most tokens in the byte alphabet already, but some
        # converters wrote plain text; added tokens are matched as plain text.
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_parse_merges(merges), fuse_unk=False))
    pre = meta("tokenizer.ggml.pre") or "default"
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        # "gpt2", "default" and unknown names: GPT-2's own split.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> BackendTokenizer:
    scores = meta("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a llama tokenizer needs one tokenizer.ggml.scores entry per token")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = meta("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = meta("tokenizer.ggml.merges")
    pairs = _parse_merges(merges) if merges else _merges_from_scores(tokens, scores, types)
    bpe = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    space = normalizers.Replace(" ", "\u2581")
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta("tokenizer.ggml.add_space_prefix") in (None, True):
        # Prepended to every text segment, so also after each special token, as
        # llama.cpp does; decoding drops the one leading space.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = space
    backend.decoder = decoders.Sequence(decode)
    return backend


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("tokenizer.ggml.merges has an entry that is not two tokens")
    return pairs  # type: ignore[return-value]


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list: a piece's score orders its merge.

    Every split of a normal piece into two normal pieces is a merge, ranked by
    the merged piece's score, best first.
    """
    ids = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens are special (skipped when decoding); user-defined ones are
    # plain added tokens. Both are matched whole in the input and, being in
    # the vocabulary already, keep their ids.
    control = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    if backend.get_vocab_size(with_added_tokens=True) > len(tokens):
        raise ValueError("added tokens grew the vocabulary past the model's")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level tokens.

    Printable Latin-1 bytes stand for themselves; the rest (control bytes,
    space, 0x7F-0xA0, 0xAD) take the code points from 256 on, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in alphabet]
    alphabet.update({b: chr(256 + n) for n, b in enumerate(others)})
    return alphabet
