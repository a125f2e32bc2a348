import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from inferd.gateway.tokens import PromptCounter, load_tokenizer

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer("default")


@pytest.fixture
def word_level_json(tmp_path):
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    return path


# The estimate: ceil(UTF-8 bytes / 4), plus 4 per chat message


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("abcdefgh", 2), ("abcdefghi", 3), ("é", 1), ("", 0)],
    ids=["8-bytes", "9-bytes", "2-byte-char", "empty"],
)
def test_estimate_is_bytes_over_four_rounded_up(prompt, tokens):
    assert PromptCounter().count({"prompt": prompt}) == tokens


def test_token_ids_count_their_length():
    assert PromptCounter().count({"prompt": [5, 6, 7]}) == 3


def test_list_of_prompts_sums():
    counter = PromptCounter()

    assert counter.count({"prompt": ["abcd", "abcdefghi"]}) == 1 + 3
    assert counter.count({"prompt": [[1, 2], [3, 4, 5]]}) == 5


def test_chat_estimate_adds_four_per_message():
    messages = [{"role": "system", "content": "abcdefgh"}, {"role": "user", "content": "abc"}]

    assert PromptCounter().count({"messages": messages}) == (4 + 2) + (4 + 1)


def test_chat_estimate_counts_content_parts():
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "efghi"}]

    assert PromptCounter().count({"messages": [{"role": "user", "content": parts}]}) == 4 + 3


def test_chat_estimate_message_without_content_is_framing_only():
    assert PromptCounter().count({"messages": [{"role": "assistant", "content": None}]}) == 4


def test_counter_is_exact_only_with_a_tokenizer(default_tokenizer):
    assert PromptCounter().exact is False
    assert PromptCounter(default_tokenizer).exact is True


# With the embedded model's tokenizer


def test_default_tokenizer_counts_completion_prompt_exactly(default_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog."

    assert PromptCounter(default_tokenizer).count({"prompt": prompt}) == len(default_tokenizer.encode(prompt))


def test_default_tokenizer_counts_chat_through_its_template(default_tokenizer):
    text = default_tokenizer.apply_chat_template(CHAT)
    expected = len(default_tokenizer.encode(text, add_special_tokens=False))

    assert PromptCounter(default_tokenizer).count({"messages": CHAT}) == expected
    # Not the estimate (4 per message + bytes / 4 = 23): the template was used.
    assert PromptCounter().count({"messages": CHAT}) == 23
    assert expected != 23


def test_load_tokenizer_missing_path(tmp_path):
    missing = tmp_path / "nope.json"

    with pytest.raises(ValueError) as e:
        load_tokenizer(str(missing))

    assert str(e.value) == f"tokenizer: no such file {str(missing)!r}"


def test_tokenizer_json_counts_completion_exactly(word_level_json):
    counter = PromptCounter(load_tokenizer(str(word_level_json)))

    assert counter.count({"prompt": "a b a zzz"}) == 4


def test_tokenizer_json_has_no_template_so_chat_is_estimated(word_level_json):
    counter = PromptCounter(load_tokenizer(str(word_level_json)))

    assert counter.count({"messages": [{"role": "user", "content": "a b a b a"}]}) == 4 + 3
