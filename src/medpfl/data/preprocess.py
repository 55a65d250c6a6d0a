"""Preprocess: an official MedMNIST ``.npz`` into one compact array file and a sample table.

Output ``<out>.npz`` holds ``images`` (uint8, ``[N, C, H, W]``, channel-first), ``labels``
(int64, ``[N]``) in the order train, val, test; ``<out>.samples.parquet`` holds one row per
image (``sample_id`` = row in the arrays, ``split``, ``index_in_split``, ``label``), validated by
:class:`medpfl.data.schemas.SampleTable`.

Errors: :class:`medpfl.data.sources.DataError` naming the file for a truncated or unreadable
file, missing keys, wrong shapes or dtypes, labels outside ``[0, num_classes)``, NaN images.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medpfl.data.schemas import SampleTable, validate
from medpfl.data.sources import DataError
from medpfl.io import atomic_path, write_parquet

SPLIT_ORDER = ("train", "val", "test")


def load_official_npz(path: str | Path, num_classes: int, n_channels: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read and check ``{split}_images`` / ``{split}_labels`` for train, val and test.

    Returns ``{split: (images uint8 [n, C, H, W], labels int64 [n])}``.
    """
    path = Path(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npz file ({e}); delete it and re-run the download stage") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: a single .npy array, not an .npz archive; expected the official MedMNIST layout")
    with npz:
        return _read_splits(npz, path, num_classes, n_channels)


def _read_splits(npz, path: Path, num_classes: int, n_channels: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
        x = _images_nchw(x, path, ik, n_channels)
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


@dataclass
class ProcessedData:
    """A preprocessed data set in memory: ``images`` uint8 [N, C, H, W], ``labels`` int64 [N]."""

    images: np.ndarray
    labels: np.ndarray
    samples: pd.DataFrame
    num_classes: int

    def split_ids(self, split: str) -> np.ndarray:
        return self.samples.loc[self.samples["split"] == split, "sample_id"].to_numpy()


def preprocess(raw: str | Path, out_arrays: str | Path, out_samples: str | Path, num_classes: int, n_channels: int) -> pd.DataFrame:
    """Write the compact array file and the validated sample table; return the table."""
    parts = load_official_npz(raw, num_classes, n_channels)
    images = np.concatenate([parts[s][0] for s in SPLIT_ORDER])
    labels = np.concatenate([parts[s][1] for s in SPLIT_ORDER])
    samples = pd.DataFrame({
        "sample_id": np.arange(len(labels), dtype=np.int64),
        "split": np.concatenate([[s] * len(parts[s][1]) for s in SPLIT_ORDER]),
        "index_in_split": np.concatenate([np.arange(len(parts[s][1])) for s in SPLIT_ORDER]),
        "label": labels,
    })
    samples = validate(SampleTable, samples, str(out_samples))
    with atomic_path(out_arrays) as tmp:
        np.savez(tmp, images=images, labels=labels, num_classes=np.int64(num_classes))
    write_parquet(out_samples, samples)
    return samples


def load_processed(arrays: str | Path, samples: str | Path) -> ProcessedData:
    """Load the preprocessed arrays and sample table, checking they agree."""
    from medpfl.io import read_parquet

    arrays = Path(arrays)
    try:
        with np.load(arrays, allow_pickle=False) as z:
            images, labels, num_classes = z["images"], z["labels"], int(z["num_classes"])
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as e:
        raise DataError(f"{arrays}: unreadable processed array file ({e}); delete it and re-run preprocess") from None
    table = validate(SampleTable, read_parquet(samples), str(samples))
    if len(table) != len(labels) or not np.array_equal(table["label"].to_numpy(), labels):
        raise DataError(f"{samples}: sample table does not match {arrays} (re-run preprocess)")
    return ProcessedData(images=images, labels=labels, samples=table, num_classes=num_classes)
