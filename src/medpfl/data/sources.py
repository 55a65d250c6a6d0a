"""Data sources: MedMNIST by flag and size (official URL and MD5 from ``medmnist.INFO``), MNIST
(the Keras ``mnist.npz``), CIFAR-10 and CIFAR-100 (the official python archives), and
Synthetic(alpha, beta) (generated locally).

A data set is named by its official file stem: ``bloodmnist`` is the 28-px file
``bloodmnist.npz``; ``bloodmnist_64`` is ``bloodmnist_64.npz`` (sizes 64, 128, 224). The MedMNIST 3D flags (``organmnist3d``,
``nodulemnist3d``, ``adrenalmnist3d``, ``fracturemnist3d``, ``vesselmnist3d``,
``synapsemnist3d``) are named the same way (``organmnist3d`` 28^3, ``organmnist3d_64`` 64^3;
3D has no larger size); their layout is ``medmnist3d`` and their ``n_channels`` is the
volume's depth (28 or 64): a volume is stored as its depth slices, ``[N, D, H, W]``.
``mnist`` is MNIST in the Keras layout (``x_train``, ``y_train``, ``x_test``, ``y_test``);
``cifar10`` and ``cifar100`` are the official ``cifar-10-python.tar.gz`` and
``cifar-100-python.tar.gz`` of https://www.cs.toronto.edu/~kriz/cifar.html (pickled batches,
read by :func:`medpfl.data.preprocess.load_cifar_archive`, no torchvision), kept as
``data/raw/<name>.tar.gz`` (:attr:`DatasetSpec.raw_filename`);
``synthetic_<alpha>_<beta>`` (e.g. ``synthetic_0.5_0.5``) is the FedProx/pFedKD-WCL synthetic
federated set (:mod:`medpfl.data.fedprox_synthetic`), whose "download" is its generation.
The folder data sets of :data:`medpfl.data.multimodal.FOLDER_DATASETS` (``ptbxl``, ...) are not
copied: the download stage finds their official root folder in a mirror folder (else downloads it
into ``data/external/<name>/``, :mod:`medpfl.data.folder_download`), verifies it and writes a
manifest ``data/raw/<name>.manifest.json`` (:func:`fetch_folder`).
The download stage looks in a local mirror first (``$MEDPFL_DATA_MIRROR``, a ``:``-separated
list of folders, or ``../shared/data/medmnist``, ``../shared/data/mnist`` and
``../shared/data/cifar`` beside the project when they exist) for the official file name
(:attr:`DatasetSpec.filename`), then on the network. The checksum is always checked, whatever
the source.

Errors: :class:`DataError` (a ``ValueError``) naming the file and what was expected.
"""

from __future__ import annotations

import fnmatch
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

from medpfl.config import Params, SyntheticDataset
from medpfl.data.multimodal import FOLDER_DATASETS, FolderDataset, read_checksum_file
from medpfl.errors import DataError  # noqa: F401  (defined in medpfl.errors; importable here as before)
from medpfl.io import atomic_path, md5sum, read_json, sha256sum, write_json

