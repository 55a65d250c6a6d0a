"""Client data resident on the training device.

Images stay uint8 ``[N, C, H, W]`` on the device and are normalised on the fly: by default
``x / 127.5 - 1``, i.e. ``Normalize(0.5, 0.5)`` after ``ToTensor`` (the FedKPer loader's
transform, MedMNIST); with the processed file's ``norm = (mean, std)``, ``(x / 255 - mean) /
std`` in float32 (``ToTensor`` + ``Normalize(mean, std)``; MNIST: 0.1307, 0.3081, the pFedKD-WCL
code). Float samples (Synthetic(alpha, beta) vectors ``[N, d]``) are used as they are. Clients
are index tensors into those arrays (a sample may sit in several clients' tensors). No
DataLoader, no per-sample Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from medpfl.data.preprocess import ProcessedData


@dataclass
class FederatedData:
    """images uint8 [N, C, H, W], labels int64 [N] on ``device``; per client, int64 index
    tensors of its local train and local test samples; the global test set's indices; and
    each client's local train label histogram float [K, C] (client-side information)."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    global_test: torch.Tensor
    client_train: list[torch.Tensor]
    client_test: list[torch.Tensor]
    train_hist: torch.Tensor
    device: torch.device
    norm: tuple[float, float] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    @property
    def in_channels(self) -> int:
        """Channels of an image sample; for vector samples ([N, d]) the number of features d."""
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int | None:
        """The side of an image sample; None for vector samples ([N, d]), which the models
        that flatten their input (``mlr``, ``mlp``) take."""
        return int(self.images.shape[-1]) if self.images.dim() == 4 else None

    def x(self, idx: torch.Tensor) -> torch.Tensor:
        """Normalised float32 samples for indices ``idx`` (int64 [...]) -> [..., C, H, W] (or [..., d]
        for vector data, already float and passed through)."""
        v = self.images[idx]
        if v.is_floating_point():
            return v.to(torch.float32)
        if self.norm is None:
            return v.to(torch.float32) / 127.5 - 1.0
        mean, std = self.norm
        return (v.to(torch.float32) / 255.0 - mean) / std

    @classmethod
    def build(cls, data: ProcessedData, partition: pd.DataFrame, device: torch.device) -> "FederatedData":
        """From preprocessed arrays and a partition table; the global test set is the official test split."""
        k = int(partition["client_id"].max()) + 1
        train, test = [], []
        for cid in range(k):
            rows = partition[partition["client_id"] == cid]
            train.append(torch.tensor(rows.loc[rows["local_split"] == "train", "sample_id"].to_numpy(), device=device))
            test.append(torch.tensor(rows.loc[rows["local_split"] == "test", "sample_id"].to_numpy(), device=device))
        hist = np.stack([np.bincount(data.labels[t.cpu().numpy()], minlength=data.num_classes) for t in train])
        return cls(
            images=torch.as_tensor(data.images, device=device),
            labels=torch.as_tensor(data.labels, device=device),
            num_classes=data.num_classes,
            global_test=torch.tensor(data.split_ids("test"), device=device),
            client_train=train,
            client_test=test,
            train_hist=torch.as_tensor(hist, dtype=torch.float32, device=device),
            device=device,
            norm=data.norm,
        )
