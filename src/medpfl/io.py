"""Atomic, deterministic file output and small readers shared by every stage.

Every stage writes to a temporary file in the destination folder and ``os.replace``s it into
place, so a crash never leaves a half-written file under the final name that a later stage
(or Snakemake's "output exists" check) could trust.

The writers are also deterministic: the same content gives the same bytes on any machine, in
any folder, at any time (docs/pipeline.md, "Byte-reproducible data"). Text and JSON are UTF-8
with ``\n`` line ends whatever the platform and locale; JSON keys are sorted; ``.npz``
archives have fixed zip entry times, platform and permission fields and little-endian arrays
(:func:`write_npz`); parquet files carry no pandas/pyarrow version strings (:func:`write_parquet`;
the format's own ``created_by`` field, written by pyarrow, still names the pinned pyarrow).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from medpfl.errors import InputFileError  # noqa: F401  (defined in medpfl.errors; importable here as before)

TMP_PREFIX = ".medpfl-tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    The temporary name keeps ``path``'s suffix (or ``suffix``) so that writers which
    dispatch on the extension (``np.savez``, ``DataFrame.to_parquet``, matplotlib) work.
    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hidden, recognisable name (TMP_PREFIX; ignored by DVC, never a Snakemake output); the
    # real suffix stays last for writers that append or check extensions.
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.stem}-", suffix=suffix or path.suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_text(path: str | Path, text: str) -> None:
    """UTF-8 with ``\n`` line ends (no platform newline translation, no locale encoding)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise InputFileError(f"{path}: not valid JSON ({e}); delete it and re-run the stage that writes it") from None


# Version strings that pyarrow puts into the pandas metadata of a parquet file; nothing reads
# them back, and they would make the bytes depend on the installed pandas/pyarrow.
_PANDAS_META_VERSIONS = ("creator", "pandas_version")


def write_parquet(path: str | Path, df) -> None:
    """``df`` without its index, snappy-compressed, with deterministic metadata.

    The pandas metadata (column dtypes, so that extension dtypes survive a round trip) is kept
    with sorted keys and without ``creator``/``pandas_version``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    if b"pandas" in meta:
        pandas_meta = json.loads(meta[b"pandas"])
        for key in _PANDAS_META_VERSIONS:
            pandas_meta.pop(key, None)
        meta[b"pandas"] = json.dumps(pandas_meta, sort_keys=True).encode()
    table = table.replace_schema_metadata(meta)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="snappy")


# Fixed zip entry fields: the DOS epoch (numpy's default too), "Unix" as the creating system
# (zipfile writes 0 on Windows, 3 elsewhere) and rw------- permissions: on Linux, the bytes of
# np.savez (whose entries zipfile gives these fields there).
NPZ_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_LITTLE = np.little_endian


def write_npz(path: str | Path, arrays: dict[str, Any], compress: bool = False) -> None:
    """Write ``arrays`` as an ``.npz`` archive (``np.load`` reads it) whose bytes depend only on
    the arrays, their order and ``compress``; numeric arrays are stored little-endian.

    Like ``np.savez`` (``compress``: ``np.savez_compressed``; deflate output can still differ
    between zlib builds), but every zip entry gets :data:`NPZ_DATE_TIME`, Unix as its system
    and fixed permissions, so no entry header depends on the clock or the platform (``zipfile``
    itself writes 0, not 3, as the system on Windows).
    """
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with atomic_path(path) as tmp:
        with zipfile.ZipFile(tmp, mode="w", compression=method, allowZip64=True) as zf:
            for key, value in arrays.items():
                arr = np.asanyarray(value)
                if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
                    arr = arr.astype(arr.dtype.newbyteorder("<"))
                info = zipfile.ZipInfo(f"{key}.npy", date_time=NPZ_DATE_TIME)
                info.create_system = 3
                info.external_attr = 0o600 << 16
                info.compress_type = method
                with zf.open(info, "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, arr, allow_pickle=False)


def read_parquet(path: str | Path):
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for truncated files
        raise InputFileError(f"{path}: unreadable parquet file ({e}); delete it and re-run the stage that writes it") from None


def md5sum(path: str | Path, chunk: int = 1 << 20) -> str:
    """MD5 hex digest of a file, read in ``chunk``-byte pieces."""
    return _digest(hashlib.md5(), path, chunk)


def sha256sum(path: str | Path, chunk: int = 1 << 20) -> str:
    """SHA-256 hex digest of a file, read in ``chunk``-byte pieces."""
    return _digest(hashlib.sha256(), path, chunk)


def _digest(h, path: str | Path, chunk: int) -> str:
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_hash(paths: list[str | Path], suffixes: tuple[str, ...] = (".py", ".smk", ".yaml")) -> str:
    """A content hash of the files under ``paths`` (sorted), used as a Snakemake code-change param."""
    h = hashlib.sha256()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes and "__pycache__" not in f.parts)
    for f in sorted(files):
        h.update(_portable_name(f).encode())  # not the absolute path: the same code hashes alike in any clone
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _portable_name(f: Path) -> str:
    """``f`` from its ``src/`` folder on (``medpfl/fl/engine.py``), else its name."""
    parts = Path(f).resolve().parts
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("src") + 1:]) if "src" in parts else Path(f).name
