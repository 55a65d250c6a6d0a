"""Preprocess: an official raw file into one compact array file and a sample table.

Output ``<out>.npz`` holds ``images`` and ``labels`` (int64, ``[N]``) in the order train, val,
test, ``num_classes`` and, when the data set has label names (MedMNIST's
``medmnist.INFO[flag]["label"]``, MNIST's digits, the CIFAR archives' meta files),
``class_names`` (str ``[C]``);
``<out>.samples.parquet`` holds one row per sample (``sample_id`` =
row in the arrays, ``split``, ``index_in_split``, ``label``), validated by
:class:`medpfl.data.schemas.SampleTable`. Raw layouts (``DatasetSpec.layout``):

- ``medmnist``: ``{train,val,test}_{images,labels}``; images uint8 ``[N, C, H, W]``.
- ``medmnist3d`` (the MedMNIST 3D flags, ``organmnist3d``, ``organmnist3d_64``, ...): the same
  keys; the official volumes are uint8 ``[N, D, H, W]`` (no channel axis) and are stored as they
  are, so the depth axis is the channel axis of the stored sample ``[N, C=D, H, W]`` (``n_channels``
  is the depth): a 2D model reads the D slices as input channels (FedMIC spec A.9's reading), a
  3D model (``resnet18_3d``) views a sample as the one-channel volume ``[1, D, H, W]``. Values
  are not rescaled: the default ``Normalize(0.5, 0.5)`` applies, as MedMNIST3D's own ``img / 255``.
- ``keras`` (MNIST): ``x_train``, ``y_train``, ``x_test``, ``y_test``; images uint8
  ``[N, 1, H, W]``, splits train and test (no val). The pFedKD-WCL study partitions only the
  train split (the 60,000 training images), as every partition does.
- ``cifar10`` / ``cifar100``: the official python ``.tar.gz`` (:func:`load_cifar_archive`);
  images uint8 ``[N, 3, 32, 32]`` (the archive's R, G, B planes, each row-major), splits train
  (50,000) and test (10,000, the global test set), no val; CIFAR-100 keeps its 100 fine labels.
  Class names come from the archive's meta file.
- ``synthetic`` (:mod:`medpfl.data.fedprox_synthetic`): vector samples, ``images`` float32
  ``[N, d]`` (not normalised); every sample is in the train split (there is no global test
  set), and the table adds ``natural_client`` and ``natural_split`` (the generator's clients
  and local splits, for the ``natural`` partition scheme).

- ``folder`` (the folder data sets of :mod:`medpfl.data.multimodal`: ``ptbxl``, ...): the raw
  file is the download stage's manifest; :func:`preprocess_folder` checks it, calls the data
  set's reader on the official root and writes ``images`` = the reader's ``x`` (float32
  ``[N, C, T]`` time series, float32 ``[N, T]`` waveforms, or int64 ``[N, L]`` token ids tokenised
  here), ``kind``, ``class_names`` and, for tokens, ``pad_token_id``; the table adds
  ``subject_id`` where the reader gives one and keeps its official ``split`` (else all ``train``).

Both files are written deterministically (:func:`medpfl.io.write_npz`,
:func:`medpfl.io.write_parquet`): the same raw file gives the same bytes on any machine.

``norm`` = ``(mean, std)`` is stored as ``norm_mean`` / ``norm_std`` when given: uint8 images
are then normalised as ``ToTensor()`` + ``Normalize(mean, std)`` (MNIST: 0.1307, 0.3081);
without it, as ``Normalize(0.5, 0.5)`` (``medpfl.fl.data.FederatedData.x``). CIFAR-10/100
store no norm: the PFPS-LWC paper states no normalisation, and ``Normalize(0.5, 0.5)`` on every
channel is the CIFAR transform of PFLlib (``dataset/generate_Cifar10.py``), the library that
has all of that paper's baselines; the common per-channel statistics (0.4914, 0.4822, 0.4465)
/ (0.2470, 0.2435, 0.2616) would need a per-channel norm the training stage does not have.

Errors: :class:`medpfl.data.sources.DataError` naming the file for a truncated or unreadable
file, missing keys, wrong shapes or dtypes, labels outside ``[0, num_classes)``, NaN images.
"""

