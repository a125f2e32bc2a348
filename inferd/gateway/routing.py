"""Which replica serves a request: prefix affinity, bounded by load.

Requests that begin alike (the same system prompt, the same few-shot
examples) should land where that prefix already sits in the KV cache. The
leading ``prefix_chars`` of the prompt are hashed with each replica's id and
the highest score wins (rendezvous hashing: when a replica joins or leaves,
only the prefixes it wins or held move). The affine replica is passed over
for the least loaded one when it is overloaded: its load exceeds both
``overload_factor`` times and ``overload_margin`` more than the least
loaded's (both, so one request in flight against none is not "overloaded",
as in SGLang's cache-aware router).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

from inferd.gateway.config import RoutingConfig


class Routable(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def load(self) -> int: ...


def prefix_key(body: dict[str, Any], prefix_chars: int) -> str | None:
    """The leading ``prefix_chars`` of the prompt as the model will read it
    (chat messages in order, each with its role), or None without one."""
    parts: list[str] = []
    size = 0
    if isinstance(body.get("messages"), list):
        pieces = (_message_text(m) for m in body["messages"])
    elif "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: the first one decides
        pieces = iter([prompt if isinstance(prompt, str) else " ".join(map(str, prompt))])
    else:
        return None
    for piece in pieces:
        parts.append(piece)
        size += len(piece)
        if size >= prefix_chars:
            break
    text = "".join(parts)[:prefix_chars]
    return text or None


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"<{message.get('role', '')}>{content if isinstance(content, str) else ''}\n"


def _score(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, replicas: Sequence[Routable]) -> Routable:
    return max(replicas, key=lambda r: _score(key, r.id))


class Router:
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Routable], key: str | None) -> tuple[Routable, str]:
        """The replica for a request, and why: "affinity", "overload" (the
        affine one was overloaded), "least_loaded" or "round_robin"."""
        if not replicas:
            raise ValueError("replicas must not be empty")
        policy = self.config.policy
        if policy == "round_robin":
            return replicas[next(self._turn) % len(replicas)], "round_robin"
        # Ties go round robin, so an idle pool still spreads requests without a key.
        start = next(self._turn)
        rotated = [replicas[(start + i) % len(replicas)] for i in range(len(replicas))]
        least = min(rotated, key=lambda r: r.load)
        if policy == "least_loaded" or key is None:
            return least, "least_loaded"
        affine = rendezvous(key, replicas)
        overloaded = (
            affine.load > self.config.overload_factor * least.load
            and affine.load - least.load > self.config.overload_margin
        )
        return (least, "overload") if overloaded else (affine, "affinity")
