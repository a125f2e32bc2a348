"""Reading a Hugging Face checkpoint directory: ``config.json``, safetensors
weights, and the tokenizer files saved beside them.

Every problem is a ``ValueError`` naming the file at fault.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from inferd.models.config import ModelArchConfig
from inferd.tokenizer import Tokenizer

_INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    def __init__(self, path: Path, supported_architectures: tuple[str, ...]) -> None:
        self.path = path
        self._raw_config = _read_json(path / "config.json")
        archs = self._raw_config.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in supported_architectures:
            raise ValueError(
                f"{path / 'config.json'}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(supported_architectures)})"
            )
        if self._raw_config.get("quantization_config"):
            raise ValueError(f"{path / 'config.json'}: quantized Hugging Face checkpoints are not supported")
        try:
            self.config = ModelArchConfig.from_hf_dict(self._raw_config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path / 'config.json'}: {e}") from e
        self._files = self._index_weights()

    def _index_weights(self) -> dict[str, Path]:
        """Parameter name -> the safetensors file holding it."""
        index_path = self.path / _INDEX_FILE
        if index_path.is_file():
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index_path}: has no weight_map")
            files = sorted({self.path / str(f) for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors weight files")
        located: dict[str, Path] = {}
        for file in files:
            for name in _safetensors_keys(file):
                if name in located:
                    raise ValueError(f"{file}: tensor {name!r} is also in {located[name]}")
                located[name] = file
        if index_path.is_file():
            missing = set(weight_map) - set(located)
            if missing:
                raise ValueError(f"{index_path}: tensors {sorted(missing)[:5]} are not in the files it names")
        if self.config.tie_word_embeddings:
            # Some checkpoints save the tied head anyway; the model reuses the embedding.
            located.pop("lm_head.weight", None)
        return located

    def weight_names(self) -> list[str]:
        return list(self._files)

    def weights(self, dtype: torch.dtype = torch.float32, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, file in self._files.items():
            if name not in skip:
                by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with _open_safetensors(file) as f:
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:  # the file changed or is damaged past its header
                        raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from e
                    yield name, tensor.to(dtype)

    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_dir(self.path, self._raw_config)


def tokenizer_from_dir(path: Path, model_config: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer saved in an HF directory (tokenizer.json + tokenizer_config.json).

    EOS ids are the tokenizer's eos token plus every ``eos_token_id`` of
    ``generation_config.json`` and ``config.json``.
    """
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json (inferd needs a fast tokenizer file)")
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust parser's errors have no common Python type
        raise ValueError(f"{tokenizer_file}: not a valid tokenizer file ({e})") from e
    config_file = path / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    special_map_file = path / "special_tokens_map.json"
    special_map = _read_json(special_map_file) if special_map_file.is_file() else {}
    _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, config_file)

    def special(key: str) -> str | None:
        value = config.get(key) or special_map.get(key)
        return value.get("content") if isinstance(value, dict) else value

    eos_ids: set[int] = set()
    generation_file = path / "generation_config.json"
    for source, d in (
        (generation_file, _read_json(generation_file) if generation_file.is_file() else {}),
        (path / "config.json", model_config or {}),
    ):
        eos_ids |= _token_ids(d.get("eos_token_id"), source)
    try:
        return Tokenizer(
            backend,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            eos_token_ids=frozenset(eos_ids),
            chat_template=_chat_template(path, config, config_file),
            add_bos_token=bool(config.get("add_bos_token", False)),
            name=path.name,
        )
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from e


def _chat_template(path: Path, config: dict[str, Any], config_file: Path) -> str | None:
    # transformers >= 4.43 saves the template in its own file, which wins.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template must be a string")
    return template


def _add_missing_tokens(backend: BackendTokenizer, decoder: dict[str, Any], config_file: Path) -> None:
    """Add tokens that tokenizer_config.json declares but tokenizer.json lacks."""
    for token_id, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{config_file}: added_tokens_decoder[{token_id}] has no content")
        content = entry["content"]
        if backend.token_to_id(content) is not None:
            continue
        token = AddedToken(content, special=bool(entry.get("special")), normalized=bool(entry.get("normalized")))
        if entry.get("special"):
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(content) != int(token_id):
            raise ValueError(
                f"{config_file}: added token {content!r} would get id {backend.token_to_id(content)}, not {token_id}"
            )


def _token_ids(value: Any, source: Path) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return set(values)


def _open_safetensors(file: Path) -> Any:
    if not file.is_file():
        raise ValueError(f"{file}: weight file is missing")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # SafetensorError and friends for a bad header or short file
        raise ValueError(f"{file}: not a valid safetensors file ({e})") from e


def _safetensors_keys(file: Path) -> list[str]:
    with _open_safetensors(file) as f:
        return list(f.keys())


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value
