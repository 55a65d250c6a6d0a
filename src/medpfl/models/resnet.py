"""ResNets (He et al. 2016, "Deep residual learning for image recognition") for small medical
images: ``resnet18`` (BasicBlock, [2, 2, 2, 2]), ``resnet101`` (Bottleneck, [3, 4, 23, 3]) and
``resnet18_3d`` (ResNet-18 with 3D convolutions, for MedMNIST 3D volumes). FedMIC's client
model is ResNet101 (``../shared/docs/methods-fedmic-pfpslwc.md`` A.1, A.9).

Layers and names are torchvision's (``conv1``, ``bn1``, ``layer1`` .. ``layer4`` of blocks
``conv1``/``bn1``/``conv2``/``bn2`` [``conv3``/``bn3``] and ``downsample`` = (1x1 conv, BN),
``fc``), so a torchvision state dict maps name for name; the Bottleneck strides in its 3x3
convolution (torchvision's "ResNet v1.5"; the paper strides in the first 1x1 one, same
parameter count). Convolutions have no bias; BatchNorm follows every convolution.

- **Stem** (``stem``): ``small`` (default) is a 3x3 stride-1 convolution and no max pooling, so
  a 64-px image reaches ``layer4`` at 8x8 (28 px: 4x4), the ResNet of MedMNIST's own small-image
  benchmarks and of the CIFAR ResNet-18 of most FL code; ``imagenet`` is He et al.'s 7x7
  stride-2 convolution + 3x3 stride-2 max pooling, which takes a 64-px image to 2x2 at
  ``layer4`` (spec A.9: "the standard stem reduces 64 -> 2x2 at layer4"). The FedMIC paper
  says only "ResNet101 (He et al., 2016)" at 64x64.
- **Input channels.** ``conv1`` takes the data set's channels (1 for grayscale, 3 for RGB, the
  depth D for a MedMNIST 3D volume stored as D slices: spec A.9's reading "depth slices as input
  channels"). Repeating a grayscale image to 3 channels is ``train.transform.channels: 3``.
- **3D** (``resnet18_3d``): the sample ``[C, H, W]`` is read as a one-channel volume
  ``[1, D=C, H, W]``; every convolution, BatchNorm and pooling is 3D (MedMNIST v2's "ResNet-18 +
  3D" baseline reading, spec A.9's OPTION "a 3D ResNet"); the small stem is a 3x3x3 stride-1
  convolution, the imagenet stem 7x7x7 stride 2 + 3x3x3 max pooling stride 2.
- **width**: the base channel count (64 in He et al.): the stages have width, 2, 4 and 8 times
  width channels (times 4 at a Bottleneck's output), so ``width: 16`` is a ResNet-18 that trains
  on a CPU. The features are the globally average-pooled output of ``layer4`` (8 x width for
  BasicBlock, 32 x width for Bottleneck: 512 and 2048 at width 64).
- **BatchNorm** (:class:`medpfl.models.cnn.MaskedBatchNorm2d` / ``3d``): training-mode
  statistics over the real samples of a padded stacked batch only (``mask``); the ``bn`` part
  is every BatchNorm parameter and buffer, found by module type (FedBN keeps it local).
- **Initialisation** (torchvision's, from the run seed): convolutions Kaiming-normal (fan_out,
  ReLU), BatchNorm weight 1 and bias 0, ``fc`` PyTorch's default Linear initialisation.

Parts: ``head`` = ``fc`` (spec A.1: "the head is the final fc layer"); ``body`` = everything
up to and including the global average pooling; ``bn`` as above.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from medpfl.models.cnn import MaskedBatchNorm2d, MaskedBatchNorm3d, batchnorm_state_names

Stem = Literal["small", "imagenet"]


def _conv(dim: int, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0) -> nn.Module:
    cls = nn.Conv2d if dim == 2 else nn.Conv3d
    return cls(cin, cout, kernel_size=k, stride=stride, padding=padding, bias=False)


def _bn(dim: int, c: int) -> nn.Module:
    return MaskedBatchNorm2d(c) if dim == 2 else MaskedBatchNorm3d(c)


def _downsample(dim: int, cin: int, cout: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv(dim, cin, cout, 1, stride), _bn(dim, cout))


def _shortcut(down: nn.Sequential | None, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if down is None else down[1](down[0](x), mask)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (the first with the stride) and the identity, or a 1x1 projection
    when the shape changes."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, dim: int = 2):
        super().__init__()
        self.conv1 = _conv(dim, cin, planes, 3, stride, 1)
        self.bn1 = _bn(dim, planes)
        self.conv2 = _conv(dim, planes, planes, 3, 1, 1)
        self.bn2 = _bn(dim, planes)
        self.downsample = _downsample(dim, cin, planes, stride)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x), mask))
        out = self.bn2(self.conv2(out), mask)
        return F.relu(out + _shortcut(self.downsample, x, mask))


class Bottleneck(nn.Module):
    """1x1 (planes) -> 3x3 (planes, the stride) -> 1x1 (4 x planes), plus the identity or a 1x1
    projection."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, dim: int = 2):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = _conv(dim, cin, planes, 1)
        self.bn1 = _bn(dim, planes)
        self.conv2 = _conv(dim, planes, planes, 3, stride, 1)
        self.bn2 = _bn(dim, planes)
        self.conv3 = _conv(dim, planes, out, 1)
        self.bn3 = _bn(dim, out)
        self.downsample = _downsample(dim, cin, out, stride)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x), mask))
        out = F.relu(self.bn2(self.conv2(out), mask))
        out = self.bn3(self.conv3(out), mask)
        return F.relu(out + _shortcut(self.downsample, x, mask))


