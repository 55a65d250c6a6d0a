"""ICBHI 2017 and SPRSound readers with FHBench's respiratory-audio preprocessing.

These are building blocks of FHBench's audio track. They are **not yet wired** into the
download -> preprocess -> partition stages (no Snakemake rule, no :class:`DatasetSpec`), and no
model (wav2vec2) consumes them yet (``docs/multimodal.md``, sections "ICBHI 2017" and
"SPRSound").

Sources
-------
- [D-ICBHI] ICBHI 2017 Respiratory Sound Database (Rocha et al. 2019),
  https://bhichallenge.med.auth.gr/ICBHI_2017_Challenge: one folder (``ICBHI_final_database``)
  of 920 ``.wav`` recordings, each with a same-stem ``.txt`` annotation, one respiratory cycle a
  line: onset (s), offset (s), crackles (0/1), wheezes (0/1), tab-separated, no header; the
  official split ``ICBHI_challenge_train_test.txt`` (a separate download), one line per
  recording: ``<stem>\\t<train|test>``. Stems start with the patient number
  (``101_1b1_Al_sc_Meditron``). Sampling rates differ by device (4 kHz, 10 kHz, 44.1 kHz).
- [D-SPRS] SPRSound (Zhang et al. 2022), github.com/SJTU-YONGFU-RESEARCH-GRP/SPRSound, folder
  ``BioCAS2022/`` (its README): ``train2022_wav/`` + ``train2022_json/`` (1,949 recordings),
  ``test2022_wav/`` (734) with annotations in ``test2022_json/inter_test_json/`` (355) and
  ``test2022_json/intra_test_json/`` (379). A JSON holds ``record_annotation`` and
  ``event_annotation``: a list of ``{"start", "end", "type"}`` with start/end in ms (strings in
  the release; the top README shows integers, both accepted). File names are
  ``<patient>_<age>_<gender>_<location>_<recording>`` (e.g. ``65058931_3.4_1_p2_1086``).
- [P] the FHBench paper, Appendix A, and [C] its code (github.com/wph6/FHBench at ``0df1989``,
  ``Audio_Lora/datautil/prepare_data.py`` and ``wav2vec_lora_fed.py``), as summarised in
  ``/work/shared/docs/methods-pfedkdwcl-epfl.md`` part B (B.3, B.4: ICBHI and SPRSound bullets)
  and ``/work/shared/docs/fhbench-multimodal-notes.md``. FHBench takes the audio pipeline from
  Moummad & Farrugia 2023.

Rules implemented (each with its source)
----------------------------------------
1. Samples [P, C]: one sample per annotated respiratory cycle (ICBHI) or event (SPRSound). Order
   (ours; [C] uses the row order of its own cycle tables): recordings sorted by file name, cycles
   within a recording by (onset, offset), then file order. The 30 % subset [P, C] is **not**
   drawn here: the partition stage draws it.
2. Crop [C]: ICBHI samples ``[int(onset * sr), int(offset * sr))`` of the recording (onset and
   offset in s). SPRSound ``[start_ms * sr // 1000, end_ms * sr // 1000)``; [C] computes
   ``start_ms * int(sr / 1000)``, the same for integer-kHz rates (SPRSound's), not for 44.1 kHz.
   An offset past the end of the file is clipped to it (as [C]'s ``torchaudio.load`` does); an
   empty crop is an error.
3. Mono [C]: a multi-channel file is averaged over its channels (``soundfile`` reads float32,
   PCM scaled to [-1, 1) as torchaudio does).
4. Resampling [P, C]: the cropped cycle to 16 kHz with ``soxr`` (``soxr.resample``, quality
   "HQ"); output length ``floor(n * 16000 / sr + 1/2)`` (measured for soxr 1.1.0).
   **Deviation**: [C] uses torchaudio's ``Resample`` (windowed sinc, length
   ``ceil(n * 16000 / sr)``); torchaudio does not load under torch 2.13 (notes), so the filter
   differs and the length can be one sample shorter.
5. Fade [P, C]: a linear fade-in over the first and a fade-out over the last
   ``16000 / 16 = 1000`` samples (1/16 s), as torchaudio's ``Fade(fade_shape="linear")``:
   ramps ``linspace(0, 1, 1000)`` and ``linspace(1, 0, 1000)`` (first and last sample 0).
   A cycle shorter than 1000 samples at 16 kHz is an error (torchaudio's ``Fade`` fails too).
6. Length [P, C]: 8 s = 128,000 samples. A longer cycle keeps its first 128,000 samples (no
   second fade). A cycle of at most 128,000 samples is repeated circularly
   (``ceil(128000 / n)`` copies), cut to 128,000 and faded out again over its last 1000 samples
   (as [C], also for a cycle of exactly 128,000).
7. Normalisation [P, C]: ``(x - mean) / sqrt(var + 1e-7)`` **per sample** over its 128,000
   values (population variance): the wav2vec2 feature extractor's ``do_normalize`` that [C]
   applies to each [1, 128000] sample before the model. On by default (``normalize=True``).
8. Labels: ICBHI [P, C] normal 0, crackles only 1, wheezes only 2, both 3 (:data:`ICBHI_CLASSES`).
   SPRSound [P, C] Normal 0, Fine Crackle 1, Wheeze 2, Coarse Crackle 3, Wheeze+Crackle 4,
   Rhonchi 5, Stridor 6 (:data:`SPRSOUND_CLASSES`); any other event type is an error.
9. Subjects [D]: ``subject_id`` = the integer before the first ``_`` of the stem (ICBHI patient
   number; SPRSound patient number). Split [D]: ICBHI from the official list; SPRSound from the
   folder: ``train2022_*`` -> "train", ``test2022_*`` -> "test" (``test_set`` keeps
   ``inter_test``/``intra_test``).

Cross-checks for the real data (not verifiable offline; [P] and [C]'s cycle tables):
ICBHI 6,898 cycles from 920 recordings of 126 patients, 4,142 train / 2,756 test; classes
3,642 / 1,864 / 886 / 506. SPRSound 9,089 events from 2,496 recordings with events (of 2,683;
"Poor Quality" records have none), 288 patients with events ([C]'s table; [P] reports 292
children), 6,656 train / 1,429 inter-test / 1,004 intra-test; classes 6,887 / 1,167 / 865 / 66
/ 34 / 53 / 17.

Errors: :class:`medpfl.errors.DataError` naming the file (and the line or event), for a missing
root (with the official address and terms), a missing or unreadable wav or annotation, a
recording absent from the split list, a bad annotation value, an unknown event type, an empty
or too-short cycle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medpfl.errors import DataError

# --- the FHBench audio pipeline [P, C] -------------------------------------------------------
SAMPLE_RATE = 16000  # Hz, wav2vec2's input rate
DURATION_S = 8  # s
N_SAMPLES = SAMPLE_RATE * DURATION_S  # 128,000 samples per sample
FADE_RATIO = 16  # fade length = 1/16 s
FADE_SAMPLES = SAMPLE_RATE // FADE_RATIO  # 1000 samples
NORM_EPS = 1e-7  # wav2vec2 feature extractor's zero_mean_unit_var_norm epsilon
SPLITS = ("train", "test")

# --- ICBHI 2017 [D-ICBHI] ----------------------------------------------------------------------
ICBHI_OFFICIAL_URL = "https://bhichallenge.med.auth.gr/ICBHI_2017_Challenge"
ICBHI_ACCESS_TERMS = ("free for research use (Rocha et al. 2019, cite the database paper); "
                      "whether the site asks for registration was not verified")
ICBHI_FOLDER = "ICBHI_final_database"  # the official zip's folder (accepted under root)
ICBHI_SPLIT_FILE = "ICBHI_challenge_train_test.txt"
ICBHI_CLASSES = ("normal", "crackle", "wheeze", "both")  # label = index [P, C]

# --- SPRSound [D-SPRS] -------------------------------------------------------------------------
SPRSOUND_OFFICIAL_URL = "https://github.com/SJTU-YONGFU-RESEARCH-GRP/SPRSound"
SPRSOUND_ACCESS_TERMS = ("public GitHub repository, no licence file found (terms unverified); "
                         "cite Zhang et al. 2022, IEEE TBioCAS 16(5)")
SPRSOUND_FOLDER = "BioCAS2022"
SPRSOUND_CLASSES = ("Normal", "Fine Crackle", "Wheeze", "Coarse Crackle", "Wheeze+Crackle",
                    "Rhonchi", "Stridor")  # label = index [P, C]
SPRSOUND_LABELS = {name: i for i, name in enumerate(SPRSOUND_CLASSES)}
# (split, test_set, wav folder, json folder), relative to BioCAS2022/ [D-SPRS]
SPRSOUND_PARTS = (
    ("train", "train", "train2022_wav", "train2022_json"),
    ("test", "inter_test", "test2022_wav", "test2022_json/inter_test_json"),
    ("test", "intra_test", "test2022_wav", "test2022_json/intra_test_json"),
)


@dataclass
class AudioSamples:
    """Preprocessed audio samples (the shared multimodal interface).

    ``x``: ``[N, 128000]`` (float32 by default; the ``dtype`` asked for), 8 s at 16 kHz, one row
    per cycle / event (module rules 2-7). ``table``: one row per sample in the order of ``x``
    (see :func:`icbhi_index` / :func:`sprsound_index` for the columns; ``sample_id`` is the row
    in ``x``). ``class_names``: label names by class index.
    """

    x: np.ndarray
    table: pd.DataFrame
    class_names: tuple[str, ...]


# --- signal steps -------------------------------------------------------------------------------

def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A wav file as mono float32 ``[T]`` (channel mean, module rule 3) and its rate in Hz.

    Read with ``soundfile`` (PCM scaled to [-1, 1)). Raises DataError naming the file when it
    is missing, not readable as audio, or has no samples.
    """
    import soundfile as sf  # noqa: PLC0415 - optional heavy import, only for reading audio

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: audio file not found")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - any decode failure is reported with the file name
        raise DataError(f"{path}: cannot be read as audio by soundfile ({e})") from e
    if data.shape[0] == 0:
        raise DataError(f"{path}: audio file has no samples")
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32), int(sr)