MIRROR_ENV = "MEDPFL_DATA_MIRROR"
MEDMNIST_SIZES = (28, 64, 128, 224)
SYNTHETIC_RE = r"synthetic_(\d+(?:\.\d+)?)_(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class DatasetSpec:
    """What the download stage needs to know about one data set file."""

    name: str  # official file stem, e.g. "bloodmnist" or "bloodmnist_64"
    flag: str  # medmnist flag, e.g. "bloodmnist"
    size: int  # image side in pixels
    url: str
    md5: str
    n_channels: int  # channels of a stored sample; for a 3D volume (layout medmnist3d) its depth D
    num_classes: int
    task: str
    layout: str = "medmnist"  # raw layout: medmnist | medmnist3d | keras | cifar10 | cifar100 | synthetic | folder
    norm: tuple[float, float] | None = None  # (mean, std) after ToTensor; None = Normalize(0.5, 0.5)
    alt_sha256: tuple[str, ...] = ()  # other accepted checksums of the same content (a re-packed file)
    generator: dict | None = None  # synthetic: the generator's arguments (fedprox_synthetic.SyntheticArgs)
    class_names: tuple[str, ...] | None = None  # label names by class index; None: the index is the name
    official_file: str | None = None  # the release's own file name when it is not "<name>.npz"
    md5_source: str | None = None  # where the MD5 comes from, for error messages
    folder: FolderDataset | None = None  # layout "folder": the registry entry (medpfl.data.multimodal)
    kind: str = "image"  # the processed samples' kind (medpfl.data.multimodal.KINDS)

    @property
    def filename(self) -> str:
        """The official file's name, as looked up in a mirror folder: ``<name>.npz``, or the
        release's own name (``cifar-10-python.tar.gz``); for a folder data set its official root
        folder's (first) name."""
        if self.folder is not None:
            return self.folder.root_names[0]
        return self.official_file or f"{self.name}.npz"

    @property
    def raw_filename(self) -> str:
        """The name of the verified copy under ``data/raw/``: ``<name>.npz``, or ``<name>.tar.gz``
        for a ``.tar.gz`` release (``cifar10.tar.gz``), or the manifest ``<name>.manifest.json``
        of a folder data set (:func:`fetch_folder`)."""
        if self.folder is not None:
            return f"{self.name}.manifest.json"
        return f"{self.name}.tar.gz" if self.filename.endswith(".tar.gz") else f"{self.name}.npz"


# MNIST as the Keras distribution. The MD5 is that of the verified copy in ../shared/data/mnist
# (a re-packed, deflate-compressed npz with the same arrays); the file served at the URL is
# 11,490,434 bytes with the SHA-256 that Keras' mnist.load_data() checks (file_hash). Either is
# accepted; preprocessing reads the arrays, so both give the same processed data set.
MNIST = DatasetSpec(
    name="mnist", flag="mnist", size=28,
    url="https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz",
    md5="1645a3b44f673782419eaed6fa02cb86",
    n_channels=1, num_classes=10, task="multi-class", layout="keras",
    class_names=tuple(str(d) for d in range(10)),
    norm=(0.1307, 0.3081),  # the pFedKD-WCL code: ToTensor() then Normalize((0.1307,), (0.3081,))
    alt_sha256=("731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1",),
)
# CIFAR-10 and CIFAR-100 (Krizhevsky 2009): the python versions on the official page
# https://www.cs.toronto.edu/~kriz/cifar.html, with the MD5s it publishes next to them (the same
# as torchvision.datasets.CIFAR10/100.tgz_md5). Class names come from the archives' meta files;
# the images keep the project's default Normalize(0.5, 0.5) per channel (PFLlib's CIFAR
# transform, docs/pipeline.md), so no norm is stored.
CIFAR10 = DatasetSpec(
    name="cifar10", flag="cifar10", size=32,
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    md5="c58f30108f718f92721af3b95e74349a",
    n_channels=3, num_classes=10, task="multi-class", layout="cifar10",
    official_file="cifar-10-python.tar.gz", md5_source="https://www.cs.toronto.edu/~kriz/cifar.html",
)
CIFAR100 = DatasetSpec(
    name="cifar100", flag="cifar100", size=32,
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    md5="eb9058c3a382ffc7106e4002c42a8d85",
    n_channels=3, num_classes=100, task="multi-class", layout="cifar100",
    official_file="cifar-100-python.tar.gz", md5_source="https://www.cs.toronto.edu/~kriz/cifar.html",
)
# Data sets other than MedMNIST and Synthetic(alpha, beta), by name. Tests replace an entry
# (monkeypatch.setitem) to pass a tiny stand-in file with its own MD5 through the stages.
OTHER_DATASETS = {"mnist": MNIST, "cifar10": CIFAR10, "cifar100": CIFAR100}


