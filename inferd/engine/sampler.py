"""Turns one step's logits into one token per request.

Processing order per row follows vLLM: logit bias, min_tokens masking,
penalties, then greedy argmax or temperature -> min_p -> top_k -> top_p ->
sample. Every stage runs batched over only the rows that need it and is
skipped when none do, since this runs once per engine step.

Sampling is inverse-CDF with one uniform per row. A seeded row draws its
uniform from a hash of (seed, output position) instead of a generator, so its
token depends only on its own logits and position: not on the batch, its
order, or a preemption that recomputes the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.request import Request
from inferd.types import TopLogprobs

# top_p without top_k looks among this many most likely tokens, widening a
# row to the next count, then the whole sorted vocab, while its nucleus
# does not fit: a full sort is slow on CPUs, and nuclei are usually small.
_TOP_P_CANDIDATES = (256, 2048)
_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    # One per row.
    token_ids: list[int]
    # Per row: (chosen token's logprob, top-N alternatives most likely first)
    # when the row's params ask for logprobs, else None.
    logprobs: list[tuple[float, TopLogprobs] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Drives rows without a seed; lives on the CPU since it only makes one
        # uniform per row.
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: (N, V), row i belongs to requests[i]."""
        x = self.process_logits(logits, requests)
        logprobs = self._logprobs_input(logits, requests)
        tokens = self._choose(x, requests)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _gather_logprobs(logprobs, requests, token_ids))

    # Logit processing --------------------------------------------------------

    @staticmethod
    def _logprobs_input(
        logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, their raw log-softmax (R, V)) for rows asking for logprobs."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return None
        sub = logits if len(rows) == len(requests) else logits[_index(rows, logits.device)]
        return rows, sub.float().log_softmax(dim=-1)

    @staticmethod
    def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The float32 logits (N, V) after logit bias, min_tokens masking and
        penalties: what greedy takes the argmax of and sampling scales by
        temperature. Never modifies ``logits``."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be (len(requests), vocab), got {tuple(logits.shape)} "
                f"for {len(requests)} requests"
            )
        x = logits.float()
        vocab = x.shape[1]
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        penalty_rows: list[int] = []
        for i, req in enumerate(requests):
            params = req.sampling_params
            if params.logit_bias:
                for token, value in params.logit_bias.items():
                    if 0 <= token < vocab:
                        bias_rows.append(i)
                        bias_cols.append(token)
                        bias_vals.append(value)
            if len(req.output_token_ids) < params.min_tokens:
                for token in set(req.eos_token_ids).union(params.stop_token_ids):
                    if 0 <= token < vocab:
                        mask_rows.append(i)
                        mask_cols.append(token)
            if (
                params.repetition_penalty != 1.0
                or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0
            ):
                penalty_rows.append(i)
        if not (bias_rows or mask_rows or penalty_rows):
            return x
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        device = x.device
        if bias_rows:
            values = torch.tensor(bias_vals, dtype=x.dtype, device=device)
            x.index_put_((_index(bias_rows, device), _index(bias_cols, device)), values, accumulate=True)
        if mask_rows:
            x[_index(mask_rows, device), _index(mask_cols, device)] = float("-inf")
        if penalty_rows:
            rows = _index(penalty_rows, device)
            x[rows] = _apply_penalties(x[rows], [requests[i] for i in penalty_rows])
        return x

    # Choosing tokens ----------------------------------------------------------

    def _choose(self, x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token id per row of x (N, V)."""
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        greedy = x.max(dim=-1).indices if len(sampled) < len(requests) else None
        if not sampled:
            return greedy
        if len(sampled) == len(requests):
            tokens = self._sample(x, requests)
        else:
            rows = _index(sampled, x.device)
            tokens = greedy
            tokens[rows] = self._sample(x[rows], [requests[i] for i in sampled])
        return tokens

    def _sample(self, x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Samples one token per row of x (R, V) after temperature, min_p, top_k, top_p."""
        device = x.device
        num_rows, vocab = x.shape
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        if any(p.min_p > 0.0 for p in params):
            # p < min_p * p_max  <=>  logit < max_logit + T * log(min_p), in
            # unscaled logits; log(0) masks nothing.
            min_p = torch.tensor([p.min_p for p in params], device=device)
            threshold = x.amax(dim=-1, keepdim=True) + (temperature * min_p.log())[:, None]
            x = x.masked_fill(x < threshold, float("-inf"))
        u = self._uniforms(requests, device)

        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        truncated = [i for i, p in enumerate(params) if top_k[i] > 0 or p.top_p < 1.0]
        if not truncated:
            return _inverse_cdf_sample(x / temperature[:, None], u)
        tokens = torch.empty(num_rows, dtype=torch.long, device=device)
        truncated_set = set(truncated)
        plain = [i for i in range(num_rows) if i not in truncated_set]
        if plain:
            rows = _index(plain, device)
            tokens[rows] = _inverse_cdf_sample(x[rows] / temperature[rows, None], u[rows])

        # Each row looks first at its top_k, or for top_p alone at a few
        # candidates, widening only the rows whose nucleus does not fit.
        rows = _index(truncated, device)
        whole = len(truncated) == num_rows
        sub_x = x if whole else x[rows]
        sub_t, sub_u = (temperature, u) if whole else (temperature[rows], u[rows])
        sub_k = torch.tensor([top_k[i] for i in truncated], device=device)
        sub_p = torch.tensor([params[i].top_p for i in truncated], device=device)
        tensors = (sub_x, sub_t, sub_k, sub_p, sub_u)
        base = min(vocab, max(top_k[i] if top_k[i] > 0 else _TOP_P_CANDIDATES[0] for i in truncated))
        wider = {min(w, vocab) for w in (*_TOP_P_CANDIDATES[1:], vocab)}
        sub_tokens, covered = _sample_top_k_top_p(*tensors, width=base)
        pending = (~covered).nonzero().squeeze(1)
        for width in sorted(w for w in wider if w > base):
            if pending.numel() == 0:
                break
            chosen, covered = _sample_top_k_top_p(*(t[pending] for t in tensors), width=width)
            sub_tokens[pending] = chosen
            pending = pending[~covered]
        assert pending.numel() == 0, "a full-vocab pass covers every row"
        tokens[rows] = sub_tokens
        return tokens

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: hashed for seeded rows, else from
        the sampler's generator."""
        u = torch.rand(len(requests), generator=self._generator, dtype=torch.float64)
        for i, req in enumerate(requests):
            seed = req.sampling_params.seed
            if seed is not None:
                u[i] = seeded_uniform(seed, len(req.output_token_ids))
        return u.to(device=device, dtype=torch.float32)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a fixed function of (seed, position)."""
    # Every 64 bits of the seed, and its sign, feed the state.
    z = _splitmix64(int(seed < 0))
    magnitude = abs(seed)
    while True:
        z = _splitmix64(z ^ (magnitude & _MASK64))
        magnitude >>= 64
        if not magnitude:
            break
    z = _splitmix64(z ^ (position & _MASK64))
    return (z >> 11) * 2.0**-53


def _splitmix64(z: int) -> int:
    # The SplitMix64 output function: a bijective 64-bit mixer.
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _apply_penalties(x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, presence and frequency
    over output tokens; x: (R, V), one row per request.

    Works on the gathered logits of the ids involved rather than on (R, V)
    masks: a few thousand ids per row against a vocab of tens of thousands.
    """
    rows, vocab = x.shape
    device = x.device
    params = [r.sampling_params for r in requests]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]

    # A spare last column takes padding and out-of-range ids; repeated ids
    # scatter identical values, so duplicates are harmless.
    x = torch.cat([x, x.new_zeros(rows, 1)], dim=1)  # (R, V + 1)
    output_ids = _padded([r.output_token_ids for r in requests], vocab, device)  # (R, L_out)
    if bool((repetition != 1.0).any()):
        seen_ids = _padded(
            [r.prompt_token_ids + r.output_token_ids for r in requests], vocab, device
        )  # (R, L_prompt + L_out)
        seen = x.gather(1, seen_ids)
        x.scatter_(1, seen_ids, torch.where(seen > 0, seen / repetition, seen * repetition))
    if bool(((presence != 0.0) | (frequency != 0.0)).any()):
        counts = torch.zeros(rows, vocab + 1, device=device)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
        count = counts.gather(1, output_ids)  # (R, L_out), >= 1 for real ids
        penalty = frequency * count + presence * (count > 0).to(x.dtype)
        x.scatter_(1, output_ids, x.gather(1, output_ids) - penalty)
    return x[:, :vocab]


