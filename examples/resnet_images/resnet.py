"""A small ResNet for image classification: a 3x3 stem, three stages of two basic
blocks (convolution, BatchNorm, ReLU, with identity or 1x1 shortcuts), global
average pooling and a linear classifier. With ``trainer.sync_batchnorm: true`` the
BatchNorm layers normalise over the global batch of every rank."""

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 16, blocks_per_stage: int = 2):
        super().__init__()
        layers = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks_per_stage):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and block == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