def parse_synthetic_name(name: str) -> tuple[float, float] | None:
    """``synthetic_0.5_0.5`` -> ``(0.5, 0.5)`` (alpha, beta: standard deviations); None otherwise."""
    m = re.fullmatch(SYNTHETIC_RE, name)
    return (float(m.group(1)), float(m.group(2))) if m else None


def check_dataset_name(name: str) -> None:
    """Raise DataError unless ``name`` is ``mnist``, ``cifar10``, ``cifar100``,
    ``synthetic_<alpha>_<beta>``, a folder data set (``ptbxl``, ...) or a MedMNIST stem."""
    if name in OTHER_DATASETS or name in FOLDER_DATASETS or parse_synthetic_name(name) is not None:
        return
    if name.startswith("synthetic"):
        raise DataError(f"data set {name!r}: a synthetic set is named synthetic_<alpha>_<beta> with two "
                        "non-negative numbers, e.g. synthetic_0.5_0.5")
    parse_dataset_name(name)


def dataset_job(params: Params, dataset: str) -> dict:
    """What download/preprocess need for one data set (custom entries carry path and MD5); read back
    by :func:`dataset_spec`. A folder data set's job adds ``folder`` (its registry entry,
    :meth:`FolderDataset.job`: editing the entry re-runs its stages) and ``options`` (its
    ``data.multimodal.<name>`` keys that are not at their defaults: tokenizer, max_length, limit).
    The jobs of the other data sets are unchanged."""
    custom = params.data.custom.get(dataset)
    # the layout only when not the default: earlier data jobs keep their description
    job = {"dataset": dataset, "custom": {dataset: custom.model_dump(exclude_defaults=True)} if custom else {}}
    if parse_synthetic_name(dataset) is not None and dataset not in params.data.custom:
        job["synthetic"] = params.data.synthetic.get(dataset, SyntheticDataset()).model_dump()
    entry = FOLDER_DATASETS.get(dataset) if dataset not in params.data.custom else None
    if entry is not None:
        opts = params.data.multimodal.get(dataset)
        job["folder"] = entry.job()
        job["options"] = opts.model_dump(exclude_defaults=True) if opts is not None else {}
    return job


def download_job(params: Params, dataset: str) -> dict:
    """The download rule's job: :func:`dataset_job` without a folder data set's ``options`` (a
    smoke-run ``limit`` or another tokenizer does not re-verify the files); the same as
    :func:`dataset_job` for every other data set."""
    job = dataset_job(params, dataset)
    job.pop("options", None)
    return job


#: The generic data code of every data set's preprocess stage (and, with ``partition.py``, of its
#: partition stage), relative to ``src/medpfl/data``; a folder data set adds its reader module.
GENERIC_DATA_CODE = ("preprocess.py", "sources.py", "schemas.py")


def dataset_code_files(name: str, stage: str, custom: dict | None = None) -> list[str]:
    """The files under ``src/medpfl/data`` whose content decides the outputs of ``stage``
    (``preprocess`` or ``partition``) for data set ``name``: :data:`GENERIC_DATA_CODE`, plus
    ``partition.py`` for ``partition``, plus the reader module of a folder data set
    (``ptbxl.py``) for ``preprocess``. The Snakefile hashes them (``code`` param), so adding or
    editing one data set's reader re-runs that data set's preprocess only (and no MedMNIST or
    archived study). The registry file ``multimodal.py`` is not among them: its entries reach the
    job description instead (:func:`dataset_job`). Raises ValueError for an unknown stage."""
    if stage not in ("preprocess", "partition"):
        raise ValueError(f"stage must be preprocess or partition, got {stage!r}")
    files = list(GENERIC_DATA_CODE)
    if stage == "partition":
        files.append("partition.py")
    entry = FOLDER_DATASETS.get(name) if not (custom and name in custom) else None
    if stage == "preprocess" and entry is not None:
        files.append(f"{entry.module}.py")
    return files


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
        known3d = ", ".join(sorted(k for k in INFO if k.endswith("3d")))
        raise DataError(f"data set {name!r}: unknown MedMNIST flag {flag!r}; known 2D flags: {known}; 3D flags: "
                        f"{known3d}")
    if size not in MEDMNIST_SIZES or (size == 28 and m.group(2)):
        raise DataError(f"data set {name!r}: size must be one of 28 (no suffix), 64, 128, 224")
    return flag, size


