"""The standard four-layer FL CNN (McMahan et al. 2017, "Communication-efficient learning of
deep networks from decentralized data"), as ``MedMNISTNet`` in the FedKPer code
(``train_tools/models/fedavgnet.py``; protocol Section 1).

Layers for a 28x28 input: Conv(in, 32, 5, pad 2) -> ReLU -> MaxPool 2 -> Conv(32, 64, 5, pad 2)
-> ReLU -> MaxPool 2 -> Flatten (64*7*7 = 3136) -> Linear(3136, 512) -> ReLU ("body" ends
here; 512-d feature) -> ``classifier`` Linear(512, C) ("head"). No BatchNorm, no dropout.
1,663,944 parameters for 3 channels and 8 classes. PyTorch default initialisation.

``cnn4bn`` adds BatchNorm after each convolution (before the ReLU), the variant used by
FedBN-style studies. Its BatchNorm takes an optional per-sample mask so that padded samples
of a stacked mini-batch do not enter the batch statistics (:class:`MaskedBatchNorm2d`). The
model declares the part ``bn`` (:meth:`CNN4.extra_parts`): every parameter and buffer of its
BatchNorm layers (empty for ``cnn4``), which FedBN keeps local.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def batchnorm_state_names(module: nn.Module) -> tuple[str, ...]:
    """The state names (the keys of ``module.state_dict()``, e.g. ``layer1.0.bn1.running_mean``)
    of the parameters and buffers of every BatchNorm layer in ``module``: each
    ``nn.modules.batchnorm._BatchNorm`` (found by module type, not by name; the masked ones
    below included), in module order, its parameters (``weight``, ``bias``) then its buffers
    (``running_mean``, ``running_var``, ``num_batches_tracked``); what a layer lacks (no affine,
    no running statistics) is left out. An empty tuple for a model without BatchNorm. The ``bn``
    part the models declare in ``extra_parts`` (FedBN keeps it local)."""
    names = []
    for prefix, mod in module.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for n, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                names.append(f"{prefix}.{n}" if prefix else n)
    return tuple(names)


class _MaskedBatchNorm:
    """Training-mode statistics over the samples where ``mask`` is True (bool [B]), for input
    [B, C, *spatial] of any number of spatial dimensions; mixed into a ``_BatchNorm`` class
    (:class:`MaskedBatchNorm2d`, :class:`MaskedBatchNorm3d`)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None or not self.training:
            return super().forward(x)
        ones = (1,) * (x.dim() - 2)
        dims = (0, *range(2, x.dim()))
        w = mask.to(x.dtype).view(-1, 1, *ones)
        hw = math.prod(x.shape[2:])
        n = w.sum() * hw
        any_valid = (n > 0).to(x.dtype)
        n_safe = torch.clamp(n, min=1.0)
        mean = (x * w).sum(dim=dims) / n_safe
        var = (((x - mean.view(1, -1, *ones)) ** 2) * w).sum(dim=dims) / n_safe
        y = (x - mean.view(1, -1, *ones)) / torch.sqrt(var.view(1, -1, *ones) + self.eps)
        y = y * self.weight.view(1, -1, *ones) + self.bias.view(1, -1, *ones)
        with torch.no_grad():
            m = self.momentum * any_valid
            unbiased = var * n / torch.clamp(n - 1, min=1.0)
            self.running_mean.mul_(1 - m).add_(mean.detach() * m)
            self.running_var.mul_(1 - m).add_(unbiased.detach() * m)
            self.num_batches_tracked.add_(any_valid.to(self.num_batches_tracked.dtype))
        return y


class MaskedBatchNorm2d(_MaskedBatchNorm, nn.BatchNorm2d):
    """``BatchNorm2d`` whose training-mode statistics use only the samples where ``mask`` is
    True (bool [B]). Without a mask it is exactly ``nn.BatchNorm2d``. With a mask: mean and
    biased variance over the valid samples normalise the batch; the running statistics are
    updated with the unbiased variance over ``n = valid samples * H * W`` values, as PyTorch
    does; a batch with no valid sample leaves them (and ``num_batches_tracked``) unchanged.
    Written with tensor operations only, so it runs under ``torch.func.vmap``.
    """


class MaskedBatchNorm3d(_MaskedBatchNorm, nn.BatchNorm3d):
    """:class:`MaskedBatchNorm2d` for volumes [B, C, D, H, W] (``n = valid samples * D * H * W``)."""


class CNN4(nn.Module):
    """Input float [B, C, H, W] (normalised), output logits float [B, num_classes].

    ``mask`` (bool [B], optional) marks the real samples of a padded batch; only BatchNorm
    (``batch_norm=True``) uses it. ``with_features=True`` returns ``(z, logits)`` with z the
    512-d penultimate feature (after the ReLU of ``fc``; the FedNTD/FedKPer code's
    ``get_features`` output, which MOON contrasts). Parts: the head is ``classifier``, the body
    everything else (``head_name``), as FedPer/FedBABU/PFLlib split this CNN; ``extra_parts()``
    adds ``bn``, the BatchNorm layers' parameters and buffers."""

    head_name = "classifier"

    def __init__(self, in_channels: int, num_classes: int, image_size: int = 28, batch_norm: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.bn1 = MaskedBatchNorm2d(32) if batch_norm else None
        self.bn2 = MaskedBatchNorm2d(64) if batch_norm else None
        side = image_size // 4
        self.fc = nn.Linear(64 * side * side, 512)
        self.classifier = nn.Linear(512, num_classes)

    def extra_parts(self) -> dict[str, tuple[str, ...]]:
        """``{"bn": state names}``: the weight, bias, running_mean, running_var and
        num_batches_tracked of every BatchNorm layer, found by module type (not by name), in
        module order (:func:`batchnorm_state_names`); an empty tuple without ``batch_norm``."""
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
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        z = self.features(x, mask)
        logits = self.classifier(z)
        return (z, logits) if with_features else logits

