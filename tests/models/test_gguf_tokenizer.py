from __future__ import annotations

import pytest

from inferd.models.gguf_tokenizer import byte_alphabet, tokenizer_from_gguf

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 3.14",
    "Prices: $1,299.99 (20% off) on 2024-01-31",
    "def add(a, b):\n    return a + b\n",
    "    indented\tand\ttabbed",
    "multiple   spaces   here  ",
    "line1\nline2\n\nline4\r\n",
    "\n\n\n",
    "你好，世界",
    "こんにちは世界",
    "🙂👍🏽",
    "naïve café résumé",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|im_start|>assistant",
    "<|endoftext|>text<|im_end|>",
    "don't won't I'm we're they'll",
    "https://example.com/path?q=1&x=2#frag",
    " leading space",
    "",
    "mixed😀emoji中文and English123",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "user", "content": "Hi! 你好"}],
]


def test_encode_matches_transformers(default_checkpoint, hf_gguf_tokenizer):
    ours = default_checkpoint.tokenizer
    for text in SAMPLES:
        assert ours.encode(text) == hf_gguf_tokenizer.encode(text, add_special_tokens=True), text
        assert ours.encode(text, add_special_tokens=False) == hf_gguf_tokenizer.encode(text, add_special_tokens=False)


def test_decode_round_trips_and_matches_transformers(default_checkpoint, hf_gguf_tokenizer):
    ours = default_checkpoint.tokenizer
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True), text


def test_special_tokens(default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_ids) == (
        "<|im_start|>",
        1,
        "<|im_end|>",
        frozenset({2}),
    )
    assert tok.add_bos_token is False
    assert tok.all_special_ids == frozenset(range(17))
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.id_to_token(4093) == "user" and tok.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(default_checkpoint, hf_gguf_tokenizer, conversation, add_generation_prompt):
    ours = default_checkpoint.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_chat_template_text(default_checkpoint):
    text = default_checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


# --- small vocabularies written as metadata dicts -----------------------------------------


def _byte_level_meta(pre: str) -> dict:
    tokens = [*byte_alphabet().values(), "ab", "<|end|>", "<tool>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3, 4],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 257,
    }


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["1", "2", "3", "4", "5", "Ġabc", "'s"]),
        ("llama-bpe", ["123", "45", "Ġabc", "'s"]),
        ("qwen2", ["1", "2", "3", "4", "5", "Ġabc", "'s"]),
        ("gpt2", ["12345", "Ġabc", "'s"]),
        ("some-future-name", ["12345", "Ġabc", "'s"]),
    ],
)
def test_pre_tokenizer_follows_tokenizer_ggml_pre(pre, pieces):
    tok = tokenizer_from_gguf(_byte_level_meta(pre).get, "x.gguf")
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345 abc's")] == pieces


def test_control_and_user_defined_tokens():
    tok = tokenizer_from_gguf(_byte_level_meta("gpt2").get, "x.gguf")
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    assert (a, b) == (0x61 - 0x21, 0x62 - 0x21)  # printable bytes come first in the alphabet
    assert tok.encode("ab<|end|>a<tool>b") == [256, 257, a, 258, b]
    assert tok.all_special_ids == frozenset({257}) and tok.eos_token_ids == frozenset({257})
    assert tok.decode([a, 257, 258]) == "a<tool>"
    assert tok.decode([a, 257, 258], skip_special_tokens=False) == "a<|end|><tool>"


def _sentencepiece_meta() -> dict:
    merged = ["he", "ll", "hell", "hello", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
    chars = ["\u2581", "h", "e", "l", "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars, *merged]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-100.0] * len(chars) + [-1.0 - i for i in range(len(merged))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(merged)),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_tokenizer():
    meta = _sentencepiece_meta()
    tok = tokenizer_from_gguf(meta.get, "spm.gguf")
    ids = meta["tokenizer.ggml.tokens"].index
    assert tok.add_bos_token is True  # llama.cpp's default for SentencePiece
    assert tok.encode("hello world") == [1, ids("\u2581hello"), ids("\u2581world")]
    # Unknown characters fall back to their UTF-8 bytes.
    assert tok.encode("hé", add_special_tokens=False) == [ids("\u2581"), ids("h"), ids("<0xC3>"), ids("<0xA9>")]
    assert tok.decode(tok.encode("hé world")) == "hé world"
    # A segment after a special token gets its own space prefix, as in llama.cpp.
    assert tok.encode("</s>hello", add_special_tokens=False) == [2, ids("\u2581hello")]
    assert tok.decode([1, ids("\u2581hello"), 2]) == "hello"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
        ({"tokenizer.ggml.tokens": None}, "has no tokenizer"),
        ({"tokenizer.ggml.token_type": [1]}, "token_type has 1 entries for 259 tokens"),
        ({"tokenizer.ggml.eos_token_id": 999}, "outside the vocabulary"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "not two tokens"),
    ],
)
def test_bad_tokenizer_metadata(change, match):
    meta = _byte_level_meta("gpt2") | change
    with pytest.raises(ValueError, match=match) as info:
        tokenizer_from_gguf(meta.get, "bad.gguf")
    assert str(info.value).startswith("bad.gguf: ")