def dataset_spec(name: str, custom: dict | None = None, synthetic: dict | None = None) -> DatasetSpec:
    """The official URL, checksum and label metadata of a data set: MedMNIST from
    ``medmnist.INFO``, ``mnist`` (:data:`MNIST`), ``cifar10`` / ``cifar100`` (:data:`CIFAR10`,
    :data:`CIFAR100`), or a ``synthetic_<alpha>_<beta>`` set.

    ``custom`` maps names to ``{"path", "md5", "n_channels", "num_classes"}`` (and optionally
    ``"layout"``: ``medmnist``, the default, or ``medmnist3d`` for volumes, whose ``n_channels``
    is the depth) for files in the official MedMNIST layout that are not MedMNIST releases (your
    own data, or synthetic test data); such a data set has no URL and is read from ``path``.
    A MedMNIST 3D flag (``organmnist3d``, ``organmnist3d_64``, ...) has the layout
    ``medmnist3d`` and ``n_channels`` = its depth (28 or 64). ``synthetic`` holds the
    generator's arguments for a synthetic set (``data.synthetic.<name>``: num_clients,
    dimension, num_classes, seed, train_fraction); missing ones take their defaults.
    """
    if custom and name in custom:
        c = custom[name]
        return DatasetSpec(name=name, flag=name, size=0, url=str(Path(c["path"]).resolve().as_uri()), md5=c["md5"],
                           n_channels=int(c["n_channels"]), num_classes=int(c["num_classes"]), task="multi-class",
                           layout=str(c.get("layout") or "medmnist"))
    if name in FOLDER_DATASETS:
        f = FOLDER_DATASETS[name]
        return DatasetSpec(name=name, flag=name, size=0, url=f.url, md5="", n_channels=0, num_classes=f.num_classes,
                           task="multi-class", layout="folder", class_names=f.class_names, folder=f, kind=f.kind)
    if name in OTHER_DATASETS:
        return OTHER_DATASETS[name]
    ab = parse_synthetic_name(name)
    if ab is not None:
        gen = {"alpha": ab[0], "beta": ab[1], **dict(synthetic or {})}
        return DatasetSpec(name=name, flag="synthetic", size=0, url="", md5="",
                           n_channels=int(gen.get("dimension", 60)), num_classes=int(gen.get("num_classes", 10)),
                           task="multi-class", layout="synthetic", generator=gen)
    INFO, version = medmnist_info()
    flag, size = parse_dataset_name(name)
    info = INFO[flag]
    key = "" if size == 28 else f"_{size}"
    if f"url{key}" not in info:
        raise DataError(f"data set {name!r}: medmnist {version} has no {size}-px file for {flag}")
    volume = flag.endswith("3d")  # official 3D file: {split}_images uint8 [N, D, H, W], D = H = W = size
    return DatasetSpec(
        name=name,
        flag=flag,
        size=size,
        url=info[f"url{key}"],
        md5=info[f"MD5{key}"],
        n_channels=size if volume else int(info["n_channels"]),
        num_classes=len(info["label"]),
        task=info["task"],
        layout="medmnist3d" if volume else "medmnist",
        class_names=medmnist_class_names(info),
    )


def medmnist_class_names(info: dict) -> tuple[str, ...]:
    """The label names of a MedMNIST flag (``medmnist.INFO[flag]["label"]``, ``{"0": name, ...}``)
    in class-index order."""
    labels = info["label"]
    return tuple(str(labels[k]) for k in sorted(labels, key=int))


DEFAULT_MIRROR_FOLDERS = ("medmnist", "mnist", "cifar", "multimodal")  # under ../shared/data beside the project


