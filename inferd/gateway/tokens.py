"""Prompt tokens counted at the edge, for token-per-minute limits and the
prompt-length cap, before a request reaches a replica.

With the model's tokenizer (a ``tokenizer.json``, a GGUF file, or "default"
for the embedded model) chat prompts go through its chat template and the
count is exact for inferd replicas of that model; without one, text counts
as ceil(UTF-8 bytes / 4) plus 4 tokens of framing per chat message, the
usual estimate for English. The replica's ``usage`` settles the difference
afterwards (see ``Gateway``), so an estimate only shifts when tokens are charged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from inferd.tokenizer import Tokenizer

_MESSAGE_FRAMING = 4


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by a model's ``tokenizer:`` setting."""
    from inferd.models.default import default_model_path

    path = default_model_path() if spec == "default" else Path(spec)
    if not path.is_file():
        raise ValueError(f"tokenizer: no such file {str(path)!r}")
    if path.suffix == ".gguf":
        from inferd.models.gguf_file import GGUFFile
        from inferd.models.gguf_tokenizer import tokenizer_from_gguf

        fields = GGUFFile(path).fields
        return tokenizer_from_gguf(fields.get, str(path), name=path.stem)
    import tokenizers

    # A bare tokenizer.json has no chat template: chat prompts are then estimated.
    backend = tokenizers.Tokenizer.from_file(str(path))
    return Tokenizer(backend, bos_token=None, eos_token=None, eos_token_ids=frozenset(), chat_template=None, name=path.stem)


def _estimate(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "replace")) / 4)


class PromptCounter:
    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, body: dict[str, Any]) -> int:
        """Prompt tokens of a validated chat or completion request body."""
        if "messages" in body:
            return self._chat(body["messages"])
        prompt = body.get("prompt", "")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        total = 0
        for p in prompts:
            if isinstance(p, list):  # token ids
                total += len(p)
            elif self.tokenizer is not None:
                total += len(self.tokenizer.encode(p))
            else:
                total += _estimate(p)
        return total

    def _chat(self, messages: list[dict[str, Any]]) -> int:
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.apply_chat_template(messages)
                return len(self.tokenizer.encode(text, add_special_tokens=False))
            except Exception:  # noqa: BLE001 - a message shape the template does not take: estimate; the replica will say
                pass
        total = 0
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            total += _MESSAGE_FRAMING + _estimate(content if isinstance(content, str) else "")
        return total