def resampled_length(n: int, sr_in: int, sr_out: int = SAMPLE_RATE) -> int:
    """Length of :func:`resample`'s output: ``floor(n * sr_out / sr_in + 1/2)`` (soxr 1.1.0).

    torchaudio (FHBench) gives ``ceil(n * sr_out / sr_in)``: equal or one more.
    """
    return (2 * n * sr_out + sr_in) // (2 * sr_in)


def resample(x: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Mono ``[n]`` at ``sr_in`` Hz -> float32 ``[resampled_length(n, sr_in, sr_out)]`` (soxr HQ).

    The identity (a float32 copy) when the rates are equal (module rule 4).
    """
    x = np.asarray(x, dtype=np.float32)
    if sr_in == sr_out:
        return x.copy()
    import soxr  # noqa: PLC0415

    return np.asarray(soxr.resample(x, sr_in, sr_out), dtype=np.float32)


def fade_ramp(n: int = FADE_SAMPLES) -> np.ndarray:
    """The linear fade-in ramp, float64 ``[n]``: ``linspace(0, 1, n)`` (torchaudio's "linear")."""
    return np.linspace(0.0, 1.0, n)


def fade(x: np.ndarray, fade_in: int = FADE_SAMPLES, fade_out: int = FADE_SAMPLES) -> np.ndarray:
    """Linear fade-in over the first ``fade_in`` and fade-out over the last ``fade_out`` samples.

    ``x``: ``[n]``, ``n >= max(fade_in, fade_out)`` (else ValueError, as torchaudio's ``Fade``
    fails); returns float64 ``[n]``. Overlapping ramps multiply (module rule 5).
    """
    y = np.asarray(x, dtype=np.float64).copy()
    n = y.shape[-1]
    if n < max(fade_in, fade_out):
        raise ValueError(f"{n} samples is shorter than the fade ({max(fade_in, fade_out)} samples)")
    if fade_in:
        y[:fade_in] *= fade_ramp(fade_in)
    if fade_out:
        y[n - fade_out:] *= fade_ramp(fade_out)[::-1]
    return y


def fix_length(x: np.ndarray, n: int = N_SAMPLES, fade_samples: int = FADE_SAMPLES) -> np.ndarray:
    """Cut at ``n`` samples, or repeat circularly to ``n`` and fade out again (module rule 6).

    ``x``: the faded cycle ``[m]`` at 16 kHz; returns float64 ``[n]``.
    """
    x = np.asarray(x, dtype=np.float64)
    m = x.shape[-1]
    if m > n:
        return x[:n].copy()
    y = np.tile(x, math.ceil(n / m))[:n]
    return fade(y, fade_in=0, fade_out=fade_samples)


def normalize(x: np.ndarray, eps: float = NORM_EPS) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over one sample's values (module rule 7); float64."""
    x = np.asarray(x, dtype=np.float64)
    return (x - x.mean()) / np.sqrt(x.var() + eps)


def cycle_waveform(segment: np.ndarray, sr: int, normalize_input: bool = True) -> np.ndarray:
    """One cropped mono cycle at ``sr`` Hz -> float64 ``[128000]`` at 16 kHz (module rules 4-7).

    Raises ValueError when the cycle is shorter than the fade (1000 samples at 16 kHz).
    """
    y = resample(segment, sr)
    if y.shape[0] < FADE_SAMPLES:
        raise ValueError(f"{y.shape[0]} samples at {SAMPLE_RATE} Hz, shorter than the "
                         f"{FADE_SAMPLES}-sample fade")
    y = fix_length(fade(y))
    return normalize(y) if normalize_input else y


def _check_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)):
        raise ValueError(f"dtype {dt} not supported (float32, float16 or float64)")
    return dt


