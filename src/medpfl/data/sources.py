"""Data sources: MedMNIST by flag and size, with the official URL and MD5 from ``medmnist.INFO``.

A data set is named by its official file stem: ``bloodmnist`` is the 28-px file
``bloodmnist.npz``; ``bloodmnist_64`` is ``bloodmnist_64.npz`` (sizes 64, 128, 224).
The download stage looks in a local mirror first (``$MEDPFL_DATA_MIRROR``, a ``:``-separated
list of folders, or ``../shared/data/medmnist`` beside the project when it exists), then on the
network. The MD5 is always checked, whatever the source.

Errors: :class:`DataError` (a ``ValueError``) naming the file and what was expected.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from medpfl.io import atomic_path, md5sum

MIRROR_ENV = "MEDPFL_DATA_MIRROR"
MEDMNIST_SIZES = (28, 64, 128, 224)


class DataError(ValueError):
    """A data file is missing, corrupt or inconsistent; the message names the file."""


@dataclass(frozen=True)
class DatasetSpec:
    """What the download stage needs to know about one data set file."""

    name: str  # official file stem, e.g. "bloodmnist" or "bloodmnist_64"
    flag: str  # medmnist flag, e.g. "bloodmnist"
    size: int  # image side in pixels
    url: str
    md5: str
    n_channels: int
    num_classes: int
    task: str

    @property
    def filename(self) -> str:
        return f"{self.name}.npz"


@functools.cache
def medmnist_info() -> tuple[dict, str]:
    """``(medmnist.INFO, medmnist.__version__)``, read from ``medmnist/info.py`` alone.

    Importing the ``medmnist`` package imports torch and its data-set classes (2 s); the
    metadata module needs neither, so it is loaded on its own.
    """
    spec = importlib.util.find_spec("medmnist")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the medmnist package is not installed (pip install medmnist==3.0.2)")
    path = Path(spec.submodule_search_locations[0]) / "info.py"
    mod_spec = importlib.util.spec_from_file_location("_medpfl_medmnist_info", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.INFO, mod.__version__


def parse_dataset_name(name: str) -> tuple[str, int]:
    """Split ``bloodmnist_64`` into ``("bloodmnist", 64)``; ``bloodmnist`` is size 28.

    Raises ValueError for unknown flags or sizes (the message lists the known flags).
    """
    INFO, _ = medmnist_info()
    m = re.fullmatch(r"([a-z0-9]+?)(?:_(\d+))?", name)
    if not m:
        raise DataError(f"data set {name!r}: expected a MedMNIST file stem such as 'bloodmnist' or 'bloodmnist_64'")
    flag, size = m.group(1), int(m.group(2) or 28)
    if flag not in INFO:
        known = ", ".join(sorted(k for k in INFO if not k.endswith("3d")))
        raise DataError(f"data set {name!r}: unknown MedMNIST flag {flag!r}; known 2D flags: {known}")
    if size not in MEDMNIST_SIZES or (size == 28 and m.group(2)):
        raise DataError(f"data set {name!r}: size must be one of 28 (no suffix), 64, 128, 224")
    return flag, size


def dataset_spec(name: str, custom: dict | None = None) -> DatasetSpec:
    """The official URL, MD5 and label metadata of a MedMNIST file, from ``medmnist.INFO``.

    ``custom`` maps names to ``{"path", "md5", "n_channels", "num_classes"}`` for files in the
    official layout that are not MedMNIST releases (your own data, or synthetic test data);
    such a data set has no URL and is read from ``path``.
    """
    if custom and name in custom:
        c = custom[name]
        return DatasetSpec(name=name, flag=name, size=0, url=str(Path(c["path"]).resolve().as_uri()), md5=c["md5"],
                           n_channels=int(c["n_channels"]), num_classes=int(c["num_classes"]), task="multi-class")
    INFO, version = medmnist_info()
    flag, size = parse_dataset_name(name)
    info = INFO[flag]
    key = "" if size == 28 else f"_{size}"
    if f"url{key}" not in info:
        raise DataError(f"data set {name!r}: medmnist {version} has no {size}-px file for {flag}")
    return DatasetSpec(
        name=name,
        flag=flag,
        size=size,
        url=info[f"url{key}"],
        md5=info[f"MD5{key}"],
        n_channels=int(info["n_channels"]),
        num_classes=len(info["label"]),
        task=info["task"],
    )


def default_mirrors(project_root: Path | None = None) -> list[Path]:
    """Mirror folders to try, in order: ``$MEDPFL_DATA_MIRROR`` entries, else ``../shared/data/medmnist``."""
    env = os.environ.get(MIRROR_ENV)
    if env is not None:
        return [Path(p) for p in env.split(os.pathsep) if p]
    root = project_root or Path.cwd()
    return [root.parent / "shared" / "data" / "medmnist"]


def _verify(path: Path, spec: DatasetSpec, origin: str) -> None:
    got = md5sum(path)
    if got != spec.md5:
        raise DataError(
            f"{origin}: MD5 mismatch for {spec.filename}: expected {spec.md5} (medmnist.INFO), got {got}. "
            "The file is corrupt or not the official release; delete it and download it again."
        )


def fetch(name: str, out: str | Path, mirrors: list[Path] | None = None, retries: int = 3, timeout: float = 60.0,
          custom: dict | None = None) -> str:
    """Place the verified official file for data set ``name`` at ``out``; return where it came from.

    Order: an already present ``out`` with the right MD5 is kept; then each mirror folder; then
    the official URL (``retries`` attempts with back-off). The file is written atomically.

    Raises:
        DataError: wrong MD5 (naming the mirror file or URL), or no source reachable (the
            message says how to provide the file).
    """
    spec = dataset_spec(name, custom)
    out = Path(out)
    if out.exists():
        try:
            _verify(out, spec, str(out))
            return f"existing {out}"
        except DataError:
            out.unlink()
    mirrors = default_mirrors() if mirrors is None else mirrors
    for folder in mirrors:
        candidate = Path(folder) / spec.filename
        if candidate.is_file():
            _verify(candidate, spec, str(candidate))
            with atomic_path(out) as tmp:
                shutil.copyfile(candidate, tmp)
            return f"mirror {candidate}"
    errors = []
    if spec.url.startswith("file:") and not Path(urllib.request.url2pathname(spec.url[len("file://"):])).is_file():
        retries = 0  # a declared local file that is missing: nothing to retry
        errors.append(f"data.custom.{name}.path does not exist")
    for attempt in range(retries):
        try:
            with atomic_path(out) as tmp:
                with urllib.request.urlopen(spec.url, timeout=timeout) as resp, open(tmp, "wb") as f:
                    shutil.copyfileobj(resp, f)
                _verify(tmp, spec, spec.url)
            return f"network {spec.url}"
        except DataError:
            raise
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            time.sleep(min(2**attempt, 10))
    tried = ", ".join(str(m) for m in mirrors) or "none"
    raise DataError(
        f"{spec.filename}: not in any mirror folder (tried: {tried}) and the download from {spec.url} failed "
        f"({errors[-1] if errors else 'no attempt'}). To provide it offline, copy the official {spec.filename} "
        f"(MD5 {spec.md5}) into a folder and set {MIRROR_ENV}=/that/folder, or place it at {out}."
    )
