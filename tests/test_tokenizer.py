from __future__ import annotations

import datetime

import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inferd.tokenizer import ChatTemplateError, Tokenizer

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hello": 4, "world": 5, "<tool>": 6}


def _backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    backend.add_tokens([AddedToken("<tool>", special=False)])
    return backend


def _tokenizer(template: str | None = "{{ messages[0]['content'] }}", **kwargs) -> Tokenizer:
    args = dict(bos_token="<s>", eos_token="</s>", eos_token_ids=frozenset({3}), chat_template=template, name="tiny")
    return Tokenizer(_backend(), **(args | kwargs))


def test_ids_and_special_tokens():
    tok = _tokenizer()
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (7, 1, frozenset({2, 3}))
    assert tok.all_special_ids == frozenset({1, 2, 3})
    assert tok.id_to_token(5) == "world" and tok.id_to_token(7) is None and tok.id_to_token(-1) is None
    assert tok.token_to_id("hello") == 4 and tok.token_to_id("nope") is None


def test_encode_adds_bos_once_when_asked():
    tok = _tokenizer(add_bos_token=True)
    assert tok.encode("hello world") == [1, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tok.encode("<s> hello") == [1, 4]  # already there: not doubled
    assert tok.encode("") == [1]
    assert _tokenizer().encode("hello world") == [4, 5]


def test_decode_skips_special_tokens_by_default():
    tok = _tokenizer()
    assert tok.decode([1, 4, 6, 5, 2]) == "hello <tool> world"
    assert tok.decode([1, 4, 2], skip_special_tokens=False) == "<s> hello </s>"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bos_token": "<bos>"}, "bos_token '<bos>' is not in the vocabulary"),
        ({"eos_token": "<end>"}, "eos_token '<end>' is not in the vocabulary"),
        ({"bos_token": None, "add_bos_token": True}, "add_bos_token is set but there is no bos_token"),
        ({"eos_token_ids": frozenset({99})}, r"eos_token_ids \[2, 99\] not all in \[0, 7\)"),
    ],
)
def test_invalid_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _tokenizer(**kwargs)


CHATML = (
    "{% for message in messages %}\n"
    "    {{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "    <|assistant|>\n"
    "{% endif %}"
)


def test_template_whitespace_follows_trim_and_lstrip_blocks():
    tok = _tokenizer(CHATML)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # Block tags eat their own line; the indentation before them goes too, but not before output.
    turns = "    <|user|>hi</s>\n    <|assistant|>yo</s>\n"
    assert tok.apply_chat_template(messages) == turns + "    <|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == turns


def test_template_variables_and_helpers():
    template = (
        "{{ bos_token }}|{{ tools | tojson }}|{{ {'k': 'é'} | tojson(indent=2) }}|{{ extra }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{{ strftime_now('%Y') }}|{{ documents }}|{% generation %}G{% endgeneration %}"
    )
    tools = [{"name": "f", "description": "<b>&</b>"}]
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    out = _tokenizer(template).apply_chat_template(messages, tools=tools, extra=42)
    year = datetime.datetime.now().strftime("%Y")
    assert out == f'<s>|[{{"name": "f", "description": "<b>&</b>"}}]|{{\n  "k": "é"\n}}|42|one|{year}|None|G'


def test_template_raise_exception_is_a_value_error():
    tok = _tokenizer("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (None, "model 'tiny' has no chat template"),
        ("{% for m in messages %}", "does not parse"),
        ("{{ messages[0].content + 1 }}", "failed: TypeError"),
        ("{{ messages.append(1) }}", "failed: SecurityError"),
    ],
)
def test_template_errors(template, match):
    with pytest.raises(ValueError, match=match):
        _tokenizer(template).apply_chat_template([{"role": "user", "content": "x"}])


def test_content_parts_are_joined_and_messages_left_alone():
    tok = _tokenizer("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None, "tool_calls": [{}]}]
    assert tok.apply_chat_template(messages) == "[a\nb][None]"
    assert messages[0]["content"] is parts


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\].role must be a non-empty string"),
        ([{"role": "user"}], r"messages\[0\].content is required"),
        ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\].content\[0\] must be"),
    ],
)
def test_invalid_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        _tokenizer().apply_chat_template(messages)


def test_tools_must_be_a_list():
    with pytest.raises(ValueError, match="tools must be a list"):
        _tokenizer().apply_chat_template([{"role": "user", "content": "x"}], tools={"name": "f"})


TOOL_TEMPLATE = """{%- set ns = namespace(first=true) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' %}{% continue %}{% endif -%}
  <|{{ message.role }}|>
  {% if ns.first and messages[0].role == 'system' %}{{ messages[0].content }}
  {% endif %}
  {% if tools and ns.first %}
    Tools:
    {% for tool in tools %}{{ tool.function | tojson }}
    {% endfor %}
  {% endif %}
  {{ message.content | trim }}{{ eos_token }}
  {% set ns.first = false %}
{% endfor -%}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""


def test_template_renders_like_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = _tokenizer(TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Weather in Zürich?  "},
        {"role": "assistant", "content": "Sunny."},
    ]
    for add_generation_prompt in (True, False):
        (theirs,), _ = render_jinja_template(
            [messages],
            tools=tools,
            chat_template=TOOL_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            eos_token="</s>",
            bos_token="<s>",
        )
        ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
    assert '{"name": "weather", "parameters": {"city": "Zürich"}}' in ours