def _missing_root(root: Path, name: str, url: str, terms: str) -> DataError:
    return DataError(f"{root}: {name} not found; download it from {url} ({terms})")


def _subject(stem: str, where: Path) -> int:
    head = stem.split("_", 1)[0]
    if not head.isdigit():
        raise DataError(f"{where}: file name {stem!r} does not start with a numeric patient id")
    return int(head)


# --- ICBHI 2017 ---------------------------------------------------------------------------------

def icbhi_folder(root: str | Path) -> Path:
    """The folder holding the ICBHI wavs: ``root`` itself, or ``root/ICBHI_final_database``.

    Raises DataError naming :data:`ICBHI_OFFICIAL_URL` and the terms when ``root`` is missing
    or holds no ``.wav``.
    """
    root = Path(root)
    if not root.is_dir():
        raise _missing_root(root, "ICBHI 2017 folder", ICBHI_OFFICIAL_URL, ICBHI_ACCESS_TERMS)
    for folder in (root, root / ICBHI_FOLDER):
        if folder.is_dir() and any(folder.glob("*.wav")):
            return folder
    raise _missing_root(root, "ICBHI 2017 recordings (*.wav)", ICBHI_OFFICIAL_URL, ICBHI_ACCESS_TERMS)


def read_icbhi_split(path: str | Path) -> dict[str, str]:
    """``ICBHI_challenge_train_test.txt`` -> ``{stem: "train" | "test"}``.

    Lines ``<stem> <train|test>`` (whitespace-separated, no header) [D-ICBHI]. Raises DataError
    naming the file when it is missing or unreadable, has a line without two fields, a split
    other than train/test, or a stem listed twice.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: ICBHI train/test list not found (download {ICBHI_SPLIT_FILE} "
                        f"from {ICBHI_OFFICIAL_URL}; or pass split_file=)")
    try:
        df = pd.read_csv(path, sep=r"\s+", header=None, dtype=str, engine="python")
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot be read as a two-column list ({e})") from e
    if df.shape[1] != 2 or df.isna().any().any():
        raise DataError(f"{path}: expected two fields per line (<stem> <train|test>)")
    df.columns = ["stem", "split"]
    df["stem"] = df["stem"].str.removesuffix(".wav")
    bad = sorted(set(df["split"]) - set(SPLITS))
    if bad:
        raise DataError(f"{path}: split value(s) {bad} not in {list(SPLITS)}")
    dup = df["stem"][df["stem"].duplicated()].tolist()
    if dup:
        raise DataError(f"{path}: recording(s) listed twice: {dup[:5]}")
    return dict(zip(df["stem"], df["split"]))


def read_icbhi_annotation(path: str | Path) -> pd.DataFrame:
    """One ICBHI ``.txt`` -> DataFrame ``onset``, ``offset`` (float64, s), ``crackles``,
    ``wheezes`` (int64, 0/1), in file order.

    Raises DataError naming the file (and line) when it is missing, empty, not four numeric
    columns, a flag is not 0/1, or a cycle has ``onset < 0`` or ``offset <= onset``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: ICBHI annotation file not found (each .wav needs a same-stem .txt)")
    try:
        df = pd.read_csv(path, sep=r"\s+", header=None, engine="python")
    except pd.errors.EmptyDataError as e:
        raise DataError(f"{path}: ICBHI annotation file is empty") from e
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot be read as an ICBHI annotation ({e})") from e
    if df.shape[1] != 4:
        raise DataError(f"{path}: {df.shape[1]} columns, expected 4 (onset, offset, crackles, wheezes)")
    df.columns = ["onset", "offset", "crackles", "wheezes"]
    num = df.apply(pd.to_numeric, errors="coerce")
    bad = num.isna().any(axis=1) | ~np.isfinite(num.to_numpy(dtype=float)).all(axis=1)
    if bad.any():
        line = int(np.flatnonzero(bad.to_numpy())[0]) + 1
        raise DataError(f"{path}: line {line}: non-numeric value")
    for col in ("crackles", "wheezes"):
        off = ~num[col].isin([0, 1])
        if off.any():
            line = int(np.flatnonzero(off.to_numpy())[0]) + 1
            raise DataError(f"{path}: line {line}: {col} must be 0 or 1, got {num[col][off].iloc[0]}")
    wrong = (num["onset"] < 0) | (num["offset"] <= num["onset"])
    if wrong.any():
        line = int(np.flatnonzero(wrong.to_numpy())[0]) + 1
        raise DataError(f"{path}: line {line}: onset {num['onset'][wrong].iloc[0]} / offset "
                        f"{num['offset'][wrong].iloc[0]} is not a cycle (need 0 <= onset < offset)")
    return pd.DataFrame({"onset": num["onset"].astype("float64"), "offset": num["offset"].astype("float64"),
                         "crackles": num["crackles"].astype("int64"), "wheezes": num["wheezes"].astype("int64")})


