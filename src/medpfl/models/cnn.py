"""The standard four-layer FL CNN (McMahan et al. 2017, "Communication-efficient learning of
deep networks from decentralized data"), as ``MedMNISTNet`` in the FedKPer code
(``train_tools/models/fedavgnet.py``; protocol Section 1).

Layers for a 28x28 input: Conv(in, 32, 5, pad 2) -> ReLU -> MaxPool 2 -> Conv(32, 64, 5, pad 2)
-> ReLU -> MaxPool 2 -> Flatten (64*7*7 = 3136) -> Linear(3136, 512) -> ReLU ("body" ends
here; 512-d feature) -> ``classifier`` Linear(512, C) ("head"). No BatchNorm, no dropout.
1,663,944 parameters for 3 channels and 8 classes. PyTorch default initialisation.
"""

from __future__ import annotations

import torch
from torch import nn


class CNN4(nn.Module):
    """Input float [B, C, H, W] (normalised), output logits float [B, num_classes]."""

    head_prefix = "classifier."

    def __init__(self, in_channels: int, num_classes: int, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        side = image_size // 4
        self.fc = nn.Linear(64 * side * side, 512)
        self.classifier = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2, 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2, 2)
        return torch.relu(self.fc(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(name: str, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """Build a model by its params name (``train.model``). Raises ValueError for unknown names."""
    if name == "cnn4":
        if image_size % 4:
            raise ValueError(f"train.model=cnn4 needs an image side divisible by 4, got {image_size}")
        return CNN4(in_channels, num_classes, image_size)
    raise ValueError(f"train.model: unknown model {name!r}; known: cnn4")
