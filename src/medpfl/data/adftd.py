"""ADFTD (OpenNeuro ds004504 1.0.8) reader and FHBench preprocessing: labels, EEG, 1-s windows.

A building block of FHBench's EEG track, like :mod:`medpfl.data.ptbxl` for ECG. It is **not yet
wired** into the download -> preprocess -> partition stages (no Snakemake rule, no
:class:`DatasetSpec`), and no model consumes it yet (``docs/multimodal.md``, "ADFTD (EEG)").

Sources
-------
- [D] ds004504 1.0.8, https://openneuro.org/datasets/ds004504/versions/1.0.8 (Miltiadous et al.
  2023, doi:10.3390/data8060095; CC0), as in its git repository (github.com/OpenNeuroDatasets/
  ds004504, tag ``1.0.8``): ``participants.tsv`` (tab-separated, CRLF line ends; columns
  ``participant_id`` ``sub-001`` .. ``sub-088``, ``Gender``, ``Age``, ``Group`` (A Alzheimer's
  disease 36, F frontotemporal dementia 23, C healthy control 29), ``MMSE``); the preprocessed
  recordings ``derivatives/sub-0NN/eeg/sub-0NN_task-eyesclosed_eeg.set`` (EEGLAB, data inside the
  ``.set``; band-pass 0.5-45 Hz, A1-A2 reference, ASR and ICA cleaned, per the README); the
  channels of ``sub-0NN/eeg/*_channels.tsv`` (identical for all 88 subjects): Fp1 Fp2 F3 F4 C3 C4
  P3 P4 O1 O2 F7 F8 T3 T4 T5 T6 Fz Cz Pz (:data:`CHANNELS`), 500 Hz.
- [P] the FHBench paper, Appendix A, and [C] its code (github.com/wph6/FHBench at 0df1989,
  ``Timeseries_Lora/data_preprocessing/ADFTD.py`` and ``datautil/prepare_data.py``), as
  summarised in ``/work/shared/docs/methods-pfedkdwcl-epfl.md`` part B (ADFTD bullet) and
  ``/work/shared/docs/fhbench-multimodal-notes.md`` (ADFTD row, "Faults"); [C] takes its
  preprocessing from Medformer (Wang et al. 2024, github.com/DL4mHealth/Medformer,
  ``data_preprocessing/ADFTD_preprocessing.ipynb``, the same functions).

Rules implemented (each with its source)
----------------------------------------
1. Input [P, C]: the **derivatives** only (the raw ``sub-0NN/eeg/*.set`` are never read), one
   recording per subject, read with ``mne.io.read_raw_eeglab`` (values in volts, as MNE gives them
   and as [C] uses them).
2. Labels [C]: ``Group`` C -> 0, F -> 1, A -> 2 (:data:`CLASS_NAMES`), **keyed by subject id**:
   subject ``sub-0NN`` gets the ``Group`` of its own ``participants.tsv`` row, and subjects are
   processed in ascending id order. ([C] saves features in ``os.listdir`` order but labels in
   ``participants.tsv`` order: a fault, notes "Faults"; not copied.) ``subject_id`` = the number
   in ``participant_id`` (1 for ``sub-001``).
3. Channels [D]: the 19 channels of the file, in the file's order, which must be
   :data:`CHANNELS` (names and order) in every file, else DataError naming the file; 500 Hz.
4. Resampling [P "linear resampling to 256 Hz", C]: per channel, linear interpolation onto
   ``int(n / 500 * 256)`` points spread evenly from the first to the last sample
   (:func:`medpfl.data.signals.linear_resample`, ``grid="fhbench"``, which is what [C]'s
   ``scipy.interpolate.interp1d(kind="linear")`` on ``np.linspace`` grids computes).
   ``resample_grid="uniform"`` offers an exact 256 Hz grid from the first sample instead.
5. Windows [P "non-overlapping 1-second segments, starting from the middle of each recording", C]:
   256-sample windows with one boundary at the middle sample ``m // 2`` of the ``m`` resampled
   samples, as many whole windows as fit on each side (the < 1 s left at each end dropped)
   (:func:`medpfl.data.signals.middle_window_starts`). A recording with no whole window is an
   error.
6. z-score [C ``normalize_batch_ts`` at load time]: ``zscore="window"`` (default): each channel of
   each 1-s window to mean 0, population std 1. A (near-)constant channel (std <= 1e-8 V, i.e.
   0.01 uV; [C] only guards std == 0) is only centred. ``zscore="recording"`` (offered): each
   channel over the whole resampled recording instead, windows cut afterwards; ``zscore="none"``:
   volts as read.
7. Padding [C]: each (19, 256) window left-padded with zeros to (19, 512), float32 (real samples
   in the last 256 columns).

Checksums: :data:`medpfl.data.adftd_checksums.DERIVATIVE_KEYS` holds the git-annex key (size and
SHA-256) of each derivative ``.set`` of version 1.0.8; :func:`verify_recording` checks a file.

Errors: :class:`medpfl.errors.DataError` naming the file (and row or subject), for a missing
root, a missing or malformed ``participants.tsv`` (column, id, group, duplicate), a derivative
folder without a ``participants.tsv`` row, a missing or unreadable ``.set``, a channel list or
sampling rate that differs from [D], non-finite values, a recording under 1 s, a checksum
mismatch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medpfl.data.signals import left_pad, linear_resample, middle_window_starts, standardise
from medpfl.errors import DataError
from medpfl.io import sha256sum

OFFICIAL_URL = "https://openneuro.org/datasets/ds004504/versions/1.0.8"
ACCESS_TERMS = ("CC0 1.0 (public domain), no registration; download ds004504 1.0.8 from OpenNeuro "
                "(openneuro-py, DataLad or S3)")
DATASET_VERSION = "1.0.8"

PARTICIPANTS_TSV = "participants.tsv"
PARTICIPANTS_COLUMNS = ("participant_id", "Group")
DERIVATIVES_DIR = "derivatives"
TASK = "eyesclosed"

#: the 19 channels of every recording, in the files' order [D, *_channels.tsv]
CHANNELS = ("Fp1", "Fp2", "F3", "F4", "C3", "C4", "P3", "P4", "O1", "O2",
            "F7", "F8", "T3", "T4", "T5", "T6", "Fz", "Cz", "Pz")
GROUPS = ("C", "F", "A")  # participants.tsv Group codes; label = index [C]
CLASS_NAMES = GROUPS
LABELS = {g: i for i, g in enumerate(GROUPS)}
GROUP_NAMES = {"C": "healthy control", "F": "frontotemporal dementia", "A": "Alzheimer's disease"}
FS_IN = 500  # Hz [D]
FS_TARGET = 256  # Hz [P]
WINDOW = FS_TARGET  # samples: 1 s at 256 Hz [P]
PAD_TO = 512  # samples, MOMENT's input length [C]
ZSCORE_MODES = ("window", "recording", "none")

_PID = re.compile(r"^sub-(\d+)$")


def recording_path(participant_id: str) -> str:
    """``derivatives/<id>/eeg/<id>_task-eyesclosed_eeg.set``, relative to the data set root [D]."""
    return f"{DERIVATIVES_DIR}/{participant_id}/eeg/{participant_id}_task-{TASK}_eeg.set"


def _missing_root(root: Path) -> DataError:
    return DataError(f"{root}: ADFTD root not found; get OpenNeuro ds004504 {DATASET_VERSION} from {OFFICIAL_URL} "
                     f"({ACCESS_TERMS}) and pass the folder holding {PARTICIPANTS_TSV} and {DERIVATIVES_DIR}/")


def read_participants(root: str | Path) -> pd.DataFrame:
    """``participants.tsv`` -> one row per subject, sorted by subject id.

    Returns columns ``subject_id`` (int64, 1 for ``sub-001``), ``participant_id`` (str),
    ``group`` (str, A/F/C), ``label`` (int64, C 0, F 1, A 2). Raises DataError naming the file
    (and row) for a missing file or column, an id not of the form ``sub-<digits>``, a duplicated
    id or a ``Group`` outside A/F/C.
    """
    root = Path(root)
    if not root.is_dir():
        raise _missing_root(root)
    path = root / PARTICIPANTS_TSV
    if not path.is_file():
        raise DataError(f"{path}: file not found (ds004504 keeps it at the data set root)")
    try:
        df = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    except Exception as e:  # noqa: BLE001 - any parse failure is reported with the file name
        raise DataError(f"{path}: cannot be read as a tab-separated table ({e})") from e
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in PARTICIPANTS_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} (expected {', '.join(PARTICIPANTS_COLUMNS)})")
    rows = []
    for i, (pid, group) in enumerate(zip(df["participant_id"], df["Group"])):
        pid, group = str(pid).strip(), str(group).strip()
        m = _PID.match(pid)
        if not m:
            raise DataError(f"{path}: row {i + 1}: participant_id {pid!r} is not of the form sub-<digits>")
        if group not in LABELS:
            raise DataError(f"{path}: row {i + 1} ({pid}): Group {group!r} is not one of {', '.join(sorted(LABELS))}")
        rows.append((int(m.group(1)), pid, group, LABELS[group]))
    out = pd.DataFrame(rows, columns=["subject_id", "participant_id", "group", "label"])
    dup = out.loc[out["subject_id"].duplicated(keep=False), "participant_id"].tolist()
    if dup:
        raise DataError(f"{path}: duplicated participant_id {sorted(set(dup))}")
    out = out.astype({"subject_id": "int64", "label": "int64"})
    return out.sort_values("subject_id", kind="stable").reset_index(drop=True)


def check_derivatives(root: str | Path, participants: pd.DataFrame) -> None:
    """Every ``derivatives/sub-*`` folder must have a ``participants.tsv`` row (DataError naming both)."""
    root = Path(root)
    deriv = root / DERIVATIVES_DIR
    if not deriv.is_dir():
        raise DataError(f"{deriv}: folder not found (ds004504 keeps the preprocessed recordings there)")
    known = set(participants["participant_id"])
    for d in sorted(deriv.glob("sub-*")):
        if d.is_dir() and d.name not in known:
            raise DataError(f"{root / PARTICIPANTS_TSV}: no row for {d.name} (folder {d} exists)")


def read_recording(path: str | Path, channels: tuple[str, ...] = CHANNELS) -> np.ndarray:
    """One derivative ``.set`` as float64 ``[19, n]`` in volts (``mne.io.read_raw_eeglab``), checked.

    Raises DataError naming the file when it is missing or cannot be read by MNE, its channel
    names (and order) differ from ``channels`` (rule 3), its sampling rate is not 500 Hz, it holds
    non-finite values or fewer than 2 samples.
    """
    import mne  # noqa: PLC0415 - optional heavy import, only for reading recordings

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: recording not found (expected for its {PARTICIPANTS_TSV} row)")
    try:
        raw = mne.io.read_raw_eeglab(path, preload=True, verbose="error")
    except Exception as e:  # noqa: BLE001 - MNE raises many types for a damaged file
        raise DataError(f"{path}: cannot be read by mne.io.read_raw_eeglab ({type(e).__name__}: {e})") from e
    names = tuple(raw.ch_names)
    if names != tuple(channels):
        extra = [c for c in names if c not in channels]
        lacking = [c for c in channels if c not in names]
        what = (f"extra {extra}, missing {lacking}" if extra or lacking else "same names, different order")
        raise DataError(f"{path}: channels {list(names)} differ from the expected {len(channels)} ({what})")
    if float(raw.info["sfreq"]) != FS_IN:
        raise DataError(f"{path}: sampling rate {raw.info['sfreq']} Hz, expected {FS_IN} Hz")
    data = raw.get_data()
    if data.shape[1] < 2:
        raise DataError(f"{path}: {data.shape[1]} samples")
    if not np.isfinite(data).all():
        raise DataError(f"{path}: non-finite sample values")
    return data


def recording_windows(data: np.ndarray, zscore: str = "window", resample_grid: str = "fhbench",
                      pad_to: int = PAD_TO, name: str = "recording") -> tuple[np.ndarray, np.ndarray]:
    """One recording ``[C, n]`` at 500 Hz -> (float32 ``[K, C, pad_to]``, int64 window starts ``[K]``).

    Rules 4-7 of the module docstring; the starts are sample indices in the resampled (256 Hz)
    recording. ``name`` labels the DataError raised when no whole 1-s window fits (``n`` under
    about 1 s).
    """
    if zscore not in ZSCORE_MODES:
        raise ValueError(f"zscore {zscore!r} is not one of {ZSCORE_MODES}")
    x = linear_resample(data, FS_IN, FS_TARGET, grid=resample_grid)  # [C, m]
    starts = middle_window_starts(x.shape[1], WINDOW)
    if starts.size == 0:
        raise DataError(f"{name}: {data.shape[1]} samples at {FS_IN} Hz ({x.shape[1]} at {FS_TARGET} Hz) "
                        f"hold no whole {WINDOW}-sample window")
    if zscore == "recording":
        x = standardise(x, axis=1)
    w = np.stack([x[:, s:s + WINDOW] for s in starts])  # [K, C, 256]
    if zscore == "window":
        w = standardise(w, axis=2)
    return left_pad(w, pad_to), starts


@dataclass
class AdftdSamples:
    """The preprocessed ADFTD windows.

    ``x``: float32 ``[N, 19, pad_to]`` (N = all windows of the loaded recordings; 256 real samples,
    1 s at 256 Hz, in the last 256 columns, zeros before; channels in :data:`CHANNELS` order).
    ``table``: one row per window, in the order of ``x`` (subjects by id, then windows in time):
    ``sample_id`` (int64, row in ``x``), ``subject_id`` (int64), ``participant_id`` (str),
    ``group`` (str), ``label`` (int64, C 0, F 1, A 2), ``window`` (int64, 0.. within the recording),
    ``start`` (int64, first sample of the window in the 256 Hz recording). ``class_names``:
    :data:`CLASS_NAMES`. ``recordings``: one row per loaded subject: ``subject_id``,
    ``participant_id``, ``group``, ``label``, ``file`` (relative path), ``n_samples`` (at 500 Hz),
    ``n_resampled`` (at 256 Hz), ``n_windows``.
    """

    x: np.ndarray
    table: pd.DataFrame
    class_names: tuple[str, ...]
    recordings: pd.DataFrame


def load_adftd(root: str | Path, zscore: str = "window", resample_grid: str = "fhbench", pad_to: int = PAD_TO,
               limit: int | None = None) -> AdftdSamples:
    """Read ADFTD (ds004504 1.0.8) at ``root`` and apply the FHBench preprocessing (module docstring).

    ``root`` holds ``participants.tsv`` and ``derivatives/``. ``zscore``: ``"window"`` (FHBench,
    default), ``"recording"`` or ``"none"`` (rule 6). ``resample_grid``: ``"fhbench"`` (default) or
    ``"uniform"`` (rule 4). ``limit``: only the first ``limit`` subjects by id, for smoke runs.
    Memory: the full set is about 69,752 windows x 19 x 512 x 4 B = 2.7 GB, plus the unpadded
    windows (half that) while loading. Raises DataError as listed in the module docstring.
    """
    root = Path(root)
    participants = read_participants(root)
    check_derivatives(root, participants)
    if limit is not None:
        participants = participants.iloc[:limit].reset_index(drop=True)
    chunks, starts_all, rec_rows = [], [], []
    for sid, pid, group, label in participants[["subject_id", "participant_id", "group", "label"]].itertuples(
            index=False):
        rel = recording_path(pid)
        data = read_recording(root / rel)
        w, starts = recording_windows(data, zscore, resample_grid, pad_to=WINDOW, name=str(root / rel))
        chunks.append(w)
        starts_all.append(starts)
        rec_rows.append((sid, pid, group, label, rel, data.shape[1], int(data.shape[1] / FS_IN * FS_TARGET),
                         len(starts)))
    recordings = pd.DataFrame(rec_rows, columns=["subject_id", "participant_id", "group", "label", "file",
                                                 "n_samples", "n_resampled", "n_windows"])
    recordings = recordings.astype({"subject_id": "int64", "label": "int64", "n_samples": "int64",
                                    "n_resampled": "int64", "n_windows": "int64"})
    n = int(recordings["n_windows"].sum())
    x = np.zeros((n, len(CHANNELS), pad_to), dtype=np.float32)
    i = 0
    for w in chunks:  # pad into the final array chunk by chunk (no second full-size copy)
        x[i:i + len(w)] = left_pad(w, pad_to)
        i += len(w)
    rep = np.repeat(np.arange(len(recordings)), recordings["n_windows"].to_numpy())
    table = pd.DataFrame({
        "sample_id": np.arange(n, dtype="int64"),
        "subject_id": recordings["subject_id"].to_numpy()[rep],
        "participant_id": recordings["participant_id"].to_numpy()[rep],
        "group": recordings["group"].to_numpy()[rep],
        "label": recordings["label"].to_numpy()[rep],
        "window": np.concatenate([np.arange(len(s), dtype="int64") for s in starts_all]) if starts_all
        else np.zeros(0, "int64"),
        "start": np.concatenate(starts_all) if starts_all else np.zeros(0, "int64"),
    })
    return AdftdSamples(x=x, table=table, class_names=CLASS_NAMES, recordings=recordings)


# ----------------------------------------------------------------------------- checksums

_ANNEX_KEY = re.compile(r"^SHA256E?-s(\d+)--([0-9a-f]{64})(\.[A-Za-z0-9.]+)?$")


def parse_annex_key(key: str) -> tuple[int, str]:
    """A git-annex ``SHA256E`` / ``SHA256`` key -> (size in bytes, lower-case SHA-256 hex).

    Accepts the bare key (``SHA256E-s24357408--2bee...0efe0d.set``) or a symlink target ending in
    it (``../../.git/annex/objects/j7/xF/<key>/<key>``), as ds004504's git repository stores each
    annexed file. Raises ValueError for anything else (other backends, extra key fields).
    """
    name = key.rstrip("/").rsplit("/", 1)[-1]
    m = _ANNEX_KEY.match(name)
    if not m:
        raise ValueError(f"{key!r} is not a git-annex SHA256E-s<size>--<sha256>[.ext] key")
    return int(m.group(1)), m.group(2)


def verify_file(path: str | Path, key: str) -> None:
    """Check a file's size and SHA-256 against a git-annex key; DataError naming the file if not."""
    path = Path(path)
    size, digest = parse_annex_key(key)
    if not path.is_file():
        raise DataError(f"{path}: file not found (expected size {size}, sha256 {digest})")
    actual = path.stat().st_size
    if actual != size:
        raise DataError(f"{path}: {actual} bytes, expected {size} (git-annex key {key})")
    got = sha256sum(path)
    if got != digest:
        raise DataError(f"{path}: sha256 {got}, expected {digest} (git-annex key {key})")


def verify_recording(root: str | Path, subject_id: int) -> None:
    """Check ``derivatives/sub-0NN/...set`` under ``root`` against ds004504 1.0.8's key for subject ``subject_id``.

    Raises KeyError for a subject id without a 1.0.8 key, DataError (naming the file) on a
    mismatch. Keys: :data:`medpfl.data.adftd_checksums.DERIVATIVE_KEYS`.
    """
    from medpfl.data.adftd_checksums import DERIVATIVE_KEYS  # noqa: PLC0415

    verify_file(Path(root) / recording_path(f"sub-{subject_id:03d}"), DERIVATIVE_KEYS[subject_id])


__all__ = ["ACCESS_TERMS", "CHANNELS", "CLASS_NAMES", "OFFICIAL_URL", "PARTICIPANTS_TSV",
           "AdftdSamples", "load_adftd", "parse_annex_key", "read_participants", "read_recording",
           "recording_path", "recording_windows", "verify_file", "verify_recording"]
