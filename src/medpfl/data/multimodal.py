"""The registry of folder-type multimodal data sets (FHBench's text, EEG, ECG and audio tracks).

A folder data set is distributed as a folder of files in its own official layout (GBs: PTB-XL
about 3 GB, ADFTD 2.95 GB), so the pipeline does not copy it: the download stage finds its
official root folder in a mirror folder (or, where the network allows, downloads it into
``data/external/<name>/``: :mod:`medpfl.data.folder_download`), verifies it and writes a small manifest
``data/raw/<name>.manifest.json`` (:func:`medpfl.data.sources.fetch_folder`); the preprocess
stage calls the data set's **reader** on that root (:func:`medpfl.data.preprocess.preprocess_folder`).

Each data set is one :class:`FolderDataset` entry of :data:`FOLDER_DATASETS`. The entry is plain
data: it imports nothing (the reader module is imported only when the preprocess stage runs), so
the Snakefile can read it cheaply. Its values reach the data job description
(:func:`medpfl.data.sources.dataset_job`), so editing an entry re-runs that data set's stages
through Snakemake's params trigger; the code behind a data set's preprocess stage is the generic
files plus **its own reader module only** (:func:`medpfl.data.sources.dataset_code_files`), so
adding a reader module re-runs nothing else. This file itself is not part of any code hash.

The reader contract (``/work/helpers/interface.md``; :mod:`medpfl.data.ptbxl` is the model):
``<module>.<reader>(root, ..., limit=None)`` returns an object with ``x`` (``None`` for text:
``table["text"]`` holds the strings; float32 ``[N, C, T]`` for ``timeseries``; float32 ``[N, T]``
for ``waveform``), ``table`` (pandas, one row per sample: ``sample_id``, ``label`` int64,
optional ``subject_id`` int64, optional ``split`` in {"train", "test"}, plus the source's own ids)
and ``class_names`` (tuple, by class index; must equal the entry's). A text module also exposes
``tokenize(texts, tokenizer, max_length) -> int64 [N, max_length]`` (and optionally
``load_tokenizer(name)``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from medpfl.errors import DataError

#: Sample kinds of a processed data set (``kind`` in ``data/processed/<name>.npz``): MedMNIST and
#: CIFAR are ``image`` (uint8 [N, C, H, W]), Synthetic(alpha, beta) ``vector`` (float32 [N, d]);
#: the folder data sets are ``tokens`` (int64 [N, L]), ``timeseries`` (float32 [N, C, T]) or
#: ``waveform`` (float32 [N, T]).
KINDS = ("image", "vector", "tokens", "timeseries", "waveform")
FOLDER_KINDS = ("tokens", "timeseries", "waveform")


@dataclass(frozen=True)
class FolderDataset:
    """One folder-type data set: where it comes from, how to check it and how to read it.

    Fields:
      name: the data set's name in ``data.datasets`` (e.g. ``ptbxl``).
      module: its reader module under ``medpfl.data`` (``ptbxl`` = ``src/medpfl/data/ptbxl.py``);
        the one data-set-specific file of its preprocess code hash.
      reader: the reader function in ``module`` (``load_ptbxl``), called as
        ``reader(root, limit=...)`` (``limit`` only when ``data.multimodal.<name>.limit`` is set).
      kind: ``tokens``, ``timeseries`` or ``waveform`` (:data:`FOLDER_KINDS`).
      num_classes, class_names: the labels, by class index (the reader's must be equal).
      url: the official address; access_terms: its licence / registration, one line.
      version: the release read (recorded in the manifest).
      root_names: names of the official root folder, looked up (in this order) inside each
        mirror folder: the unpacked official archive's folder name, the ``wget -r`` path, ...
      checksums: a file under the root that publishes per-file checksums as ``sha256sum``
        lines (``<hex> <relative path>``; PhysioNet's ``SHA256SUMS.txt``), or None when the
        source publishes none: the download stage then records the size and SHA-256 of every
        needed file it finds (trust on first use; the manifest is the reference afterwards).
      files: glob patterns (``fnmatch``, ``*`` also crosses ``/``), relative to the root, of the
        files the reader needs; these are verified (size + SHA-256) and listed in the manifest.
        Patterns without wildcards must exist (they identify the root).
      fetch_hint: how a user obtains the files (printed when they are missing).
      tokenizer: ``tokens`` only, the default tokenizer (hub id or folder), overridable by
        ``data.multimodal.<name>.tokenizer``; max_length: the token sequence length (padded or
        truncated), overridable by ``data.multimodal.<name>.max_length``.
    """

    name: str
    module: str
    reader: str
    kind: str
    num_classes: int
    class_names: tuple[str, ...]
    url: str
    access_terms: str
    version: str
    root_names: tuple[str, ...]
    checksums: str | None
    files: tuple[str, ...]
    fetch_hint: str = ""
    tokenizer: str | None = None
    max_length: int = 512

    def __post_init__(self) -> None:
        if self.kind not in FOLDER_KINDS:
            raise ValueError(f"FolderDataset {self.name}: kind {self.kind!r} not in {FOLDER_KINDS}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"FolderDataset {self.name}: {len(self.class_names)} class names for "
                             f"{self.num_classes} classes")

    def job(self) -> dict:
        """The entry as JSON-ready values, for the data job description (so that editing the
        entry re-runs the data set's stages)."""
        out = asdict(self)
        for k in ("class_names", "root_names", "files"):
            out[k] = list(out[k])
        return out

    def missing_message(self, tried: list[str], why: str | None = None) -> str:
        """The one-line error when the root is in no mirror folder and was not downloaded;
        ``why``: why not (``MEDPFL_OFFLINE`` set, the download failed, registration required; see
        :mod:`medpfl.data.folder_download`)."""
        return (f"{self.name}: the official root folder ({' or '.join(self.root_names)}) is in no mirror folder "
                f"(tried: {', '.join(tried) or 'none'}). Get it from {self.url} ({self.access_terms}); "
                f"{self.fetch_hint + '; ' if self.fetch_hint else ''}put it into a folder and set "
                f"MEDPFL_DATA_MIRROR=/that/folder ({why or 'no automatic download for this data set'})")


# ------------------------------------------------------------------------------------------------
# The registry: one entry per folder data set. Reader branches plug in by replacing their
# placeholder below with one FolderDataset(...) entry (keep the blank lines between entries so
# that parallel additions merge without conflicts).
FOLDER_DATASETS: dict[str, FolderDataset] = {}

# ECG: PTB-XL 1.0.3 (PhysioNet; medpfl.data.ptbxl). SHA256SUMS.txt lists every file of the release.
FOLDER_DATASETS["ptbxl"] = FolderDataset(
    name="ptbxl", module="ptbxl", reader="load_ptbxl", kind="timeseries", num_classes=5,
    class_names=("NORM", "MI", "STTC", "CD", "HYP"),
    url="https://physionet.org/content/ptb-xl/1.0.3/",
    access_terms="open access, Creative Commons Attribution 4.0 (CC BY 4.0)",
    version="1.0.3",
    root_names=("ptb-xl-a-large-publicly-available-electrocardiography-dataset-1.0.3",
                "physionet.org/files/ptb-xl/1.0.3", "ptb-xl/1.0.3", "ptb-xl-1.0.3", "ptb-xl"),
    checksums="SHA256SUMS.txt",
    files=("ptbxl_database.csv", "scp_statements.csv", "records500/*"),
    fetch_hint=("the ZIP from that page unpacks to ptb-xl-a-large-publicly-available-electrocardiography-dataset-"
                "1.0.3/, or: wget -r -N -c -np https://physionet.org/files/ptb-xl/1.0.3/ gives "
                "physionet.org/files/ptb-xl/1.0.3/"),
)

# TEXT: Medical Abstracts (medpfl.data.text). The repository publishes no checksums: recorded at download.
# Class names: the corpus' medical_tc_labels.csv (the reader checks the file against these).
FOLDER_DATASETS["medabstracts"] = FolderDataset(
    name="medabstracts", module="text", reader="load_medical_abstracts", kind="tokens", num_classes=5,
    class_names=("neoplasms", "digestive system diseases", "nervous system diseases", "cardiovascular diseases",
                 "general pathological conditions"),
    url="https://github.com/sebischair/Medical-Abstracts-TC-Corpus",
    access_terms="CC BY-SA 3.0 (public GitHub repository, no registration)",
    version="repository HEAD (no releases; Schopf et al. 2023)",
    root_names=("Medical-Abstracts-TC-Corpus", "Medical-Abstracts-TC-Corpus-main"),
    checksums=None,
    files=("medical_tc_train.csv", "medical_tc_test.csv", "medical_tc_labels.csv"),
    fetch_hint=("git clone https://github.com/sebischair/Medical-Abstracts-TC-Corpus (or the repository's ZIP, "
                "which unpacks to Medical-Abstracts-TC-Corpus-main/)"),
    tokenizer="roberta-base", max_length=512,
)

# TEXT: PubMed 200k RCT (medpfl.data.text): the PubMed_200k_RCT/ folder of the repository (train.7z or an
# unpacked train.txt, test.txt; dev.txt is not read). No published checksums: recorded at download.
FOLDER_DATASETS["pubmed200k"] = FolderDataset(
    name="pubmed200k", module="text", reader="load_pubmed_rct", kind="tokens", num_classes=5,
    class_names=("BACKGROUND", "CONCLUSIONS", "METHODS", "OBJECTIVE", "RESULTS"),
    url="https://github.com/Franck-Dernoncourt/pubmed-rct",
    access_terms=("no licence file; built on the MEDLINE/PubMed 2016 baseline (NLM terms); public GitHub "
                  "repository, no registration"),
    version="repository HEAD (no releases; Dernoncourt & Lee 2017)",
    root_names=("pubmed-rct/PubMed_200k_RCT", "pubmed-rct-master/PubMed_200k_RCT", "PubMed_200k_RCT"),
    checksums=None,
    files=("train.*", "test.txt"),
    fetch_hint=("git clone https://github.com/Franck-Dernoncourt/pubmed-rct (its PubMed_200k_RCT/ folder holds "
                "train.7z, dev.txt, test.txt; train.7z is read as a stream, unpacking it is not needed)"),
    tokenizer="roberta-base", max_length=512,
)

# EEG: ADFTD, OpenNeuro ds004504 1.0.8 (medpfl.data.adftd). The per-file keys of the derivatives
# (medpfl.data.adftd_checksums) are not a file under the root, so the download stage records sizes and
# SHA-256 at download; medpfl.data.adftd.verify_recording checks a copy against the published keys.
FOLDER_DATASETS["adftd"] = FolderDataset(
    name="adftd", module="adftd", reader="load_adftd", kind="timeseries", num_classes=3,
    class_names=("C", "F", "A"),
    url="https://openneuro.org/datasets/ds004504/versions/1.0.8",
    access_terms="CC0 1.0 (public domain), no registration",
    version="1.0.8",
    root_names=("ds004504", "ds004504-1.0.8", "ds004504-download"),
    checksums=None,
    files=("participants.tsv", "derivatives/sub-*/eeg/sub-*_task-eyesclosed_eeg.set"),
    fetch_hint=("openneuro-py download --dataset=ds004504 --tag=1.0.8 gives ds004504/, or: aws s3 sync "
                "--no-sign-request s3://openneuro.org/ds004504 ds004504/ (only participants.tsv and derivatives/ "
                "are read)"),
)

# AUDIO: ICBHI 2017 (medpfl.data.audio): the official zip's ICBHI_final_database/ folder, with the official
# split list ICBHI_challenge_train_test.txt (a separate download) put into it. No published checksums.
FOLDER_DATASETS["icbhi"] = FolderDataset(
    name="icbhi", module="audio", reader="load_icbhi", kind="waveform", num_classes=4,
    class_names=("normal", "crackle", "wheeze", "both"),
    url="https://bhichallenge.med.auth.gr/ICBHI_2017_Challenge",
    access_terms=("free for research use (Rocha et al. 2019, cite the database paper); whether the site asks for "
                  "registration was not verified"),
    version="2017 (ICBHI_final_database)",
    root_names=("ICBHI_final_database", "ICBHI_2017/ICBHI_final_database"),
    checksums=None,
    files=("ICBHI_challenge_train_test.txt", "*.wav", "*.txt"),
    fetch_hint=("unpack ICBHI_final_database.zip (gives ICBHI_final_database/) and put "
                "ICBHI_challenge_train_test.txt from the same page into that folder"),
)

# AUDIO: SPRSound (medpfl.data.audio): the BioCAS2022/ folder of the repository. No published checksums.
FOLDER_DATASETS["sprsound"] = FolderDataset(
    name="sprsound", module="audio", reader="load_sprsound", kind="waveform", num_classes=7,
    class_names=("Normal", "Fine Crackle", "Wheeze", "Coarse Crackle", "Wheeze+Crackle", "Rhonchi", "Stridor"),
    url="https://github.com/SJTU-YONGFU-RESEARCH-GRP/SPRSound",
    access_terms=("public GitHub repository, no licence file found (terms unverified); cite Zhang et al. 2022, "
                  "IEEE TBioCAS 16(5)"),
    version="BioCAS2022 (repository HEAD)",
    root_names=("SPRSound/BioCAS2022", "SPRSound-main/BioCAS2022", "BioCAS2022"),
    checksums=None,
    files=("train2022_wav/*.wav", "train2022_json/*.json", "test2022_wav/*.wav", "test2022_json/*.json"),
    fetch_hint="git clone https://github.com/SJTU-YONGFU-RESEARCH-GRP/SPRSound (its BioCAS2022/ folder is read)",
)

# ------------------------------------------------------------------------------------------------


def folder_dataset(name: str) -> FolderDataset | None:
    """The registry entry of ``name``, or None when it is not a folder data set."""
    return FOLDER_DATASETS.get(name)


def read_checksum_file(path: Path) -> dict[str, str]:
    """A ``sha256sum``-style file (PhysioNet's ``SHA256SUMS.txt``): one ``<64 hex> <path>`` per
    line (one or two spaces; a ``*`` before the path marks binary mode; blank lines skipped) ->
    ``{relative path: lower-case hex}``. Raises DataError naming the file and line for anything
    else, or when the file is missing."""
    if not path.is_file():
        raise DataError(f"{path}: checksum file not found (the source publishes it at the data set root)")
    out: dict[str, str] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]?(.+)", line.rstrip("\r"))
        if not m:
            raise DataError(f"{path}: line {i} is not '<sha256> <path>': {line[:80]!r}")
        rel = m.group(2).strip()
        out[rel[2:] if rel.startswith("./") else rel] = m.group(1).lower()
    return out
