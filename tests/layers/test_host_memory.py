from __future__ import annotations

import torch
from torch import nn

from inferd.layers.host_memory import HUGE_PAGE, move_to_huge_pages, zeroed


def test_zeroed_is_zero_aligned_and_writable():
    t = zeroed((3, 1000), torch.bfloat16)
    assert t.shape == (3, 1000) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[1, 5] = 2.5
    assert float(t[1, 5]) == 2.5 and float(t.sum()) == 2.5


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 512)  # 8 MiB: moved
        self.head = nn.Linear(512, 4096, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, two modules
        self.small = nn.Linear(16, 16)  # stays
        self.register_buffer("codes", torch.randint(-127, 127, (4096, 2048), dtype=torch.int8))  # 8 MiB: moved


def test_move_keeps_values_and_ties_and_skips_small_tensors():
    model = _Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    small_ptr = model.small.weight.data_ptr()
    moved = move_to_huge_pages(model)
    assert moved == 4096 * 512 * 4 + 4096 * 2048
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model.head.weight is model.embed.weight
    assert isinstance(model.embed.weight, nn.Parameter)
    assert model.embed.weight.data_ptr() % HUGE_PAGE == 0 and model.codes.data_ptr() % HUGE_PAGE == 0
    assert model.small.weight.data_ptr() == small_ptr
