"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens: the text of
``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is new, and is taken
only once it no longer ends in U+FFFD, the mark of a UTF-8 character whose
bytes are still spread over tokens to come. The window starts on a few prompt
tokens so the first output token decodes as it would inside the full text
(a leading space, for instance).
"""

from __future__ import annotations

from typing import Protocol

from inferd.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first output token.
_PROMPT_CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would swallow the output's first
        # bytes into its own text; decode the output on its own instead.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        # Window state: self._tokens[self._prefix:self._read] decodes to
        # self._prefix_text, text already taken; tokens after _read are new.
        self._tokens = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(context) if context else ""

        # Text of all output tokens so far, cut at a matched stop string.
        self.output_text = ""
        self._num_sent = 0
        self._stopped = False

    @property
    def emitted_text(self) -> str:
        """The concatenation of every delta returned so far."""
        return self.output_text[: self._num_sent]

    def update(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Appends newly generated tokens; returns the stop string they
        completed, else None. ``num_output_tokens`` counts all output tokens
        including these; stop strings count only past ``min_tokens``."""
        if self._stopped or not new_token_ids:
            return None
        self._tokens.extend(new_token_ids)
        before = len(self.output_text)
        self.output_text += self._take_new_text(final=False)
        if not self._stop or num_output_tokens <= self._min_tokens:
            return None
        match = self._find_stop(before)
        if match is None:
            return None
        start, stop = match
        end = start + len(stop) if self._include_stop else start
        # Holding back the tails that may start a stop string kept all of it unsent.
        assert self._num_sent <= start, "part of a stop string was already emitted"
        self.output_text = self.output_text[:end]
        self._stopped = True
        return stop

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls. Until ``finished``, the tail that
        could still begin a stop string stays back; ``finished`` flushes all,
        including a character left incomplete by the last token."""
        if finished and not self._stopped:
            self.output_text += self._take_new_text(final=True)
        end = len(self.output_text)
        if not (finished or self._stopped):
            end -= self._stop_prefix_len()
        end = max(end, self._num_sent)
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _take_new_text(self, final: bool) -> str:
        """Text added by the tokens after the read offset; empty while it
        ends inside a character, unless ``final``."""
        if self._read == len(self._tokens):
            return ""
        text = self._decode(self._tokens[self._prefix :])
        if len(text) <= len(self._prefix_text) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._tokens[self._read :])
        self._prefix, self._read = self._read, len(self._tokens)
        return new

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        """Earliest stop string ending past output_text[:before], as (start, stop).

        Only the new text and each stop's length - 1 characters before it are
        searched: a match ending earlier would have been found then.
        """
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = self.output_text.find(stop, max(0, before - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent tail of output_text that is a proper
        prefix of a stop string."""
        text = self.output_text
        longest = min(self._max_stop_len - 1, len(text) - self._num_sent)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(len(stop) > k and stop.startswith(tail) for stop in self._stop):
                return k
        return 0
