"""A user's own small CNN (Conv+BN+ReLU blocks), as `opswap optimize` takes it:

    opswap optimize examples/models/small_cnn.py:build --out out/small_cnn
    opswap optimize examples/models/small_cnn.py:build --set batch=32 --set width=64

`build` returns (module, inputs); its keyword parameters are the `--set` keys.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for cout, stride in (
            (width, 1),
            (width, 1),
            (2 * width, 2),
            (2 * width, 1),
            (4 * width, 2),
        ):
            layers += [
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            ]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def build(batch: int = 8, width: int = 32, size: int = 32):
    torch.manual_seed(0)
    model = SmallCNN(width)
    with torch.no_grad():  # trained-looking BatchNorm statistics, so the fold changes numbers
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval(), (torch.randn(batch, 3, size, size),)
