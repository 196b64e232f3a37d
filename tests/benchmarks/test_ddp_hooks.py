"""The DDP hooks benchmark's own arithmetic (``benchmarks/performance/ddp_hooks.py``): how many
elements PowerSGD sends whole and how many as factors, by the documented rule."""

import torch

from benchmarks.performance.ddp_hooks import powersgd_elements


def test_powersgd_elements_follow_the_documented_rule():
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(4, 4))
    dense, factors = powersgd_elements(model, rank=4, min_compression_rate=1)
    # Linear(100, 50): 50 x 100 factored (150 * 4); conv 8 x 27 factored ((8 + 27) * 4 = 140 < 216);
    # 4 x 4 is not ((4 + 4) * 4 >= 16); biases and the 4 x 4 weight go whole.
    assert factors == 150 * 4 + 35 * 4
    assert dense == 50 + 8 + 16 + 4
    # At 2, the conv is sent whole: 280 >= 216.
    assert powersgd_elements(model, rank=4, min_compression_rate=2) == (dense + 216, 150 * 4)
