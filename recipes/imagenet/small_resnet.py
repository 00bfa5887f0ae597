"""A small CIFAR-style ResNet for low-resolution images (the digits task)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock


class SmallResNet(nn.Module):
    """ResNet with a 3x3 stem (no max-pool) and one stage per entry of ``widths``.

    The first stage keeps the resolution, every later stage halves it. With the defaults
    (widths 16/32/64, one basic block per stage) it is a ResNet-8 of about 78k parameters.

    Args:
        num_classes: output classes.
        widths: channels of each stage.
        blocks_per_stage: basic blocks in each stage.
        in_channels: input image channels.
    """

    def __init__(
        self,
        num_classes: int = 10,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages, channels = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                stride = 2 if i > 0 and j == 0 else 1
                downsample = None
                if stride != 1 or channels != width:
                    downsample = nn.Sequential(
                        nn.Conv2d(channels, width, 1, stride=stride, bias=False),
                        nn.BatchNorm2d(width),
                    )
                stages.append(BasicBlock(channels, width, stride, downsample))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of shape ``(batch, num_classes)``."""
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))