def default_mirrors(project_root: Path | None = None) -> list[Path]:
    """Mirror folders to try, in order: ``$MEDPFL_DATA_MIRROR`` entries, else
    ``../shared/data/{medmnist,mnist,cifar,multimodal}`` beside ``project_root`` (default: the
    working folder); a folder data set's root is looked up inside them by its official names."""
    env = os.environ.get(MIRROR_ENV)
    if env is not None:
        return [Path(p) for p in env.split(os.pathsep) if p]
    root = project_root or Path.cwd()
    return [root.parent / "shared" / "data" / f for f in DEFAULT_MIRROR_FOLDERS]


def checksum_ok(path: str | Path, spec: DatasetSpec) -> bool:
    """Whether ``path`` has the data set's MD5 (or one of its accepted SHA-256s)."""
    return md5sum(path) == spec.md5 or bool(spec.alt_sha256 and sha256sum(Path(path)) in spec.alt_sha256)


def _verify(path: Path, spec: DatasetSpec, origin: str) -> None:
    if checksum_ok(path, spec):
        return
    got = md5sum(path)
    source = spec.md5_source or ("medmnist.INFO" if spec.layout in ("medmnist", "medmnist3d") and spec.size
                                 else "the data set's declared checksum")
    alt = f" (or SHA-256 {', '.join(spec.alt_sha256)})" if spec.alt_sha256 else ""
    raise DataError(
        f"{origin}: MD5 mismatch for {spec.filename}: expected {spec.md5}{alt} ({source}), got {got}. "
        "The file is corrupt or not the official release; delete it and download it again."
    )


def fetch(name: str, out: str | Path, mirrors: list[Path] | None = None, retries: int = 3, timeout: float = 60.0,
          custom: dict | None = None, synthetic: dict | None = None) -> str:
    """Place the verified official file for data set ``name`` at ``out``; return where it came from.

    Order: an already present ``out`` with the right MD5 is kept; then each mirror folder (the
    file named :attr:`DatasetSpec.filename` there, e.g. ``cifar-10-python.tar.gz``); then
    the official URL (``retries`` attempts with back-off). The file is written atomically.
    ``out`` is normally ``data/raw/`` + :attr:`DatasetSpec.raw_filename`.
    A ``synthetic_<alpha>_<beta>`` set is generated instead (no network, no mirror), with the
    arguments in ``synthetic`` (see :func:`dataset_spec`).

    Raises:
        DataError: wrong MD5 (naming the mirror file or URL), or no source reachable (the
            message says how to provide the file).
    """
    spec = dataset_spec(name, custom, synthetic)
    out = Path(out)
    if spec.folder is not None:
        return fetch_folder(spec.folder, out, mirrors)
    if spec.layout == "synthetic":
        from medpfl.data.fedprox_synthetic import SyntheticArgs, write_fedprox_synthetic

        try:
            args = SyntheticArgs(**spec.generator)
        except TypeError as e:
            raise DataError(f"data.synthetic.{name}: {e}") from None
        try:
            md5 = write_fedprox_synthetic(out, args)
        except ValueError as e:
            raise DataError(f"data.synthetic.{name}: {e}") from None
        return f"generated Synthetic({args.alpha}, {args.beta}), {args.num_clients} clients, seed {args.seed} (MD5 {md5})"
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


# ----- folder data sets: find the official root in a mirror, verify it, write a manifest --------
MANIFEST_FORMAT = 1


def _wanted(entry: FolderDataset, rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, pat) for pat in entry.files)


def _literal_files(entry: FolderDataset) -> list[str]:
    return [p for p in entry.files if not any(ch in p for ch in "*?[")]


def find_folder_root(entry: FolderDataset, mirrors: list[Path]) -> tuple[Path | None, list[str]]:
    """The first ``<mirror>/<root name>`` folder (mirrors in order, then :attr:`FolderDataset.root_names`
    in order) holding every file of ``entry.files`` without wildcards. Returns ``(root or None,
    notes)``: ``notes`` lists the folders tried, with why a candidate folder was passed over."""
    tried = []
    for m in mirrors:
        for rn in entry.root_names:
            cand = Path(m) / rn
            if not cand.is_dir():
                continue
            missing = [f for f in _literal_files(entry) if not (cand / f).is_file()]
            if not missing:
                return cand, tried
            tried.append(f"{cand} (lacks {', '.join(missing)})")
        tried.append(str(m))
    return None, tried