def _sample_top_k_top_p(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples among each row's top_k tokens (0: no limit), then its top_p
    nucleus, looking only at the `width` most likely tokens of the unscaled
    logits x (R, V).

    Returns (token ids (R,), covered (R,)): covered is False for a row whose
    nucleus may extend past `width`, so its token must be redrawn wider.
    """
    vocab = x.shape[1]
    if width == vocab:
        values, ids = x.sort(dim=-1, descending=True)  # (R, V)
    else:
        values, ids = x.topk(width, dim=-1)  # (R, width), most likely first
    # Scaling after the selection is exact (it keeps the order) and touches
    # only `width` columns.
    values = values / temperature[:, None]
    has_k = top_k > 0
    keep = torch.where(has_k, top_k.clamp(max=width), width)
    position = torch.arange(width, device=x.device)
    values = values.masked_fill(position[None, :] >= keep[:, None], float("-inf"))
    covered = torch.ones_like(has_k)
    needs_p = top_p < 1.0
    if bool(needs_p.any()):
        # A top_k row's nucleus is taken over its renormalized top_k; any
        # other row's over the whole vocab.
        norm = values.logsumexp(dim=-1)
        open_rows = (needs_p & ~has_k).nonzero().squeeze(1)
        if width < vocab and open_rows.numel() > 0:
            norm[open_rows] = (x[open_rows] / temperature[open_rows, None]).logsumexp(dim=-1)
        probs = (values - norm[:, None]).exp()
        cumulative = probs.cumsum(dim=-1)
        # Drop a token once the tokens before it already reach top_p.
        drop = (cumulative - probs >= top_p[:, None]) & needs_p[:, None]
        values = values.masked_fill(drop, float("-inf"))
        if width < vocab:
            covered = has_k | ~needs_p | (cumulative[:, -1] >= top_p)
    choice = _inverse_cdf_sample(values, u)  # (R,) positions in sorted order
    return ids.gather(1, choice[:, None]).squeeze(1), covered


def _inverse_cdf_sample(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from softmax of each row of x (R, W) using uniforms u (R,)."""
    weights = (x - x.amax(dim=-1, keepdim=True)).exp()  # unnormalized, masked -> 0
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total so the search lands on a token with weight > 0.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _gather_logprobs(
    computed: tuple[list[int], torch.Tensor] | None,
    requests: list[Request],
    token_ids: list[int],
) -> list[tuple[float, TopLogprobs] | None]:
    out: list[tuple[float, TopLogprobs] | None] = [None] * len(requests)
    if computed is None:
        return out
    rows, logprobs = computed  # logprobs: (R, V)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=logprobs.device)
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    max_n = max(requests[i].sampling_params.logprobs for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_n > 0:
        values, ids = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = requests[i].sampling_params.logprobs
        out[i] = (chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _padded(sequences: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """(R, max_len) long tensor of the sequences, padded and with ids outside
    [0, pad) replaced by `pad`."""
    width = max(1, max(len(s) for s in sequences))
    out = torch.full((len(sequences), width), pad, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    out = out.masked_fill((out < 0) | (out > pad), pad)
    return out.to(device)
