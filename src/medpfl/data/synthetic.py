"""Small synthetic data sets in the official MedMNIST ``.npz`` layout, for tests and trials.

Each class has its own mean image (a random low-frequency pattern) plus noise, so a small CNN
can learn it in a few rounds; keys and dtypes match the official files
(``{train,val,test}_images`` uint8 ``(N, H, W, C)`` or ``(N, H, W)``, ``*_labels`` uint8 ``(N, 1)``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from medpfl.io import md5sum, write_npz


def write_synthetic_npz(out: Path, num_classes: int = 4, n_channels: int = 3, size: int = 28,
                        counts: tuple[int, int, int] = (400, 40, 120), seed: int = 0) -> str:
    """Write the file atomically and return its MD5."""
    rng = np.random.default_rng(seed)
    protos = rng.uniform(40, 215, size=(num_classes, 4, 4, n_channels))
    protos = np.repeat(np.repeat(protos, -(-size // 4), axis=1), -(-size // 4), axis=2)[:, :size, :size]
    arrays = {}
    for split, n in zip(("train", "val", "test"), counts):
        y = rng.integers(0, num_classes, size=n)
        # skew class frequencies a little, as real medical sets are imbalanced
        y = np.where(rng.random(n) < 0.3, 0, y)
        x = protos[y] + rng.normal(0, 30, size=(n, size, size, n_channels))
        x = np.clip(np.round(x), 0, 255).astype(np.uint8)
        if n_channels == 1:
            x = x[..., 0]
        arrays[f"{split}_images"] = x
        arrays[f"{split}_labels"] = y.astype(np.uint8)[:, None]
    write_npz(out, arrays, compress=True)
    return md5sum(out)