def _size_sha(path: Path) -> tuple[int, str]:
    return path.stat().st_size, sha256sum(path)


def fetch_folder(entry: FolderDataset, out: str | Path, mirrors: list[Path] | None = None,
                 download: str | Path | None = None, **net) -> str:
    """The download stage of a folder data set: find its official root folder in a mirror folder
    (:func:`find_folder_root`; ``mirrors`` default :func:`default_mirrors`), else in an earlier
    finished download, else download it from its official distribution where the network allows
    (:mod:`medpfl.data.folder_download`; into ``download``, default
    :func:`~medpfl.data.folder_download.download_dir`: ``$MEDPFL_DATA_DOWNLOAD/<name>`` or
    ``data/external/<name>``; ``net``: ``retries``, ``timeout``, ``backoff``, ``workers``), verify
    the files the reader needs (``entry.files``) and write the manifest ``out``
    (``data/raw/<name>.manifest.json``, atomically; nothing is copied). Returns where the data came from.

    Verification: with ``entry.checksums`` (PTB-XL: ``SHA256SUMS.txt``), every listed file that
    matches ``entry.files`` must exist with the published SHA-256; without, the size and SHA-256
    of every matching file found are recorded (the source publishes none). The manifest
    (:data:`MANIFEST_FORMAT` 1; JSON, sorted keys) holds ``dataset``, ``version``, ``url``,
    ``access_terms``, ``root`` (absolute path), ``checksums`` (how the files were checked),
    ``checksum_file_sha256`` (the checksum file's own SHA-256, when there is one) and ``files``
    ``{relative path: [size in bytes, sha256]}``. An existing ``out`` whose root still has every
    file at its recorded size is kept (the Snakefile runs this stage only without one anyway).

    ``MEDPFL_OFFLINE=1``, an unreachable network, or a data set whose terms require registration
    (never fetched) stop with one line naming the official URL and access terms.

    Raises:
        DataError: the root in no mirror folder and not downloadable (one line naming the official
            URL and access terms); a downloaded file failing its published check (naming the file
            and URL); a needed file missing or with the wrong checksum (naming the file); a
            malformed checksum file (naming it and the line).
    """
    out = Path(out)
    if out.exists():
        try:
            check_manifest(out, entry.name)
            return f"existing {out}"
        except DataError:
            pass  # stale: verify again
    mirrors = default_mirrors() if mirrors is None else [Path(m) for m in mirrors]
    root, tried = find_folder_root(entry, mirrors)
    origin = "mirror"
    if root is None:
        root, origin = _download_root(entry, tried, download, net)
    files: dict[str, list] = {}
    extra: dict[str, str] = {}
    if entry.checksums:
        sums_path = root / entry.checksums
        sums = read_checksum_file(sums_path)
        wanted = sorted(rel for rel in sums if _wanted(entry, rel))
        for pat in entry.files:
            if not any(fnmatch.fnmatchcase(rel, pat) for rel in wanted):
                raise DataError(f"{sums_path}: lists no file matching {pat!r}; not the official {entry.name} "
                                f"{entry.version} release ({entry.url})")
        for rel in wanted:
            path = root / rel
            if not path.is_file():
                raise DataError(f"{path}: missing (listed in {sums_path}); the copy of {entry.name} is incomplete: get "
                                f"the file from {entry.url}")
            size, digest = _size_sha(path)
            if digest != sums[rel]:
                raise DataError(f"{path}: SHA-256 mismatch: expected {sums[rel]} ({entry.checksums}), got {digest}; "
                                f"the file is damaged or not the official release: replace it from {entry.url}")
            files[rel] = [size, digest]
        how = f"{entry.checksums} (published by the source)"
        extra["checksum_file_sha256"] = sha256sum(sums_path)
    else:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for fn in sorted(filenames):
                rel = (Path(dirpath) / fn).relative_to(root).as_posix()
                if _wanted(entry, rel):
                    files[rel] = list(_size_sha(root / rel))
        for pat in entry.files:
            if not any(fnmatch.fnmatchcase(rel, pat) for rel in files):
                raise DataError(f"{root / pat}: no file matching {pat!r}; the copy of {entry.name} is incomplete: "
                                f"get it from {entry.url}")
        how = "recorded at download (the source publishes no checksums)"
    manifest = {"format": MANIFEST_FORMAT, "dataset": entry.name, "version": entry.version, "url": entry.url,
                "access_terms": entry.access_terms, "root": str(root.resolve()), "checksums": how, "files": files,
                **extra}
    write_json(out, manifest)
    return f"{origin} {root} ({len(files)} files verified: {how})"


