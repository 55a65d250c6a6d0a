"""Client data resident on the training device.

Images stay uint8 ``[N, C, H, W]`` on the device and are normalised on the fly: by default
``x / 127.5 - 1``, i.e. ``Normalize(0.5, 0.5)`` after ``ToTensor`` (the FedKPer loader's
transform, MedMNIST); with the processed file's ``norm = (mean, std)``, ``(x / 255 - mean) /
std`` in float32 (``ToTensor`` + ``Normalize(mean, std)``; MNIST: 0.1307, 0.3081, the pFedKD-WCL
code). ``train.transform`` (:class:`medpfl.config.TransformConfig`) can repeat a 1-channel image
to 3 channels and/or normalise with the ImageNet per-channel statistics, for pretrained
backbones. When the normalised float32 copy of the whole array takes at most
:data:`FLOAT_CACHE_MAX_BYTES` (MNIST's 60k 28x28 images: 188 MB), it is computed once and a
batch is a gather from it; larger arrays are normalised at batch time. Both give the same
values bit for bit (the same float32 arithmetic on the same pixels). The other sample kinds
(``kind``, :data:`medpfl.data.multimodal.KINDS`) are passed through untouched: float32 vectors
``[N, d]`` (Synthetic(alpha, beta)), int64 token ids ``[N, L]`` (never normalised or cast; the
model derives its attention mask from ``pad_token_id``), float32 time series ``[N, C, T]`` and
float32 waveforms ``[N, T]`` (already normalised by preprocessing). Clients are index tensors into
those arrays (a sample may sit in several clients' tensors): local train, local test and, with
the ``ratios`` local rule, local val. No DataLoader, no per-sample Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from medpfl.config import TransformConfig
from medpfl.errors import DataError, ParamsError

if TYPE_CHECKING:  # an annotation only: no pandera (the pipeline's table schemas) on import
    from medpfl.data.preprocess import ProcessedData

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: The largest normalised float32 copy of a data set's images (bytes) that :class:`FederatedData`
#: precomputes; above it, batches are normalised on the fly. Small-model studies (MNIST MLR/MLP)
#: spend about a third of a step normalising the batch otherwise.
FLOAT_CACHE_MAX_BYTES = 1 << 30

#: per sample kind: (sample array ndim, dtype: a torch dtype, or "int" / "float" for any of them)
SAMPLE_LAYOUT = {"image": (4, "int"), "vector": (2, "any"), "tokens": (2, torch.int64),
                 "timeseries": (3, torch.float32), "waveform": (2, torch.float32)}


def infer_sample_kind(images: torch.Tensor) -> str:
    """The kind of samples built without one: integer [N, C, H, W] -> ``image``, [N, d] ->
    ``vector`` (the only kinds before ``kind`` existed; integer vectors are normalised like
    images, float ones passed through, as before). Raises DataError otherwise."""
    if images.dim() == 4 and not images.is_floating_point():
        return "image"
    if images.dim() == 2:
        return "vector"
    raise DataError(f"samples {images.dtype} {list(images.shape)}: give their kind (one of {', '.join(SAMPLE_LAYOUT)})")


@dataclass
class FederatedData:
    """images uint8 [N, C, H, W], labels int64 [N] on ``device``; per client, int64 index
    tensors of its local train, local test and local val samples (``client_val``: an empty
    tensor per client when the partition has no val rows; :attr:`has_val`); the global test
    set's indices (empty when the data set has none or the partition pools every split); and
    each client's local train label histogram float [K, C] (client-side information).

    ``transform`` (None: the default input) is applied in :meth:`x`; :attr:`in_channels` is the
    channel count the model sees (3 when a 1-channel image is repeated).

    ``kind`` (None: inferred, ``image`` or ``vector``) says what ``images`` holds: ``image``
    uint8 [N, C, H, W] (normalised in :meth:`x`), ``vector`` float32 [N, d], ``tokens`` int64
    [N, L] (with ``pad_token_id``), ``timeseries`` float32 [N, C, T], ``waveform`` float32
    [N, T]; all but ``image`` are passed through untouched. :attr:`sample_shape` and
    :attr:`kind` are what :func:`medpfl.models.build_model` builds a model for."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    global_test: torch.Tensor
    client_train: list[torch.Tensor]
    client_test: list[torch.Tensor]
    train_hist: torch.Tensor
    device: torch.device
    norm: tuple[float, float] | None = None
    client_val: list[torch.Tensor] = field(default_factory=list)
    transform: TransformConfig | None = None
    #: int64 [S]: the server's unlabeled samples (``partitions.<name>.server_data``: a held-out
    #: part of the official val split, in no client); empty without server data. Only the
    #: engine reads it, and hands a method the images alone (:class:`ServerData`) when the
    #: method declares ``uses_server_data``.
    server_idx: torch.Tensor | None = None
    #: the samples' kind (None: inferred from ``images``: ``image`` or ``vector``)
    kind: str | None = None
    #: ``tokens`` only: the padding token id (the model's attention mask is ``x != pad_token_id``)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind is None:
            self.kind = infer_sample_kind(self.images)
        if self.kind not in SAMPLE_LAYOUT:
            raise DataError(f"sample kind {self.kind!r} is not one of {', '.join(SAMPLE_LAYOUT)}")
        ndim, dtype = SAMPLE_LAYOUT[self.kind]
        fl = self.images.is_floating_point()
        if self.images.dim() != ndim or (dtype == "int" and fl) or \
                (isinstance(dtype, torch.dtype) and self.images.dtype != dtype):
            want = {"int": "an integer dtype", "any": "any dtype"}.get(dtype, str(dtype))
            raise DataError(f"{self.kind} samples must be {ndim}-D with {want}, got {self.images.dtype} "
                            f"{list(self.images.shape)} (re-run preprocess)")
        if (self.kind == "tokens") != (self.pad_token_id is not None):
            raise DataError(f"pad_token_id={self.pad_token_id} with {self.kind} samples: token ids need it, other "
                            "kinds take none")
        if self.server_idx is None:
            self.server_idx = torch.empty(0, dtype=torch.int64, device=self.device)
        if not self.client_val:
            self.client_val = [torch.empty(0, dtype=torch.int64, device=self.device) for _ in self.client_train]
        if len(self.client_val) != len(self.client_train):
            raise ValueError(f"{len(self.client_val)} client_val tensors for {len(self.client_train)} clients")
        if self.transform is not None and self.transform.is_default():
            self.transform = None
        self._expand = False
        self._imagenet = None
        if self.transform is not None:
            if self.kind != "image":
                raise ParamsError(f"train.transform={self.transform.model_dump()}: applies to image data sets only; "
                                  f"this data set has {self.kind} samples (remove train.transform)")
            c = int(self.images.shape[1])
            self._expand = self.transform.channels == 3 and c == 1
            if self.transform.channels == 3 and c not in (1, 3):
                raise ParamsError(f"train.transform.channels=3: the images have {c} channels; only 1-channel images "
                                  "are repeated to 3")
            if self.transform.normalize == "imagenet":
                if (3 if self._expand else c) != 3:
                    raise ParamsError(f"train.transform.normalize=imagenet needs 3-channel input, the images have {c} "
                                      "channel(s); set train.transform.channels: 3")
                self._imagenet = (torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=self.device).view(3, 1, 1),
                                  torch.tensor(IMAGENET_STD, dtype=torch.float32, device=self.device).view(3, 1, 1))
        self._float: torch.Tensor | None = None
        if self.kind in ("image", "vector") and not self.images.is_floating_point():  # uint8: normalised
            per_sample = self.images[0].numel() * (3 if self._expand else 1) if len(self.images) else 0
            if 4 * per_sample * len(self.images) <= FLOAT_CACHE_MAX_BYTES:
                self._float = self._normalise(self.images)

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    @property
    def has_val(self) -> bool:
        """Whether the partition gives clients local val splits (the ``ratios`` rule with a val
        share); then ``client_val`` holds them (possibly empty for some clients)."""
        return any(v.numel() > 0 for v in self.client_val)

    @property
    def in_channels(self) -> int:
        """Channels of a model input sample (after ``transform``); for vector samples ([N, d])
        the number of features d; for the other kinds ``sample_shape[0]`` (time series: C;
        tokens: L; waveform: T)."""
        return 3 if self._expand else int(self.images.shape[1])

    @property
    def image_size(self) -> int | None:
        """The side of an image sample; None for every other kind (vectors [N, d], which the
        models that flatten their input (``mlr``, ``mlp``) take, tokens, time series, waveforms)."""
        return int(self.images.shape[-1]) if self.kind == "image" else None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One model input sample's shape (after ``transform``): ``(C, H, W)`` image, ``(d,)``
        vector, ``(L,)`` tokens, ``(C, T)`` time series, ``(T,)`` waveform."""
        if self.kind == "image":
            return (self.in_channels, *(int(v) for v in self.images.shape[2:]))
        return tuple(int(v) for v in self.images.shape[1:])

    def x(self, idx: torch.Tensor) -> torch.Tensor:
        """Model inputs for indices ``idx`` (int64 [...]): normalised float32 [..., C, H, W]
        images (C is :attr:`in_channels`); the other kinds as stored, untouched: float32 [..., d]
        vectors, int64 [..., L] token ids, float32 [..., C, T] time series, float32 [..., T]
        waveforms. A new tensor (never a view of the stored arrays)."""
        src = self._float if self._float is not None else self.images
        v = src.index_select(0, idx.reshape(-1)).view(*idx.shape, *src.shape[1:])
        if self._float is not None or self.kind not in ("image", "vector") or v.dtype == torch.float32:
            return v  # token ids stay int64, never normalised; time series and waveforms as stored
        if v.is_floating_point():  # vectors of another float dtype given directly: float32, as before
            return v.to(torch.float32)
        return self._normalise(v)

    def _normalise(self, v: torch.Tensor) -> torch.Tensor:
        """uint8 images [..., C, H, W] -> the model's float32 input (:attr:`transform`, else the
        data set's normalisation; see the module docstring)."""
        f = v.to(torch.float32)
        if self._expand:  # grayscale -> 3 channels (a broadcast view; the arithmetic below copies)
            f = f.expand(*f.shape[:-3], 3, *f.shape[-2:])
        if self._imagenet is not None:
            mean, std = self._imagenet
            return (f / 255.0 - mean) / std
        if self.norm is None:
            return f / 127.5 - 1.0
        mean, std = self.norm
        return (f / 255.0 - mean) / std

    @classmethod
    def build(cls, data: ProcessedData, partition: pd.DataFrame, device: torch.device, pool: str = "train",
              transform: TransformConfig | None = None) -> "FederatedData":
        """From preprocessed arrays and a partition table.

        pool: the partition's ``pool``. ``train``: the global test set is the official test
        split; no client may then train or validate on a test-split sample (a table built with
        ``pool: all`` stops here with an error). ``all``: every split was partitioned, so there
        is no global test set (an empty ``global_test``).
        transform: ``train.transform`` (None or the default: the data set's own normalisation)."""
        if pool not in ("train", "all"):
            raise ParamsError(f"partition pool must be 'train' or 'all', got {pool!r}")
        k = int(partition["client_id"].max()) + 1
        split_ids = {}
        for s in ("train", "test", "val"):
            split_ids[s] = [torch.tensor(rows.loc[rows["local_split"] == s, "sample_id"].to_numpy(), device=device,
                                         dtype=torch.int64)
                            for rows in (partition[partition["client_id"] == cid] for cid in range(k))]
        train = split_ids["train"]
        server = partition.loc[partition["local_split"] == "server", "sample_id"].to_numpy()
        if len(server):
            mine = partition.loc[partition["local_split"] != "server", "sample_id"].to_numpy()
            both = np.intersect1d(server, mine)
            if len(both):
                raise ParamsError(f"the partition table gives {len(both)} server samples (e.g. id {both[0]}) to "
                                  "clients as well; server data must stay out of every client (re-run the "
                                  "partition stage)")
        hist = np.stack([np.bincount(data.labels[t.cpu().numpy()], minlength=data.num_classes) for t in train])
        if pool == "all":
            global_test = np.array([], dtype=np.int64)
        else:
            global_test = data.split_ids("test")
            fitted = partition.loc[partition["local_split"].isin(["train", "val"]), "sample_id"].to_numpy()
            clash = np.intersect1d(global_test, fitted)
            if len(clash):
                raise ParamsError(f"the partition table puts {len(clash)} official test samples (e.g. id {clash[0]}) "
                                  "in clients' local train/val splits, so they cannot be the global test set: it was "
                                  "built with pool: all, but the training job says pool train (re-run the partition "
                                  "and train stages with the same params)")
        return cls(
            images=torch.as_tensor(data.images, device=device),
            labels=torch.as_tensor(data.labels, device=device),
            num_classes=data.num_classes,
            global_test=torch.tensor(global_test, device=device, dtype=torch.int64),
            client_train=train,
            client_test=split_ids["test"],
            train_hist=torch.as_tensor(hist, dtype=torch.float32, device=device),
            device=device,
            norm=data.norm,
            client_val=split_ids["val"],
            transform=transform,
            server_idx=torch.tensor(server, device=device, dtype=torch.int64),
            kind=getattr(data, "kind", None),
            pad_token_id=getattr(data, "pad_token_id", None),
        )

    @property
    def has_server_data(self) -> bool:
        """Whether the partition holds unlabeled server data (:attr:`server_idx`)."""
        return self.server_idx.numel() > 0


class ServerData:
    """The server's unlabeled data as a method sees it (``Algorithm.server_data``): images only,
    never labels. ``len`` is the number of samples S; :meth:`x` the normalised inputs (as the
    clients' batches, :meth:`FederatedData.x`) of positions ``pos`` (int64 [...], in [0, S))."""

    def __init__(self, data: FederatedData):
        self._x = data.x
        self._idx = data.server_idx
        self.device = data.device

    def __len__(self) -> int:
        return int(self._idx.numel())

    def x(self, pos: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [..., C, H, W] (or [..., d]) of the server samples at ``pos`` (all of them, in
        the table's order, when None)."""
        return self._x(self._idx if pos is None else self._idx[pos.to(self._idx.device)])