def icbhi_label(crackles: int, wheezes: int) -> int:
    """normal 0, crackles only 1, wheezes only 2, both 3 (module rule 8)."""
    return int(bool(crackles)) + 2 * int(bool(wheezes))


def icbhi_index(root: str | Path, split_file: str | Path | None = None) -> pd.DataFrame:
    """All ICBHI cycles (annotations only; no audio is decoded), one row per cycle.

    Columns: ``subject_id`` (int64, patient number), ``recording`` (file stem), ``cycle``
    (int64, index within the recording in onset order), ``onset_s``, ``offset_s`` (float64, as
    in the file), ``crackles``, ``wheezes`` (int64), ``split`` ("train"/"test", official list),
    ``label`` (int64, :data:`ICBHI_CLASSES`), ``file`` (the wav's path relative to ``root``).
    Rows: recordings sorted by name, cycles by (onset, offset) (module rule 1).

    ``split_file``: default ``ICBHI_challenge_train_test.txt`` in the wav folder, else in
    ``root``. Raises DataError (see :func:`icbhi_folder`, :func:`read_icbhi_split`,
    :func:`read_icbhi_annotation`), and when a recording is missing from the split list or a
    listed recording has no wav.
    """
    root = Path(root)
    folder = icbhi_folder(root)
    if split_file is None:
        cands = [folder / ICBHI_SPLIT_FILE, root / ICBHI_SPLIT_FILE]
        split_file = next((c for c in cands if c.is_file()), cands[0])
    splits = read_icbhi_split(split_file)
    wavs = sorted(folder.glob("*.wav"), key=lambda p: p.name)
    stems = {w.stem for w in wavs}
    absent = sorted(s for s in splits if s not in stems)
    if absent:
        raise DataError(f"{folder / (absent[0] + '.wav')}: recording listed in {split_file} not found "
                        f"({len(absent)} missing)")
    frames = []
    for wav in wavs:
        stem = wav.stem
        if stem not in splits:
            raise DataError(f"{split_file}: recording {stem} ({wav.name}) is not in the train/test list")
        ann = read_icbhi_annotation(wav.with_suffix(".txt"))
        ann = ann.sort_values(["onset", "offset"], kind="stable").reset_index(drop=True)
        frames.append(pd.DataFrame({
            "subject_id": np.int64(_subject(stem, wav)), "recording": stem,
            "cycle": np.arange(len(ann), dtype="int64"),
            "onset_s": ann["onset"], "offset_s": ann["offset"],
            "crackles": ann["crackles"], "wheezes": ann["wheezes"], "split": splits[stem],
            "label": [icbhi_label(c, w) for c, w in zip(ann["crackles"], ann["wheezes"])],
            "file": str(wav.relative_to(root)),
        }))
    table = pd.concat(frames, ignore_index=True)
    return table.astype({"subject_id": "int64", "cycle": "int64", "label": "int64"})