from __future__ import annotations

import importlib
import os
import pickle
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from medpfl.data.multimodal import KINDS, FolderDataset
from medpfl.data.schemas import SPLITS, SampleTable, validate
from medpfl.data.sources import DataError, check_manifest
from medpfl.errors import MissingWeightsError
from medpfl.io import write_npz, write_parquet

SPLIT_ORDER = ("train", "val", "test")


def load_official_npz(path: str | Path, num_classes: int, n_channels: int,
                      volume: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read and check ``{split}_images`` / ``{split}_labels`` for train, val and test.

    Returns ``{split: (images uint8 [n, C, H, W], labels int64 [n])}``. ``volume``: the MedMNIST
    3D layout, images ``[n, D, H, W]`` kept as they are (``n_channels`` is then the depth D).
    """
    path = Path(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npz file ({e}); delete it and re-run the download stage") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: a single .npy array, not an .npz archive; expected the official MedMNIST layout")
    with npz:
        return _read_splits(npz, path, num_classes, n_channels, volume)


def _read_splits(npz, path: Path, num_classes: int, n_channels: int,
                 volume: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    keys = set(npz.files)
    out = {}
    for split in SPLIT_ORDER:
        ik, lk = f"{split}_images", f"{split}_labels"
        missing = {ik, lk} - keys
        if missing:
            raise DataError(f"{path}: missing arrays {sorted(missing)}; expected the official MedMNIST layout "
                            "(train/val/test _images and _labels)")
        try:
            x = npz[ik]
            y = npz[lk]
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise DataError(f"{path}: array {ik}/{lk} is truncated or corrupt ({e})") from None
        x = _volumes_ndhw(x, path, ik, n_channels) if volume else _images_nchw(x, path, ik, n_channels)
        y = _labels(y, path, lk, len(x), num_classes)
        out[split] = (x, y)
    shapes = {s: out[s][0].shape[1:] for s in SPLIT_ORDER}
    if len(set(shapes.values())) != 1:
        raise DataError(f"{path}: image shapes differ between splits: {shapes}")
    return out


def _images_nchw(x: np.ndarray, path: Path, key: str, n_channels: int) -> np.ndarray:
    if x.ndim == 3:  # grey-scale (N, H, W)
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3):  # official (N, H, W, C)
        x = np.moveaxis(x, -1, 1)
    else:
        raise DataError(f"{path}: {key} has shape {x.shape}; expected (N, H, W) or (N, H, W, C) with C in 1, 3")
    if x.shape[1] != n_channels:
        raise DataError(f"{path}: {key} has {x.shape[1]} channels; the data set's metadata says {n_channels}")
    return _uint8(x, path, key)


def _volumes_ndhw(x: np.ndarray, path: Path, key: str, depth: int) -> np.ndarray:
    """A MedMNIST 3D split: uint8 [N, D, H, W] as it is (the depth axis becomes the channel axis)."""
    if x.ndim != 4:
        raise DataError(f"{path}: {key} has shape {x.shape}; expected 3D volumes (N, D, H, W) (the official "
                        "MedMNIST 3D layout, no channel axis)")
    if x.shape[1] != depth:
        raise DataError(f"{path}: {key} has volumes of depth {x.shape[1]}; the data set's metadata says {depth}")
    return _uint8(x, path, key)


def _uint8(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    if x.shape[0] == 0:
        raise DataError(f"{path}: {key} is empty")
    if x.dtype != np.uint8:
        xf = x.astype(np.float64)
        if np.isnan(xf).any():
            raise DataError(f"{path}: {key} contains NaN values")
        if xf.min() < 0 or xf.max() > 255 or not np.array_equal(xf, np.round(xf)):
            raise DataError(f"{path}: {key} has dtype {x.dtype} with values outside the integers 0..255")
        x = xf.astype(np.uint8)
    return np.ascontiguousarray(x)


def _labels(y: np.ndarray, path: Path, key: str, n: int, num_classes: int) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{path}: {key} has shape {y.shape}; expected (N,) or (N, 1) (multi-label sets are not supported)")
    if len(y) != n:
        raise DataError(f"{path}: {key} has {len(y)} labels for {n} images")
    if not np.issubdtype(y.dtype, np.integer):
        yf = y.astype(np.float64)
        if np.isnan(yf).any() or not np.array_equal(yf, np.round(yf)):
            raise DataError(f"{path}: {key} must hold integer class labels, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= num_classes:
        raise DataError(f"{path}: {key} has labels in [{y.min()}, {y.max()}]; expected 0..{num_classes - 1}")
    return y


def _open_npz(path: Path, layout: str):
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npz file ({e}); delete it and re-run the download stage") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: a single .npy array, not an .npz archive; expected the {layout} layout")
    return npz


def _array(npz, path: Path, key: str, layout: str) -> np.ndarray:
    if key not in npz.files:
        raise DataError(f"{path}: missing array {key!r}; expected the {layout} layout ({', '.join(LAYOUT_KEYS[layout])})")
    try:
        return npz[key]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: array {key} is truncated or corrupt ({e})") from None


LAYOUT_KEYS = {
    "keras": ("x_train", "y_train", "x_test", "y_test"),
    "synthetic": ("features", "labels", "client_id", "local_split"),
}


def load_keras_npz(path: str | Path, num_classes: int, n_channels: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read and check a Keras-layout MNIST file: ``{"train": (uint8 [n, 1, H, W], int64 [n]),
    "test": (...)}``."""
    path = Path(path)
    with _open_npz(path, "keras") as npz:
        out = {}
        for split in ("train", "test"):
            x = _images_nchw(_array(npz, path, f"x_{split}", "keras"), path, f"x_{split}", n_channels)
            y = _labels(_array(npz, path, f"y_{split}", "keras"), path, f"y_{split}", len(x), num_classes)
            out[split] = (x, y)
    if out["train"][0].shape[1:] != out["test"][0].shape[1:]:
        raise DataError(f"{path}: image shapes differ between x_train and x_test")
    return out


def load_synthetic_npz(path: str | Path, num_classes: int, dimension: int) -> dict[str, np.ndarray]:
    """Read and check a generated Synthetic(alpha, beta) file: ``features`` float32 [N, d],
    ``labels`` int64, ``client_id`` int64 (0..K-1, each client non-empty), ``local_split`` uint8
    (0 train, 1 test)."""
    path = Path(path)
    with _open_npz(path, "synthetic") as npz:
        a = {k: _array(npz, path, k, "synthetic") for k in LAYOUT_KEYS["synthetic"]}
    x = a["features"]
    if x.ndim != 2 or x.shape[1] != dimension or x.shape[0] == 0:
        raise DataError(f"{path}: features has shape {x.shape}; expected (N, {dimension}) with N > 0")
    if not np.issubdtype(x.dtype, np.floating) or not np.isfinite(x).all():
        raise DataError(f"{path}: features must be finite floats, got dtype {x.dtype}")
    y = _labels(a["labels"], path, "labels", len(x), num_classes)
    cid, split = a["client_id"], a["local_split"]
    if cid.shape != (len(x),) or split.shape != (len(x),):
        raise DataError(f"{path}: client_id {cid.shape} and local_split {split.shape} must have shape ({len(x)},)")
    if not np.issubdtype(cid.dtype, np.integer) or cid.min() < 0 or len(np.unique(cid)) != cid.max() + 1:
        raise DataError(f"{path}: client_id must hold the integers 0..K-1, each at least once")
    if not np.isin(split, (0, 1)).all():
        raise DataError(f"{path}: local_split must hold 0 (train) or 1 (test)")
    return {"features": x.astype(np.float32), "labels": y, "client_id": cid.astype(np.int64),
            "local_split": split.astype(np.uint8)}


# The official python archives (https://www.cs.toronto.edu/~kriz/cifar.html): pickled dicts
# with bytes keys; b"data" a uint8 [n, 3072] array (1024 red, 1024 green, 1024 blue values, each
# plane row-major), the labels a list of ints.
CIFAR_LAYOUTS = {
    "cifar10": {"folder": "cifar-10-batches-py", "train": [f"data_batch_{i}" for i in range(1, 6)],
                "test": ["test_batch"], "labels": b"labels", "meta": "batches.meta", "names": b"label_names"},
    "cifar100": {"folder": "cifar-100-python", "train": ["train"], "test": ["test"], "labels": b"fine_labels",
                 "meta": "meta", "names": b"fine_label_names"},
}
CIFAR_SIDE = 32

# The only globals an official batch pickle (written by Python 2 with numpy 1.x) or a re-pickled
# one (numpy 2, protocols 2 to 5) refers to: numpy's array reconstruction and the bytes codec.
# Anything else is refused, so a doctored archive cannot run code when it is unpickled.
_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("_codecs", "encode"): ("_codecs", "encode"),
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        target = _PICKLE_GLOBALS.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of a CIFAR batch)")
        return super().find_class(*target)