def _download_root(entry: FolderDataset, tried: list[str], download, net: dict) -> tuple[Path, str]:
    """The root of an earlier finished download, or of a new one (:func:`fetch_folder`); raises
    the entry's one-line :meth:`~FolderDataset.missing_message` when there is none."""
    from medpfl.data import folder_download as fd  # noqa: PLC0415

    dest = Path(download) if download is not None else fd.download_dir(entry.name)
    done = fd.completed_root(entry, dest)
    if done is not None:
        return done, "download"
    tried = [*tried, str(dest)]
    spec = fd.DOWNLOADS.get(entry.name)
    if spec is None:
        raise DataError(entry.missing_message(tried))
    if spec.registration:
        raise DataError(entry.missing_message(tried, "registration required: never downloaded automatically"))
    if fd.offline():
        raise DataError(entry.missing_message(tried, f"{fd.OFFLINE_ENV} is set: nothing was downloaded"))
    try:
        root = fd.download_folder(entry, spec, dest, log=lambda s: print(s, flush=True), **net)
    except fd.DownloadUnavailable as e:
        raise DataError(entry.missing_message(tried, f"the download failed: {e}")) from None
    return root, f"network {spec.base_url} ->"


def check_manifest(path: str | Path, name: str, verify: str = "size") -> tuple[Path, dict]:
    """Read a folder data set's manifest (:func:`fetch_folder`) and check that its root still
    holds every listed file: at its recorded size (``verify="size"``, cheap: one ``stat`` a file),
    or also with its recorded SHA-256 (``verify="sha256"``, reads everything). Returns ``(root,
    manifest)``. Raises DataError naming the manifest (not one, another data set's) or the file
    that is missing or changed."""
    path = Path(path)
    if verify not in ("size", "sha256"):
        raise ValueError(f"verify must be 'size' or 'sha256', got {verify!r}")
    try:
        m = read_json(path)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path}: not a readable manifest ({e}); re-run the download stage") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
        raise DataError(f"{path}: not a medpfl folder-data-set manifest (format {MANIFEST_FORMAT}); delete it and "
                        "re-run the download stage")
    if m.get("dataset") != name:
        raise DataError(f"{path}: manifest of data set {m.get('dataset')!r}, expected {name!r}")
    root = Path(m.get("root", ""))
    if not root.is_dir():
        raise DataError(f"{path}: the data set root {root} no longer exists; delete {path} and re-run the download "
                        "stage")
    for rel, (size, digest) in sorted(m["files"].items()):
        p = root / rel
        try:
            got = p.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{p}: missing, but listed in {path}; restore it or delete {path} and re-run the "
                            "download stage") from None
        if got != size:
            raise DataError(f"{p}: {got} bytes, {size} when {path} was written; the file changed: delete {path} "
                            "and re-run the download stage")
        if verify == "sha256" and sha256sum(p) != digest:
            raise DataError(f"{p}: SHA-256 differs from {path} ({digest}); the file changed: delete {path} and "
                            "re-run the download stage")
    return root, m
