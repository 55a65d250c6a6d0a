"""PTB-XL (PhysioNet 1.0.3) reader and FHBench preprocessing: labels, signals, 1-s samples.

FHBench's ECG track. Wired into the download -> preprocess -> partition stages as the folder
data set ``ptbxl`` (:data:`medpfl.data.multimodal.FOLDER_DATASETS`; ``docs/multimodal.md``).

Sources
-------
- [D] PTB-XL 1.0.3, https://physionet.org/content/ptb-xl/1.0.3/ (Wagner et al. 2020,
  CC BY 4.0): ``ptbxl_database.csv`` (one row per record: ``ecg_id``, ``patient_id`` (a float in
  the file), ``scp_codes`` (a Python dict literal ``{code: likelihood %}``), ``strat_fold``
  (1-10), ``filename_hr`` (``records500/NNNNN/XXXXX_hr``, relative to the data set root), ...),
  ``scp_statements.csv`` (first, unnamed column: the SCP code; ``diagnostic_class``: one of
  NORM, MI, STTC, CD, HYP for the diagnostic statements, empty otherwise), and the 500 Hz
  records ``records500/NNNNN/XXXXX_hr.{hea,dat}`` (12 leads, 10 s, 5000 samples, in mV).
- [P] the FHBench paper, Appendix A, and [C] its code, as summarised in
  ``/work/shared/docs/methods-pfedkdwcl-epfl.md`` part B (PTB-XL bullet) and
  ``/work/shared/docs/fhbench-multimodal-notes.md`` (PTB-XL row, "Faults"). FHBench takes its
  PTB-XL preprocessing from Medformer (Wang et al. 2024).

Rules implemented (each with its source)
----------------------------------------
1. Record label [P, Medformer]: the record's SCP code with the highest likelihood, mapped to its
   ``diagnostic_class`` in ``scp_statements.csv``. Ties: the first of the tied codes in the
   order of the ``scp_codes`` string (Python's ``max``); the spec does not say, so this is our
   choice. A record whose top code has no diagnostic class is "other".
2. Patient filter [P]: "Patients whose trials disagree, or fall into 'others', are dropped."
   Read at patient level (the spec's wording, the reading taken here): a patient is kept only if
   *every* one of its records has a superclass and they are all the same; otherwise all of the
   patient's records are dropped (an "other" record drops its patient, not only itself).
   Cross-check for the real data (not verifiable offline): Medformer reports 17,596 subjects and
   191,400 samples (= 19,140 records x 10); the notes' "17,596 records kept" reads as patients.
3. Labels [P]: NORM 0, MI 1, STTC 2, CD 3, HYP 4 (:data:`SUPERCLASSES`).
4. Signal [D, P]: the 500 Hz record (``filename_hr``) read with ``wfdb.rdsamp``, records in
   ``ecg_id`` order (not ``os.listdir`` order, an FHBench fault, notes "Faults").
5. Resampling [P]: 500 Hz -> 250 Hz with ``scipy.signal.resample_poly`` (polyphase FIR,
   Kaiser window). **Deviation**: FHBench uses torchaudio's resampler (windowed sinc); torchaudio
   2.11 does not load under torch 2.13 (notes), so the anti-aliasing filters differ slightly.
6. Record standardisation [P, Medformer "StandardScaler per trial"]: each lead of the resampled
   10-s record to mean 0, std 1 over time (population std, as sklearn's ``StandardScaler``; a
   (near-)constant lead, std <= 1e-8, is only centred, scale 1, as sklearn does).
7. Samples [P]: the first 10 s (2,500 samples at 250 Hz) cut into ten consecutive,
   non-overlapping 1-s windows of 250 samples, window ``w`` = samples ``[250 w, 250 (w + 1))``.
8. Window normalisation [C, at load time]: each 1-s sample z-normalised per lead again
   (``normalize_ts``); on by default (``window_normalize=True``). FHBench's ``normalize_ts``
   epsilon was not seen; here a (near-)constant lead, std <= 1e-8, is only centred (as rule 6).
9. Padding [C]: each (12, 250) sample left-padded with zeros to (12, 512) (real samples in the
   last 250 columns), float32.

Errors: :class:`medpfl.errors.DataError` naming the file, for a missing CSV or column, an
unparsable ``scp_codes``, a missing record file, a record with the wrong lead count, sampling
rate or a length under 10 s.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from math import gcd
from pathlib import Path

import numpy as np
import pandas as pd

from medpfl.data.signals import STD_FLOOR, left_pad, standardise  # noqa: F401 - re-exported
from medpfl.errors import DataError

SUPERCLASSES = ("NORM", "MI", "STTC", "CD", "HYP")  # label = index [P]
LABELS = {name: i for i, name in enumerate(SUPERCLASSES)}
N_LEADS = 12
FS_HR = 500  # Hz, the records500 version [D]
FS_TARGET = 250  # Hz [P]
RECORD_SECONDS = 10  # s, every PTB-XL record [D]
WINDOW_SECONDS = 1  # s [P]
N_WINDOWS = RECORD_SECONDS // WINDOW_SECONDS  # 10 samples per record [P]
PAD_TO = 512  # samples, MOMENT's input length [C]

DATABASE_CSV = "ptbxl_database.csv"
STATEMENTS_CSV = "scp_statements.csv"
DATABASE_COLUMNS = ("ecg_id", "patient_id", "scp_codes", "strat_fold", "filename_hr")
STATEMENTS_COLUMNS = ("diagnostic_class",)

# Official download. The data set's checksums are in SHA256SUMS.txt at the same address (the
# download stage checks them: medpfl.data.sources.fetch_folder).
OFFICIAL_URL = "https://physionet.org/files/ptb-xl/1.0.3/"
OFFICIAL_SHA256SUMS = OFFICIAL_URL + "SHA256SUMS.txt"
ACCESS_TERMS = "open access, Creative Commons Attribution 4.0 (CC BY 4.0)"


def _read_csv(path: Path, columns: tuple[str, ...], **kw) -> pd.DataFrame:
    if not path.is_file():
        raise DataError(f"{path}: file not found (PTB-XL 1.0.3 keeps it at the data set root)")
    try:
        df = pd.read_csv(path, **kw)
    except Exception as e:  # noqa: BLE001 - any parse failure is reported with the file name
        raise DataError(f"{path}: cannot be read as CSV ({e})") from e
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} (expected {', '.join(columns)})")
    return df


def read_statements(root: str | Path) -> dict[str, str]:
    """``scp_statements.csv`` -> ``{SCP code: superclass}`` for the diagnostic statements.

    The code is the file's first (unnamed) column; codes with an empty ``diagnostic_class``
    (form and rhythm statements) are left out. A class outside :data:`SUPERCLASSES` is an error.
    """
    path = Path(root) / STATEMENTS_CSV
    df = _read_csv(path, STATEMENTS_COLUMNS, index_col=0)
    mapping = {str(code): str(cls) for code, cls in df["diagnostic_class"].items() if pd.notna(cls)}
    bad = sorted({c for c in mapping.values() if c not in LABELS})
    if bad:
        raise DataError(f"{path}: diagnostic_class value(s) {bad} not in {list(SUPERCLASSES)}")
    return mapping


def _parse_codes(text: object, path: Path, ecg_id: int) -> dict[str, float]:
    try:
        codes = ast.literal_eval(text) if isinstance(text, str) else None
    except (ValueError, SyntaxError):
        codes = None
    if not isinstance(codes, dict):
        raise DataError(f"{path}: ecg_id {ecg_id}: scp_codes {text!r} is not a dict literal")
    return {str(k): float(v) for k, v in codes.items()}


def top_code(codes: dict[str, float]) -> str | None:
    """The highest-likelihood SCP code (ties: the first in the dict's order); None if empty."""
    return max(codes, key=codes.__getitem__) if codes else None


def read_database(root: str | Path) -> pd.DataFrame:
    """``ptbxl_database.csv`` with one row per record, sorted by ``ecg_id``, labelled.

    Returns columns ``ecg_id`` (int64), ``patient_id`` (int64; a float in the file),
    ``strat_fold`` (int64), ``filename_hr`` (str), ``top_code`` (str or None),
    ``superclass`` (str or None: None = "other") for *every* record (no filtering).
    """
    path = Path(root) / DATABASE_CSV
    df = _read_csv(path, DATABASE_COLUMNS)
    if df["ecg_id"].duplicated().any():
        dup = df.loc[df["ecg_id"].duplicated(), "ecg_id"].tolist()[:5]
        raise DataError(f"{path}: duplicated ecg_id {dup}")
    for col in ("ecg_id", "patient_id", "strat_fold"):
        if df[col].isna().any():
            raise DataError(f"{path}: column {col} has empty values")
    mapping = read_statements(root)
    df = df.sort_values("ecg_id", kind="stable").reset_index(drop=True)
    out = pd.DataFrame({
        "ecg_id": df["ecg_id"].astype("int64"),
        "patient_id": df["patient_id"].astype("float64").round().astype("int64"),
        "strat_fold": df["strat_fold"].astype("int64"),
        "filename_hr": df["filename_hr"].astype(str),
    })
    tops = [top_code(_parse_codes(t, path, int(e))) for t, e in zip(df["scp_codes"], out["ecg_id"])]
    out["top_code"] = pd.Series(tops, dtype=object)
    out["superclass"] = pd.Series([mapping.get(c) if c is not None else None for c in tops], dtype=object)
    return out


def label_records(db: pd.DataFrame) -> pd.DataFrame:
    """Apply FHBench's patient filter (module rules 1-3) to :func:`read_database`'s table.

    Keeps the records of patients whose records all have the same superclass; adds ``label``
    (int64, NORM 0, MI 1, STTC 2, CD 3, HYP 4). Order (``ecg_id``) is kept.
    """
    sc = db["superclass"]
    per_patient = sc.fillna("<other>").groupby(db["patient_id"]).agg(lambda s: set(s))
    good = per_patient[per_patient.map(lambda s: len(s) == 1 and "<other>" not in s)].index
    kept = db[db["patient_id"].isin(good)].copy().reset_index(drop=True)
    kept["label"] = kept["superclass"].map(LABELS).astype("int64")
    return kept


def read_record(root: str | Path, filename_hr: str) -> np.ndarray:
    """One 500 Hz record as float64 ``[T, 12]`` (mV), ``T >= 5000``, checked against [D].

    Raises DataError naming the file when the ``.hea``/``.dat`` is missing or unreadable, the
    lead count is not 12, the sampling rate is not 500 Hz or the record is shorter than 10 s.
    """
    import wfdb  # noqa: PLC0415 - optional heavy import, only for reading records

    base = Path(root) / filename_hr
    for ext in (".hea", ".dat"):
        if not base.with_name(base.name + ext).is_file():
            raise DataError(f"{base}{ext}: record file not found (from {DATABASE_CSV} filename_hr)")
    try:
        sig, fields = wfdb.rdsamp(str(base))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{base}.hea: cannot be read by wfdb.rdsamp ({e})") from e
    if sig.ndim != 2 or sig.shape[1] != N_LEADS or fields.get("n_sig") != N_LEADS:
        raise DataError(f"{base}.hea: {fields.get('n_sig')} leads, expected {N_LEADS}")
    if float(fields.get("fs")) != FS_HR:
        raise DataError(f"{base}.hea: sampling rate {fields.get('fs')} Hz, expected {FS_HR} Hz")
    if sig.shape[0] < FS_HR * RECORD_SECONDS:
        raise DataError(f"{base}.hea: {sig.shape[0]} samples, expected at least {FS_HR * RECORD_SECONDS} "
                        f"({RECORD_SECONDS} s at {FS_HR} Hz)")
    if not np.isfinite(sig).all():
        raise DataError(f"{base}.dat: non-finite sample values")
    return sig


def resample(sig: np.ndarray, fs_in: int = FS_HR, fs_out: int = FS_TARGET) -> np.ndarray:
    """``[T, C]`` at ``fs_in`` Hz -> ``[ceil(T * fs_out / fs_in), C]`` (scipy ``resample_poly``).

    The signal is taken as zero beyond its ends (``resample_poly``'s default ``padtype``), as
    torchaudio's resampler also zero-pads, so the first and last ~0.1 s carry a filter edge
    transient in both; the filters themselves differ (deviation, module rule 5).
    """
    from scipy.signal import resample_poly  # noqa: PLC0415

    g = gcd(fs_in, fs_out)
    return resample_poly(sig, fs_out // g, fs_in // g, axis=0)


def record_windows(sig_hr: np.ndarray, window_normalize: bool = True, pad_to: int = PAD_TO) -> np.ndarray:
    """One 500 Hz record ``[T, 12]`` -> float32 ``[10, 12, pad_to]`` (module rules 5-9)."""
    x = resample(sig_hr)[: FS_TARGET * RECORD_SECONDS]  # [2500, 12] at 250 Hz
    x = standardise(x, axis=0)  # per lead over the 10 s
    win = FS_TARGET * WINDOW_SECONDS
    w = x.reshape(N_WINDOWS, win, N_LEADS).transpose(0, 2, 1)  # [10, 12, 250]
    if window_normalize:
        w = standardise(w, axis=2)
    return left_pad(w, pad_to)


@dataclass
class PtbxlSamples:
    """The preprocessed samples.

    ``x``: float32 ``[N, 12, 512]`` (N = 10 x kept records; 250 real samples at 250 Hz, i.e. 1 s,
    in the last 250 columns, zeros before). ``table``: one row per sample, in the order of ``x``
    (records by ``ecg_id``, then ``window`` 0-9): ``sample_id`` (row in ``x``), ``ecg_id``,
    ``patient_id``, ``subject_id`` (int64, = ``patient_id``: the shared reader interface's name,
    read by the ``subject`` partition scheme), ``strat_fold``, ``window`` (the 1-s window's
    index, its start in seconds), ``label`` (int64, NORM 0, MI 1, STTC 2, CD 3, HYP 4); no
    ``split`` (FHBench pools every record; ``strat_fold`` keeps PhysioNet's recommended folds).
    ``records``: the kept records (:func:`label_records`). ``class_names``: :data:`SUPERCLASSES`.
    """

    x: np.ndarray
    table: pd.DataFrame
    records: pd.DataFrame
    class_names: tuple[str, ...] = SUPERCLASSES


def load_ptbxl(root: str | Path, window_normalize: bool = True, pad_to: int = PAD_TO,
               limit: int | None = None) -> PtbxlSamples:
    """Read PTB-XL 1.0.3 at ``root`` and apply the FHBench preprocessing (module docstring).

    ``limit``: only the first ``limit`` kept records (by ``ecg_id``), for smoke runs.
    Memory: the full set is about 19,140 records x 10 x 12 x 512 x 4 B = 4.7 GB.
    Raises DataError naming :data:`OFFICIAL_URL` and :data:`ACCESS_TERMS` when ``root`` is not
    a folder, and naming the file for a missing or damaged one.
    """
    if not Path(root).is_dir():
        raise DataError(f"{root}: no PTB-XL 1.0.3 folder here; get it from {OFFICIAL_URL} ({ACCESS_TERMS})")
    records = label_records(read_database(root))
    if limit is not None:
        records = records.iloc[:limit].reset_index(drop=True)
    n = len(records)
    x = np.zeros((n * N_WINDOWS, N_LEADS, pad_to), dtype=np.float32)
    for i, fn in enumerate(records["filename_hr"]):
        x[i * N_WINDOWS:(i + 1) * N_WINDOWS] = record_windows(read_record(root, fn), window_normalize, pad_to)
    rep = np.repeat(np.arange(n), N_WINDOWS)
    table = pd.DataFrame({
        "sample_id": np.arange(n * N_WINDOWS, dtype="int64"),
        "ecg_id": records["ecg_id"].to_numpy()[rep],
        "patient_id": records["patient_id"].to_numpy()[rep],
        "subject_id": records["patient_id"].to_numpy()[rep],
        "strat_fold": records["strat_fold"].to_numpy()[rep],
        "window": np.tile(np.arange(N_WINDOWS, dtype="int64"), n),
        "label": records["label"].to_numpy()[rep],
    })
    return PtbxlSamples(x=x, table=table, records=records)