def _read_member(tf: tarfile.TarFile, path: Path, member: str) -> dict:
    try:
        f = tf.extractfile(member)
    except KeyError:
        raise DataError(f"{path}: missing {member}; expected the official CIFAR python archive layout") from None
    if f is None:
        raise DataError(f"{path}: {member} is not a regular file")
    try:
        with f:
            obj = _BatchUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, OSError, zlib.error, tarfile.TarError, ValueError, TypeError,
            AttributeError, ImportError, IndexError) as e:
        raise DataError(f"{path}: {member} is not a readable CIFAR batch pickle ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: {member} holds a {type(obj).__name__}, expected a dict")
    return obj


def _cifar_batch(obj: dict, path: Path, member: str, label_key: bytes,
                 num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    for key in (b"data", label_key):
        if key not in obj:
            raise DataError(f"{path}: {member} has no {key!r} entry (keys: {sorted(obj)})")
    x = obj[b"data"]
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * CIFAR_SIDE ** 2:
        desc = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise DataError(f"{path}: {member} b'data' is {desc}; expected uint8 (n, {3 * CIFAR_SIDE ** 2})")
    if len(x) == 0:
        raise DataError(f"{path}: {member} holds no images")
    y = _labels(np.asarray(obj[label_key]), path, f"{member} {label_key!r}", len(x), num_classes)
    return np.ascontiguousarray(x.reshape(len(x), 3, CIFAR_SIDE, CIFAR_SIDE)), y


def load_cifar_archive(path: str | Path, num_classes: int, layout: str
                       ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[str, ...]]:
    """Read an official CIFAR python archive without extracting it (no torchvision).

    layout ``cifar10``: ``cifar-10-batches-py/data_batch_1`` .. ``data_batch_5`` (train, in that
    order), ``test_batch``, ``batches.meta`` (``b"label_names"``); labels ``b"labels"``.
    layout ``cifar100``: ``cifar-100-python/train``, ``test``, ``meta``
    (``b"fine_label_names"``); labels ``b"fine_labels"`` (the 100 fine classes; the 20 coarse
    ones are not used).
    Each batch holds ``b"data"`` uint8 ``[n, 3072]``: the red, green and blue 32x32 planes, each
    row-major, so a reshape to ``[n, 3, 32, 32]`` is channel-first without moving any value.

    Returns ``({"train": (uint8 [n, 3, 32, 32], int64 [n]), "test": (...)}, class names [C])``.
    Raises DataError naming the file (and member) for an unreadable archive, a missing member,
    a batch that is not the official dict, wrong shapes or dtypes, labels outside
    ``[0, num_classes)`` or a wrong number of class names. Pickles are loaded with an allow-list
    of numpy's array globals only.
    """
    path = Path(path)
    if layout not in CIFAR_LAYOUTS:
        raise DataError(f"{path}: unknown CIFAR layout {layout!r} ({', '.join(CIFAR_LAYOUTS)})")
    lay = CIFAR_LAYOUTS[layout]
    try:
        tf = tarfile.open(path, "r:gz")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable .tar.gz archive ({e}); delete it and re-run the download "
                        "stage") from None
    out = {}
    try:
        with tf:
            for split in ("train", "test"):
                parts = []
                for m in lay[split]:
                    member = f"{lay['folder']}/{m}"
                    parts.append(_cifar_batch(_read_member(tf, path, member), path, member, lay["labels"], num_classes))
                out[split] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
            meta_member = f"{lay['folder']}/{lay['meta']}"
            meta = _read_member(tf, path, meta_member)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:  # a truncated gzip stream
        raise DataError(f"{path}: truncated or corrupt archive ({e}); delete it and re-run the download "
                        "stage") from None
    names = meta.get(lay["names"])
    if not isinstance(names, (list, tuple)) or len(names) != num_classes:
        got = len(names) if isinstance(names, (list, tuple)) else "no"
        raise DataError(f"{path}: {meta_member} has {got} {lay['names']!r} entries; expected {num_classes}")
    names = tuple(n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names)
    return out, names