class Stage(nn.Sequential):
    """A ResNet stage (``layer1`` .. ``layer4``): blocks in sequence, each given the mask."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self:
            x = block(x, mask)
        return x


#: the blocks and stage depths of the zoo's ResNets
ARCHS: dict[str, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
}


class ResNet(nn.Module):
    """Input float [B, C, H, W] (normalised), output logits float [B, num_classes].

    ``dim=3`` reads each sample as a volume [1, C, H, W] (C = depth) with 3D layers.
    ``with_features=True`` returns ``(z, logits)`` with z float [B, 8·width·expansion] the
    pooled output of ``layer4``. ``mask`` (bool [B]) marks the real samples of a padded batch;
    BatchNorm uses it. Parts: ``head`` = ``fc``, ``body`` = the rest, ``bn`` (:meth:`extra_parts`).
    """

    head_name = "fc"

    def __init__(self, arch: str, in_channels: int, num_classes: int, width: int = 64, stem: Stem = "small",
                 dim: int = 2):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"unknown ResNet {arch!r}; known: {', '.join(ARCHS)}")
        if stem not in ("small", "imagenet"):
            raise ValueError(f"stem must be 'small' or 'imagenet', got {stem!r}")
        block, depths = ARCHS[arch]
        self.dim = dim
        cin = 1 if dim == 3 else in_channels
        if stem == "imagenet":
            self.conv1 = _conv(dim, cin, width, 7, 2, 3)
        else:
            self.conv1 = _conv(dim, cin, width, 3, 1, 1)
        self.bn1 = _bn(dim, width)
        self.maxpool = stem == "imagenet"
        c = width
        for i, depth in enumerate(depths):
            planes = width * 2 ** i
            blocks = []
            for j in range(depth):
                blocks.append(block(c, planes, 2 if (i > 0 and j == 0) else 1, dim))
                c = planes * block.expansion
            setattr(self, f"layer{i + 1}", Stage(*blocks))
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.modules.batchnorm._BatchNorm):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def extra_parts(self) -> dict[str, tuple[str, ...]]:
        """``{"bn": state names}``: the weight, bias, running_mean, running_var and
        num_batches_tracked of every BatchNorm layer (stem, blocks, projections), found by
        module type, in module order (:func:`~medpfl.models.cnn.batchnorm_state_names`)."""
        return {"bn": batchnorm_state_names(self)}

    def features(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.dim == 3:
            x = x.unsqueeze(1)  # [B, D, H, W] -> [B, 1, D, H, W]
        x = F.relu(self.bn1(self.conv1(x), mask))
        if self.maxpool:
            pool = F.max_pool2d if self.dim == 2 else F.max_pool3d
            x = pool(x, kernel_size=3, stride=2, padding=1)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x, mask)
        return x.mean(dim=tuple(range(2, x.dim())))  # global average pooling

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        z = self.features(x, mask)
        logits = self.fc(z)
        return (z, logits) if with_features else logits