def icbhi_crop(row, sr: int) -> tuple[int, int]:
    """Sample range ``[int(onset * sr), int(offset * sr))`` of an ICBHI cycle (module rule 2)."""
    return int(row.onset_s * sr), int(row.offset_s * sr)


# --- SPRSound ----------------------------------------------------------------------------------

def sprsound_folder(root: str | Path) -> Path:
    """The ``BioCAS2022`` folder: ``root/BioCAS2022``, or ``root`` itself if it is that folder.

    Raises DataError naming :data:`SPRSOUND_OFFICIAL_URL` and the terms when it is missing.
    """
    root = Path(root)
    for folder in (root / SPRSOUND_FOLDER, root):
        if (folder / SPRSOUND_PARTS[0][2]).is_dir():
            return folder
    raise _missing_root(root, f"SPRSound ({SPRSOUND_FOLDER}/{SPRSOUND_PARTS[0][2]}/)",
                        SPRSOUND_OFFICIAL_URL, SPRSOUND_ACCESS_TERMS)


def _ms(value, path: Path, i: int, key: str) -> int:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not math.isfinite(v) or v < 0 or v != int(v):
        raise DataError(f"{path}: event {i}: {key} {value!r} is not a whole number of ms")
    return int(v)


def read_sprsound_annotation(path: str | Path) -> tuple[str | None, pd.DataFrame]:
    """One SPRSound JSON -> (``record_annotation``, DataFrame ``start_ms``, ``end_ms`` (int64),
    ``type`` (str), ``label`` (int64, :data:`SPRSOUND_CLASSES`)), events in file order.

    Raises DataError naming the file (and event index) when it is missing or not JSON, lacks
    ``event_annotation``, or an event has a missing key, a start/end that is not a whole
    non-negative number of ms, ``end <= start``, or a type outside :data:`SPRSOUND_CLASSES`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: SPRSound annotation file not found (each .wav needs a same-stem .json)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("event_annotation"), list):
        raise DataError(f"{path}: no event_annotation list")
    rows = []
    for i, ev in enumerate(doc["event_annotation"]):
        if not isinstance(ev, dict) or not {"start", "end", "type"} <= set(ev):
            raise DataError(f"{path}: event {i}: needs start, end and type")
        start, end = _ms(ev["start"], path, i, "start"), _ms(ev["end"], path, i, "end")
        if end <= start:
            raise DataError(f"{path}: event {i}: end {end} ms is not after start {start} ms")
        if ev["type"] not in SPRSOUND_LABELS:
            raise DataError(f"{path}: event {i}: unknown event type {ev['type']!r} "
                            f"(expected one of {list(SPRSOUND_CLASSES)})")
        rows.append((start, end, ev["type"], SPRSOUND_LABELS[ev["type"]]))
    record = doc.get("record_annotation", doc.get("recording_annotation"))
    df = pd.DataFrame(rows, columns=["start_ms", "end_ms", "type", "label"])
    return record, df.astype({"start_ms": "int64", "end_ms": "int64", "label": "int64"})


def sprsound_index(root: str | Path) -> pd.DataFrame:
    """All SPRSound BioCAS2022 events (annotations only; no audio is decoded), one row per event.

    Columns: ``subject_id`` (int64, patient number), ``recording`` (file stem), ``cycle``
    (int64, event index within the recording in onset order), ``start_ms``, ``end_ms`` (int64,
    as in the file), ``onset_s``, ``offset_s`` (float64, ms / 1000), ``type`` (str),
    ``record_annotation`` (str), ``split`` ("train"/"test"), ``test_set`` ("train",
    "inter_test", "intra_test"), ``label`` (int64, :data:`SPRSOUND_CLASSES`), ``file`` (the
    wav's path relative to ``root``). Rows: recordings sorted by file name (over both splits),
    events by (start, end) (module rule 1). A recording without events ("Poor Quality")
    contributes no row.

    Raises DataError naming the file when a wav has no JSON in its split's folder(s), a JSON
    has no wav, a recording has two JSONs or two wavs, a name does not have the five
    ``_``-separated fields, or an annotation is bad (:func:`read_sprsound_annotation`).
    """
    root = Path(root)
    folder = sprsound_folder(root)
    recs: dict[str, tuple[Path, Path | None, str, str]] = {}
    for split, test_set, wav_dir, json_dir in SPRSOUND_PARTS:
        wd, jd = folder / wav_dir, folder / json_dir
        for d in (wd, jd):
            if not d.is_dir():
                raise DataError(f"{d}: SPRSound folder not found (layout {SPRSOUND_FOLDER}/"
                                f"{{train2022,test2022}}_wav, *_json of {SPRSOUND_OFFICIAL_URL})")
        for js in sorted(jd.glob("*.json")):
            wav = wd / (js.stem + ".wav")
            if not wav.is_file():
                raise DataError(f"{wav}: audio file not found (annotated by {js})")
            if js.stem in recs:
                raise DataError(f"{js}: recording {js.stem} also annotated by {recs[js.stem][1]}")
            recs[js.stem] = (wav, js, split, test_set)
    for wav_dir in sorted({p[2] for p in SPRSOUND_PARTS}):
        for wav in sorted((folder / wav_dir).glob("*.wav")):
            known = recs.get(wav.stem)
            if known is None:
                dirs = " or ".join(p[3] for p in SPRSOUND_PARTS if p[2] == wav_dir)
                raise DataError(f"{wav}: no annotation {wav.stem}.json in {dirs}")
            if known[0] != wav:
                raise DataError(f"{wav}: recording {wav.stem} also in {known[0]}")
    frames = []
    for stem in sorted(recs):
        wav, js, split, test_set = recs[stem]
        if len(stem.split("_")) != 5:
            raise DataError(f"{wav}: file name {stem!r} is not <patient>_<age>_<gender>_<location>_<recording>")
        record, ev = read_sprsound_annotation(js)
        ev = ev.sort_values(["start_ms", "end_ms"], kind="stable").reset_index(drop=True)
        frames.append(pd.DataFrame({
            "subject_id": np.int64(_subject(stem, wav)), "recording": stem,
            "cycle": np.arange(len(ev), dtype="int64"),
            "start_ms": ev["start_ms"], "end_ms": ev["end_ms"],
            "onset_s": ev["start_ms"] / 1000.0, "offset_s": ev["end_ms"] / 1000.0,
            "type": ev["type"], "record_annotation": record, "split": split, "test_set": test_set,
            "label": ev["label"], "file": str(wav.relative_to(root)),
        }))
    cols = ["subject_id", "recording", "cycle", "start_ms", "end_ms", "onset_s", "offset_s", "type",
            "record_annotation", "split", "test_set", "label", "file"]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    return table.astype({"subject_id": "int64", "cycle": "int64", "start_ms": "int64",
                         "end_ms": "int64", "label": "int64"})


def sprsound_crop(row, sr: int) -> tuple[int, int]:
    """Sample range ``[start_ms * sr // 1000, end_ms * sr // 1000)`` of an event (rule 2)."""
    return int(row.start_ms) * sr // 1000, int(row.end_ms) * sr // 1000


# --- waveforms, streaming and loading -------------------------------------------------------------

def iter_waveforms(root: str | Path, index: pd.DataFrame, crop: Callable[[object, int], tuple[int, int]],
                   normalize_input: bool = True) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(position, waveform)`` for every row of ``index``, decoding each wav once.

    ``index``: any subset of :func:`icbhi_index` / :func:`sprsound_index`'s rows (in any
    order), ``crop``: :func:`icbhi_crop` or :func:`sprsound_crop`. ``position`` is the row's
    position in ``index`` (0..len-1); ``waveform`` float64 ``[128000]`` (module rules 2-7).
    Recordings are visited in first-appearance order, so memory holds one recording at a time.

    Raises DataError naming the wav (and cycle) for an unreadable file, a cycle starting at or
    past the file's end, or a cycle shorter than the fade after resampling.
    """
    root = Path(root)
    groups: dict[str, list[int]] = {}
    for pos, f in enumerate(index["file"].tolist()):
        groups.setdefault(f, []).append(pos)
    rows = list(index.itertuples(index=False))
    for f, positions in groups.items():
        path = root / f
        audio, sr = read_wav(path)
        for pos in positions:
            row = rows[pos]
            start, stop = crop(row, sr)
            stop = min(stop, audio.shape[0])  # an offset past the end is clipped (rule 2)
            if stop <= start:
                raise DataError(f"{path}: cycle {row.cycle} ({row.onset_s}-{row.offset_s} s) is empty "
                                f"in a file of {audio.shape[0] / sr:.3f} s at {sr} Hz")
            try:
                yield pos, cycle_waveform(audio[start:stop], sr, normalize_input)
            except ValueError as e:
                raise DataError(f"{path}: cycle {row.cycle} ({row.onset_s}-{row.offset_s} s): {e}") from e


def waveforms(root: str | Path, index: pd.DataFrame, crop: Callable[[object, int], tuple[int, int]],
              normalize_input: bool = True, dtype=np.float32) -> np.ndarray:
    """``[len(index), 128000]`` of ``dtype`` (float32 default; float16 halves the 0.5 MB per
    sample) for exactly the rows of ``index``, in its order (see :func:`iter_waveforms`).

    Lets a caller decode only the rows a partition drew (e.g. FHBench's 30 %).
    """
    dt = _check_dtype(dtype)
    x = np.empty((len(index), N_SAMPLES), dtype=dt)
    for pos, w in iter_waveforms(root, index, crop, normalize_input):
        x[pos] = w
    return x


def _load(index: pd.DataFrame, root, crop, classes, normalize_input, dtype, limit) -> AudioSamples:
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        index = index.iloc[:limit]
    table = index.reset_index(drop=True)
    table.insert(0, "sample_id", np.arange(len(table), dtype="int64"))
    x = waveforms(root, table, crop, normalize_input, dtype)
    return AudioSamples(x=x, table=table, class_names=classes)


def load_icbhi(root: str | Path, split_file: str | Path | None = None, normalize: bool = True,
               dtype=np.float32, limit: int | None = None) -> AudioSamples:
    """Read ICBHI 2017 at ``root`` and apply FHBench's preprocessing (module docstring).

    ``x``: ``[N, 128000]`` ``dtype`` (float32 default), N = all cycles (6,898 on the real data,
    about 3.5 GB in float32); ``table``: ``sample_id`` then :func:`icbhi_index`'s columns;
    ``class_names``: :data:`ICBHI_CLASSES`. ``limit``: only the first ``limit`` cycles in row
    order, for smoke runs. ``normalize=False`` skips rule 7. Errors: DataError naming the file.
    """
    index = icbhi_index(root, split_file)
    return _load(index, root, icbhi_crop, ICBHI_CLASSES, normalize, dtype, limit)


def load_sprsound(root: str | Path, normalize: bool = True, dtype=np.float32,
                  limit: int | None = None) -> AudioSamples:
    """Read SPRSound (``BioCAS2022``) at ``root`` and apply FHBench's preprocessing.

    ``root``: the repository checkout holding ``BioCAS2022/`` (or that folder itself). ``x``:
    ``[N, 128000]`` ``dtype``, N = all events (9,089 on the real data, about 4.7 GB in float32);
    ``table``: ``sample_id`` then :func:`sprsound_index`'s columns; ``class_names``:
    :data:`SPRSOUND_CLASSES`. ``limit``, ``normalize``: as :func:`load_icbhi`.
    """
    index = sprsound_index(root)
    return _load(index, root, sprsound_crop, SPRSOUND_CLASSES, normalize, dtype, limit)