@dataclass
class ProcessedData:
    """A preprocessed data set in memory: ``images`` the samples of ``kind``
    (:data:`medpfl.data.multimodal.KINDS`): uint8 [N, C, H, W] (``image``), float32 [N, d]
    (``vector``), int64 [N, L] token ids (``tokens``), float32 [N, C, T] (``timeseries``) or
    float32 [N, T] (``waveform``); ``labels`` int64 [N]; ``norm`` the images' ``(mean, std)``
    after ToTensor (None: ``Normalize(0.5, 0.5)``; images only); ``pad_token_id`` the token id
    of padding (``tokens`` only: a model's attention mask is ``input_ids != pad_token_id``)."""

    images: np.ndarray
    labels: np.ndarray
    samples: pd.DataFrame
    num_classes: int
    norm: tuple[float, float] | None = None
    class_names: tuple[str, ...] | None = None  # label names by class index (None: unnamed)
    kind: str = "image"
    pad_token_id: int | None = None

    def split_ids(self, split: str) -> np.ndarray:
        return self.samples.loc[self.samples["split"] == split, "sample_id"].to_numpy()


def preprocess(raw: str | Path, out_arrays: str | Path, out_samples: str | Path, num_classes: int, n_channels: int,
               layout: str = "medmnist", norm: tuple[float, float] | None = None,
               class_names: Sequence[str] | None = None) -> pd.DataFrame:
    """Write the compact array file and the validated sample table; return the table.

    layout: ``medmnist`` | ``medmnist3d`` | ``keras`` | ``cifar10`` | ``cifar100`` | ``synthetic``
    (for ``synthetic``, ``n_channels`` is the feature dimension d; for ``medmnist3d`` the
    volumes' depth). norm: stored for uint8 images
    (see the module docstring).
    class_names: the label names by class index (``num_classes`` of them), stored as
    ``class_names``; None stores none (the class index names the class), except for the CIFAR
    layouts, whose archive's meta file names the classes.
    """
    if layout in CIFAR_LAYOUTS:
        if n_channels != 3:
            raise DataError(f"{raw}: CIFAR images have 3 channels; the data set's metadata says {n_channels}")
        cifar_parts, archive_names = load_cifar_archive(raw, num_classes, layout)
        class_names = archive_names if class_names is None else class_names
    extra: dict[str, np.ndarray] = {}
    if class_names is not None:
        if len(class_names) != num_classes:
            raise DataError(f"{raw}: {len(class_names)} class names for {num_classes} classes")
        extra["class_names"] = np.array([str(c) for c in class_names], dtype=str)
    if layout == "synthetic":
        g = load_synthetic_npz(raw, num_classes, n_channels)
        images, labels = g["features"], g["labels"]
        samples = pd.DataFrame({
            "sample_id": np.arange(len(labels), dtype=np.int64),
            "split": "train",
            "index_in_split": np.arange(len(labels), dtype=np.int64),
            "label": labels,
            "natural_client": g["client_id"],
            "natural_split": np.where(g["local_split"] == 0, "train", "test"),
        })
    else:
        if layout == "keras":
            parts = load_keras_npz(raw, num_classes, n_channels)
        elif layout in ("medmnist", "medmnist3d"):
            parts = load_official_npz(raw, num_classes, n_channels, volume=layout == "medmnist3d")
        elif layout in CIFAR_LAYOUTS:
            parts = cifar_parts
        else:
            raise DataError(f"{raw}: unknown raw layout {layout!r} (medmnist, medmnist3d, keras, cifar10, cifar100, "
                            "synthetic)")
        order = [s for s in SPLIT_ORDER if s in parts]
        images = np.concatenate([parts[s][0] for s in order])
        labels = np.concatenate([parts[s][1] for s in order])
        samples = pd.DataFrame({
            "sample_id": np.arange(len(labels), dtype=np.int64),
            "split": np.concatenate([[s] * len(parts[s][1]) for s in order]),
            "index_in_split": np.concatenate([np.arange(len(parts[s][1])) for s in order]),
            "label": labels,
        })
        if norm is not None:
            mean, std = (float(v) for v in norm)
            if not std > 0:
                raise DataError(f"{raw}: normalisation std must be > 0, got {std}")
            extra |= {"norm_mean": np.float64(mean), "norm_std": np.float64(std)}
    samples = validate(SampleTable, samples, str(out_samples))
    write_npz(out_arrays, {"images": images, "labels": labels, "num_classes": np.int64(num_classes), **extra})
    write_parquet(out_samples, samples)
    return samples


