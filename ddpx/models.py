"""Small built-in models for the default example and tests."""

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """MLP for the 8x8 digits: 64 -> hidden -> hidden -> 10 logits."""

    def __init__(self, in_features: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
