"""The five-layer "SimpleCNN" of the PFPS-LWC study (the spec's reading of the paper's
unstated architecture, ``../shared/docs/methods-fedmic-pfpslwc.md`` B.1 and item 16).

The PFPS-LWC paper (Section 4.1) says only "a five-layer CNN; the first four layers are the
feature extractor, the last is the classifier". The reading is the common FL SimpleCNN
(LeNet-5 shaped; McMahan et al. 2017's CIFAR CNN as used by NIID-Bench and FedLab):

  Conv(C, 6, 5) -> [BN] -> ReLU -> MaxPool 2 -> Conv(6, 16, 5) -> [BN] -> ReLU -> MaxPool 2
  -> Flatten (16 * s * s; s = ((S - 4) // 2 - 4) // 2, 5 for 32 px, 4 for 28 px)
  -> Linear(16 s^2, 120) -> ReLU -> Linear(120, 84) -> ReLU        (the body: 84-d feature)
  -> ``classifier`` Linear(84, C)                                  (the head)

``batch_norm=True`` puts BatchNorm after each convolution (conv-BN-ReLU-pool): the paper's
FedBN baseline is far from its FedAvg, which only happens if the network has BatchNorm
(spec B.1), so the PFPS-LWC studies use it for every method. The BatchNorm layers use a mask
of the real samples of a padded stacked batch (:class:`medpfl.models.cnn.MaskedBatchNorm2d`).
The spec's other option, PFLlib's FedAvgCNN (two 5x5 convolutions with 32/64 channels, a
512-unit layer, the classifier), is the zoo's ``cnn4``/``cnn4bn`` up to the convolutions'
padding. PyTorch default initialisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medpfl.models.cnn import MaskedBatchNorm2d, batchnorm_state_names


def simplecnn_side(image_size: int) -> int:
    """The side of the last feature map for ``image_size`` px inputs: ``((S - 4) // 2 - 4) // 2``.

    Raises ValueError when the input is too small for two 5x5 convolutions and two poolings
    (``image_size < 14``)."""
    s = ((int(image_size) - 4) // 2 - 4) // 2
    if s < 1:
        raise ValueError(f"simplecnn needs images of at least 14 px, got {image_size}")
    return s


class SimpleCNN(nn.Module):
    """Input float [B, C, S, S] (normalised), output logits float [B, num_classes].

    ``with_features=True`` returns ``(z, logits)`` with z float [B, 84] (after the ReLU of
    ``fc2``): the feature extractor's output that PFPS-LWC's recall stage compares and FedProto
    averages into prototypes. Parts: ``head`` = ``classifier``; ``body`` = everything else;
    ``bn`` = the BatchNorm layers' parameters and buffers (empty without ``batch_norm``), the
    part FedBN keeps local. ``mask`` (bool [B]) marks the real samples of a padded batch; only
    BatchNorm uses it."""

    head_name = "classifier"

    def __init__(self, in_channels: int, num_classes: int, image_size: int = 32, batch_norm: bool = False):
        super().__init__()
        side = simplecnn_side(image_size)
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5)
        self.bn1 = MaskedBatchNorm2d(6) if batch_norm else None
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.bn2 = MaskedBatchNorm2d(16) if batch_norm else None
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.classifier = nn.Linear(84, num_classes)

    def extra_parts(self) -> dict[str, tuple[str, ...]]:
        """``{"bn": names}``: every parameter and buffer of the BatchNorm layers ``bn1``, ``bn2``
        (:func:`~medpfl.models.cnn.batchnorm_state_names`; empty without ``batch_norm``)."""
        return {"bn": batchnorm_state_names(self)}

    def features(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.conv1(x)
        if self.bn1 is not None:
            x = self.bn1(x, mask)
        x = F.max_pool2d(F.relu(x), 2, 2)
        x = self.conv2(x)
        if self.bn2 is not None:
            x = self.bn2(x, mask)
        x = F.max_pool2d(F.relu(x), 2, 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.relu(self.fc2(x))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        z = self.features(x, mask)
        logits = self.classifier(z)
        return (z, logits) if with_features else logits
