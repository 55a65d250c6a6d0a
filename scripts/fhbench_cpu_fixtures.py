"""Write the tiny mirror that ``config/fhbench-multimodal-cpu.yaml`` reads (all nine FHBench data sets).

    python scripts/fhbench_cpu_fixtures.py data/fixtures/fhbench-cpu
    MEDPFL_DATA_MIRROR=data/fixtures/fhbench-cpu snakemake --cores all --configfile config/fhbench-multimodal-cpu.yaml

Written into the folder (run from the repository root; the study's tokenizer path is relative to it):

- the six folder data sets in their official layouts, ``size="study"`` of ``tests/fixtures_multimodal.py``
  (synthetic content written with the real libraries; 48 to 100 samples each);
- ``tiny-bpe-tokenizer/``: a byte-level BPE tokenizer in RoBERTa's shape (vocabulary 300);
- ``organamnist_tiny.npz``, ``organcmnist_tiny.npz``, ``organsmnist_tiny.npz``: stand-ins for OrganA/C/SMNIST
  in the official MedMNIST ``.npz`` layout (28 px, 11 classes, 20 train / 5 val / 10 test images per class,
  a class-dependent bright square on noise), read as ``data.custom`` data sets. The real OrganA/C/S files
  are not reachable on the machine this was written on. Their bytes are deterministic (fixed zip
  timestamps, stored entries), so the MD5s in the study file hold; ``--check`` prints them.

Needs the ``dev`` extra (``mne``/``eeglabio``, ``py7zr``, ``tokenizers``) and ``tests/`` beside this script.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

ORGANS = ("organamnist_tiny", "organcmnist_tiny", "organsmnist_tiny")
TOKENIZER = "tiny-bpe-tokenizer"


def organ_images(seed: int, per_class: int, classes: int = 11, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [classes * per_class, size, size] images and int64 [N, 1] labels (MedMNIST shapes): noise with
    a bright 6 x 6 square whose position codes the class."""
    rng = np.random.default_rng(seed)
    n = classes * per_class
    x = rng.integers(0, 90, size=(n, size, size), dtype=np.uint8)
    y = np.repeat(np.arange(classes), per_class)
    for i, c in enumerate(y):
        r, col = 2 + 2 * (c % 6), 2 + 3 * (c // 6) * 3
        x[i, r:r + 6, col:col + 6] = 220
    order = rng.permutation(n)
    return x[order], y[order].reshape(-1, 1).astype(np.int64)


def write_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An ``.npz`` (zip of ``.npy`` entries, as ``np.savez``) with fixed entry timestamps, so equal arrays
    give equal bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def write_organs(folder: Path) -> dict[str, str]:
    """Write the three stand-ins; return ``{name: md5}``."""
    out = {}
    for k, name in enumerate(ORGANS):
        arrays = {}
        for j, (split, per) in enumerate((("train", 20), ("val", 5), ("test", 10))):
            x, y = organ_images(100 * k + j, per)
            arrays[f"{split}_images"], arrays[f"{split}_labels"] = x, y
        path = folder / f"{name}.npz"
        write_npz_deterministic(path, arrays)
        out[name] = hashlib.md5(path.read_bytes()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the mirror folder to write (created)")
    ap.add_argument("--check", action="store_true", help="print the stand-ins' MD5s")
    args = ap.parse_args(argv)
    import fixtures_multimodal as fx  # noqa: PLC0415 - needs tests/ on sys.path

    args.folder.mkdir(parents=True, exist_ok=True)
    fx.write_mirror(args.folder, size="study")
    fx.write_tokenizer(args.folder / TOKENIZER)
    md5 = write_organs(args.folder)
    if args.check:
        for name, h in md5.items():
            print(f"{name}: {h}")
    print(f"wrote {args.folder}: {', '.join(fx.DATASETS + ORGANS)}, {TOKENIZER}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