def load_processed(arrays: str | Path, samples: str | Path) -> ProcessedData:
    """Load the preprocessed arrays and sample table, checking they agree."""
    from medpfl.io import read_parquet

    arrays = Path(arrays)
    try:
        with np.load(arrays, allow_pickle=False) as z:
            images, labels, num_classes = z["images"], z["labels"], int(z["num_classes"])
            norm = (float(z["norm_mean"]), float(z["norm_std"])) if "norm_mean" in z.files else None
            names = tuple(str(c) for c in z["class_names"]) if "class_names" in z.files else None
            kind = str(z["kind"]) if "kind" in z.files else None
            pad = int(z["pad_token_id"]) if "pad_token_id" in z.files else None
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as e:
        raise DataError(f"{arrays}: unreadable processed array file ({e}); delete it and re-run preprocess") from None
    kind = kind or infer_kind(images, arrays)
    if kind not in KINDS:
        raise DataError(f"{arrays}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "tokens" and pad is None:
        raise DataError(f"{arrays}: token ids without pad_token_id (re-run preprocess)")
    table = validate(SampleTable, read_parquet(samples), str(samples))
    if len(table) != len(labels) or not np.array_equal(table["label"].to_numpy(), labels):
        raise DataError(f"{samples}: sample table does not match {arrays} (re-run preprocess)")
    return ProcessedData(images=images, labels=labels, samples=table, num_classes=num_classes, norm=norm,
                         class_names=names, kind=kind, pad_token_id=pad)


def infer_kind(images: np.ndarray, path: str | Path = "<arrays>") -> str:
    """The kind of a processed file written before ``kind`` was stored (MedMNIST, MNIST, CIFAR:
    integer [N, C, H, W] -> ``image``; Synthetic(alpha, beta): float [N, d] -> ``vector``). Such
    files keep their bytes: only folder data sets store ``kind``. Raises DataError otherwise."""
    if images.ndim == 4 and not np.issubdtype(images.dtype, np.floating):
        return "image"
    if images.ndim == 2 and np.issubdtype(images.dtype, np.floating):
        return "vector"
    raise DataError(f"{path}: images {images.dtype} {list(images.shape)} without a stored kind; expected uint8 "
                    "[N, C, H, W] or float [N, d] (re-run preprocess)")


#: per folder kind: (ndim of the sample array, dtype stored)
FOLDER_SAMPLE_LAYOUT = {"tokens": (2, np.int64), "timeseries": (3, np.float32), "waveform": (2, np.float32)}


def _folder_samples(x, entry: FolderDataset, n: int, origin: str) -> np.ndarray:
    """Check a reader's (or the tokeniser's) ``x`` against ``entry.kind``: tokens integer [N, L]
    (>= 0) -> int64; timeseries floating [N, C, T] and waveform floating [N, T] -> float32,
    finite. Raises DataError naming ``origin``."""
    ndim, dtype = FOLDER_SAMPLE_LAYOUT[entry.kind]
    shape_txt = {"tokens": "[N, L]", "timeseries": "[N, C, T]", "waveform": "[N, T]"}[entry.kind]
    if not isinstance(x, np.ndarray):
        raise DataError(f"{origin}: the reader gave {type(x).__name__} samples; a {entry.kind} data set needs a numpy "
                        f"array {shape_txt}")
    if x.ndim != ndim or len(x) != n or n == 0 or 0 in x.shape:
        raise DataError(f"{origin}: samples of shape {list(x.shape)} for {n} table rows; a {entry.kind} data set "
                        f"needs {shape_txt} with N = {n} > 0")
    if entry.kind == "tokens":
        if not np.issubdtype(x.dtype, np.integer) or (x < 0).any():
            raise DataError(f"{origin}: token ids must be non-negative integers, got dtype {x.dtype}")
    else:
        if not np.issubdtype(x.dtype, np.floating):
            raise DataError(f"{origin}: {entry.kind} samples must be floating point, got dtype {x.dtype}")
        if not np.isfinite(x).all():
            raise DataError(f"{origin}: {entry.kind} samples hold NaN or infinite values")
    return np.ascontiguousarray(x, dtype=dtype)


def load_tokenizer(name: str, key: str):
    """``transformers.AutoTokenizer.from_pretrained(name, local_files_only=<offline>)`` (offline:
    ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set to a true value). Raises
    MissingWeightsError naming ``key`` (``data.multimodal.<name>.tokenizer``) when it cannot be
    loaded (offline without a cache, an unknown name, a folder without tokenizer files)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy, text data sets only

    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except (OSError, ValueError) as e:
        where = "offline, not in the Hugging Face cache" if offline else "not found"
        raise MissingWeightsError(f"{key}={name!r}: tokenizer {where} ({str(e).splitlines()[0]}); download it once "
                                  "with network access or give a local folder") from None


def preprocess_folder(manifest: str | Path, out_arrays: str | Path, out_samples: str | Path, entry: FolderDataset,
                      options: dict | None = None, verify: str = "size") -> pd.DataFrame:
    """The preprocess stage of a folder data set: write the compact array file and the validated
    sample table from the official root named by the download stage's ``manifest``; return the table.

    1. The manifest is checked against the root (:func:`medpfl.data.sources.check_manifest`:
       every file at its recorded size; ``verify="sha256"`` re-hashes them all).
    2. The reader ``medpfl.data.<entry.module>.<entry.reader>(root[, limit=options["limit"]])``
       (:mod:`medpfl.data.multimodal`, the reader contract) gives ``x``, ``table`` and
       ``class_names`` (which must equal the registry's).
    3. ``tokens``: ``table["text"]`` is tokenised with the reader module's ``tokenize(texts,
       tokenizer, max_length)``; the tokenizer is ``options["tokenizer"]`` or the registry's
       default, loaded by the module's ``load_tokenizer(name)`` if it has one, else
       :func:`load_tokenizer`; ``max_length`` likewise (default 512). ``pad_token_id`` is stored.
    4. Written: ``<out_arrays>`` with ``images`` (the samples, :data:`FOLDER_SAMPLE_LAYOUT`),
       ``labels`` int64 [N], ``num_classes``, ``class_names``, ``kind`` (and ``pad_token_id``);
       ``<out_samples>`` with ``sample_id`` (= row, the reader's order), ``split`` (the reader's
       official ``split`` if it gives one, else ``train`` for every row: the data set then has no
       global test set, as Synthetic(alpha, beta)), ``index_in_split``, ``label``
       and ``subject_id`` (int64) where the reader gives one.

    ``options``: the data set's ``data.multimodal.<name>`` keys (``tokenizer``, ``max_length``,
    ``limit``). Raises DataError naming the manifest, the file or the reader's output that is
    wrong; MissingWeightsError for a tokenizer that cannot be loaded.
    """
    options = dict(options or {})
    key = f"data.multimodal.{entry.name}"
    root, _ = check_manifest(manifest, entry.name, verify)
    module = importlib.import_module(f"medpfl.data.{entry.module}")
    reader = getattr(module, entry.reader, None)
    if reader is None:
        raise DataError(f"medpfl.data.{entry.module} has no reader {entry.reader!r} (the registry entry of "
                        f"{entry.name} in medpfl.data.multimodal)")
    kwargs = {"limit": int(options["limit"])} if options.get("limit") is not None else {}
    res = reader(root, **kwargs)
    origin = f"{entry.module}.{entry.reader}({root})"
    table = getattr(res, "table", None)
    if not isinstance(table, pd.DataFrame) or "label" not in table.columns:
        raise DataError(f"{origin}: the reader's table is missing or has no label column")
    table = table.reset_index(drop=True)
    n = len(table)
    names = getattr(res, "class_names", None)
    if names is not None and tuple(str(c) for c in names) != entry.class_names:
        raise DataError(f"{origin}: class names {tuple(names)} differ from the registry's {entry.class_names}")
    if "sample_id" in table.columns and not np.array_equal(table["sample_id"].to_numpy(), np.arange(n)):
        raise DataError(f"{origin}: sample_id must be 0..N-1 in row order")
    extra: dict[str, np.ndarray] = {}
    x = getattr(res, "x", None)
    if entry.kind == "tokens":
        if "text" not in table.columns:
            raise DataError(f"{origin}: a text data set's table needs a text column")
        name = options.get("tokenizer") or entry.tokenizer
        if not name:
            raise DataError(f"{key}.tokenizer: {entry.name} has no default tokenizer; name one")
        loader = getattr(module, "load_tokenizer", None)
        tok = loader(name) if loader is not None else load_tokenizer(name, f"{key}.tokenizer")
        tokenize = getattr(module, "tokenize", None)
        if tokenize is None:
            raise DataError(f"medpfl.data.{entry.module} has no tokenize(texts, tokenizer, max_length) function")
        x = tokenize([str(t) for t in table["text"]], tok, int(options.get("max_length") or entry.max_length))
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            raise DataError(f"{key}.tokenizer={name!r}: the tokenizer has no pad token")
        extra["pad_token_id"] = np.int64(pad)
    x = _folder_samples(x, entry, n, origin)
    labels = _labels(table["label"].to_numpy(), Path(origin), "label", n, entry.num_classes)
    split = table["split"].astype(str).to_numpy() if "split" in table.columns else np.full(n, "train")
    bad = sorted(set(split) - set(SPLITS))
    if bad:
        raise DataError(f"{origin}: split values {bad} not in {SPLITS}")
    samples = pd.DataFrame({
        "sample_id": np.arange(n, dtype=np.int64),
        "split": split,
        "index_in_split": pd.Series(split).groupby(split).cumcount().to_numpy().astype(np.int64),
        "label": labels,
    })
    if "subject_id" in table.columns:
        sub = table["subject_id"]
        if sub.isna().any():
            raise DataError(f"{origin}: subject_id has empty values")
        samples["subject_id"] = sub.to_numpy().astype(np.int64)
    samples = validate(SampleTable, samples, str(out_samples))
    write_npz(out_arrays, {"images": x, "labels": labels, "num_classes": np.int64(entry.num_classes),
                           "class_names": np.array(list(entry.class_names), dtype=str),
                           "kind": np.array(entry.kind), **extra})
    write_parquet(out_samples, samples)
    return samples
