"""Shared type aliases."""

from __future__ import annotations

TokenIds = list[int]
# (token id, logprob) pairs, most likely first.
TopLogprobs = list[tuple[int, float]]
