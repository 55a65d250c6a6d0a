"""ADFTD reader: tiny synthetic recordings in the official ds004504 1.0.8 layout (EEGLAB .set via mne)."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

mne = pytest.importorskip("mne")
pytest.importorskip("eeglabio")  # mne.export.export_raw(fmt="eeglab") needs it (eeglabio==0.1.4)

from scipy.interpolate import interp1d  # noqa: E402

from medpfl.data import adftd  # noqa: E402
from medpfl.data.signals import linear_resample, middle_window_starts  # noqa: E402
from medpfl.errors import DataError  # noqa: E402

CH = list(adftd.CHANNELS)
UV = 1e-6  # EEGLAB stores microvolts; MNE returns volts


def ramp_uv(sid: int, n: int) -> np.ndarray:
    """Channel c of subject sid: sample i -> i + 1000 c + 20000 sid (uV); exact in float32, and
    linear, so linear resampling reproduces the output grid's positions exactly."""
    return np.arange(n, dtype=np.float64)[None, :] + 1000.0 * np.arange(19)[:, None] + 20000.0 * sid


def write_set(path, data_uv: np.ndarray, ch_names=None, sfreq: float = 500.0) -> None:
    """An EEGLAB .set (data inside) written by mne's exporter, as in ds004504's derivatives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = mne.create_info(list(ch_names or CH), sfreq, "eeg")
    raw = mne.io.RawArray(data_uv * UV, info, verbose="error")
    mne.export.export_raw(str(path), raw, fmt="eeglab", overwrite=True, verbose="error")


def write_participants(root, rows) -> None:
    """participants.tsv as in ds004504 1.0.8: tab-separated, CRLF, no newline after the last row."""
    lines = ["participant_id\tGender\tAge\tGroup\tMMSE"]
    lines += [f"sub-{sid:03d}\tF\t{60 + sid}\t{group}\t{20 + sid % 10}" for sid, group in rows]
    (root / adftd.PARTICIPANTS_TSV).write_bytes("\r\n".join(lines).encode())


def make_adftd(root, subjects: dict[int, tuple[str, np.ndarray]], folder_order=None, row_order=None,
               raw_too: bool = True) -> None:
    """A tiny ds004504 tree: participants.tsv + derivatives/sub-0NN/eeg/sub-0NN_task-eyesclosed_eeg.set
    (and, if raw_too, an unprocessed sub-0NN/eeg/*.set the reader must ignore)."""
    for sid in folder_order or list(subjects):
        pid = f"sub-{sid:03d}"
        write_set(root / adftd.recording_path(pid), subjects[sid][1])
        if raw_too:  # raw recording with a different content (a 5000 uV offset)
            write_set(root / pid / "eeg" / f"{pid}_task-eyesclosed_eeg.set", subjects[sid][1] + 5000.0)
    write_participants(root, [(sid, subjects[sid][0]) for sid in (row_order or list(subjects))])


# lengths at 500 Hz and what they give (derived by hand from the rules, see each test):
#   n = 1537: m = int(1537 / 500 * 256) = 786; middle c = 393; windows start at 137, 393 (K = 2)
#   n = 2600: m = 1331; c = 665; starts 153, 409, 665, 921 (K = 4)
#   n = 1000: m = 512; c = 256; starts 0, 256 (K = 2: no leftover)
SUBJECTS = {1: ("C", 1537), 2: ("F", 2600), 3: ("A", 1000), 10: ("A", 1537)}


def ramp_set(tmp_path, **kw):
    subjects = {sid: (g, ramp_uv(sid, n)) for sid, (g, n) in SUBJECTS.items()}
    make_adftd(tmp_path, subjects, **kw)


def test_labels_by_subject_id_not_folder_or_row_order(tmp_path):
    ramp_set(tmp_path, folder_order=[10, 3, 1, 2], row_order=[2, 10, 1, 3])
    s = adftd.load_adftd(tmp_path, zscore="none")
    rec = s.recordings
    assert rec["subject_id"].tolist() == [1, 2, 3, 10]
    assert rec["participant_id"].tolist() == ["sub-001", "sub-002", "sub-003", "sub-010"]
    assert rec["label"].tolist() == [0, 1, 2, 2]  # C 0, F 1, A 2
    assert s.class_names == ("C", "F", "A")
    t = s.table
    assert t["subject_id"].tolist() == [1] * 2 + [2] * 4 + [3] * 2 + [10] * 2
    assert t["label"].tolist() == [0] * 2 + [1] * 4 + [2] * 2 + [2] * 2
    assert t["sample_id"].tolist() == list(range(10))
    for col in ("sample_id", "subject_id", "label", "window", "start"):
        assert t[col].dtype == np.int64, col
    # each row's signal is its own subject's: channel 0 value - sample position = 20000 * sid uV,
    # and the derivative (not the raw recording, offset by 5000 uV) was read
    last = s.x[:, 0, -1] / UV  # channel 0 at each window's last sample, in uV
    for i, sid in enumerate(t["subject_id"]):
        n = SUBJECTS[sid][1]
        m = int(n / 500 * 256)
        pos = np.linspace(0, n - 1, m)[t["start"][i] + 255]
        assert last[i] == pytest.approx(pos + 20000 * sid, abs=0.05)


def test_window_count_middle_anchor_resampled_length_and_padding(tmp_path):
    ramp_set(tmp_path, raw_too=False)
    s = adftd.load_adftd(tmp_path, zscore="none")
    rec = s.recordings.set_index("subject_id")
    assert rec.loc[1, ["n_samples", "n_resampled", "n_windows"]].tolist() == [1537, 786, 2]
    assert rec.loc[2, ["n_samples", "n_resampled", "n_windows"]].tolist() == [2600, 1331, 4]
    assert rec.loc[3, ["n_samples", "n_resampled", "n_windows"]].tolist() == [1000, 512, 2]
    t = s.table
    assert t.loc[t.subject_id == 1, "start"].tolist() == [137, 393]
    assert t.loc[t.subject_id == 2, "start"].tolist() == [153, 409, 665, 921]
    assert t.loc[t.subject_id == 3, "start"].tolist() == [0, 256]
    assert t.loc[t.subject_id == 2, "window"].tolist() == [0, 1, 2, 3]
    assert s.x.shape == (10, 19, 512) and s.x.dtype == np.float32
    # left padding: zeros in the first 256 columns, the signal in the last 256
    assert not s.x[:, :, :256].any()
    # content: window k of subject 2 is the resampled ramp at output samples start .. start + 255,
    # i.e. input positions linspace(0, n - 1, m)[start:start + 256] (FHBench grid)
    n, m = 2600, 1331
    grid = np.linspace(0, n - 1, m)
    rows = np.flatnonzero(t.subject_id == 2)
    for r, start in zip(rows, t.loc[rows, "start"]):
        want = (grid[start:start + 256][None, :] + 1000.0 * np.arange(19)[:, None] + 40000.0) * UV
        np.testing.assert_allclose(s.x[r, :, 256:], want, rtol=2e-6)


def test_uniform_grid_option(tmp_path):
    make_adftd(tmp_path, {1: ("C", ramp_uv(1, 2600))}, raw_too=False)
    s = adftd.load_adftd(tmp_path, zscore="none", resample_grid="uniform")
    start = s.table["start"].iloc[1]
    want = (np.arange(start, start + 256) * (500 / 256) + 20000.0) * UV  # exact 256 Hz grid, channel 0
    np.testing.assert_allclose(s.x[1, 0, 256:], want, rtol=2e-6)


def _noise(sid, n, flat_channel=None):
    x = np.random.default_rng(sid).standard_normal((19, n)) * 20.0 + np.arange(19)[:, None] * 3.0
    if flat_channel is not None:
        x[flat_channel] = 7.0
    return x


def _fhbench_resample(data):  # the source's formulation, written independently of linear_resample
    n = data.shape[1]
    f = interp1d(np.linspace(1, n, n), data, kind="linear", axis=1)
    return f(np.linspace(1, n, int(n / 500 * 256)))


def test_zscore_per_window_values_and_flat_channel(tmp_path):
    data = _noise(4, 2600, flat_channel=5)
    make_adftd(tmp_path, {4: ("F", data)}, raw_too=False)
    s = adftd.load_adftd(tmp_path)  # zscore="window" is the default (FHBench normalize_batch_ts)
    read = mne.io.read_raw_eeglab(tmp_path / adftd.recording_path("sub-004"), preload=True,
                                  verbose="error").get_data()
    y = _fhbench_resample(read)
    w = s.x[:, :, 256:].astype(np.float64)
    for k, start in enumerate(s.table["start"]):
        seg = y[:, start:start + 256]
        mu, sd = seg.mean(axis=1, keepdims=True), seg.std(axis=1, keepdims=True)
        sd[5] = 1.0  # the flat channel is only centred
        np.testing.assert_allclose(w[k], (seg - mu) / sd, atol=2e-5)
    keep = [c for c in range(19) if c != 5]
    np.testing.assert_allclose(w[:, keep].mean(axis=2), 0.0, atol=1e-5)
    np.testing.assert_allclose(w[:, keep].std(axis=2), 1.0, atol=1e-5)
    assert np.abs(w[:, 5]).max() < 1e-6  # flat channel: zeros, not noise blown up to unit variance


def test_zscore_per_recording_option(tmp_path):
    data = _noise(6, 2600)
    make_adftd(tmp_path, {6: ("A", data)}, raw_too=False)
    s = adftd.load_adftd(tmp_path, zscore="recording")
    read = mne.io.read_raw_eeglab(tmp_path / adftd.recording_path("sub-006"), preload=True,
                                  verbose="error").get_data()
    y = _fhbench_resample(read)
    z = (y - y.mean(axis=1, keepdims=True)) / y.std(axis=1, keepdims=True)  # over the whole recording
    for k, start in enumerate(s.table["start"]):
        np.testing.assert_allclose(s.x[k, :, 256:], z[:, start:start + 256], atol=2e-5)
    # windows are not re-normalised: their means are not all ~0
    assert np.abs(s.x[:, :, 256:].mean(axis=2)).max() > 0.01


def test_limit_first_subjects_by_id(tmp_path):
    ramp_set(tmp_path, folder_order=[10, 3, 1, 2], row_order=[3, 10, 2, 1], raw_too=False)
    s = adftd.load_adftd(tmp_path, limit=2)
    assert s.recordings["subject_id"].tolist() == [1, 2]
    assert len(s.table) == len(s.x) == 6


# ----------------------------------------------------------------------------- errors


def test_missing_root_names_url_and_terms(tmp_path):
    with pytest.raises(DataError) as e:
        adftd.load_adftd(tmp_path / "nope")
    msg = str(e.value)
    assert adftd.OFFICIAL_URL in msg and adftd.ACCESS_TERMS in msg and "\n" not in msg


def test_damaged_set_names_the_file(tmp_path):
    ramp_set(tmp_path, raw_too=False)
    bad = tmp_path / adftd.recording_path("sub-002")
    bad.write_bytes(bad.read_bytes()[:300])  # truncated
    with pytest.raises(DataError, match=r"sub-002_task-eyesclosed_eeg\.set: cannot be read"):
        adftd.load_adftd(tmp_path)
    bad.write_bytes(b"not a MATLAB file at all" * 10)
    with pytest.raises(DataError, match=r"sub-002_task-eyesclosed_eeg\.set: cannot be read"):
        adftd.load_adftd(tmp_path)


def test_derivative_without_participants_row(tmp_path):
    ramp_set(tmp_path, row_order=[1, 2, 10], raw_too=False)  # sub-003 has a folder but no row
    with pytest.raises(DataError, match=r"participants\.tsv: no row for sub-003"):
        adftd.load_adftd(tmp_path)


def test_participants_row_without_recording(tmp_path):
    ramp_set(tmp_path, raw_too=False)
    (tmp_path / adftd.recording_path("sub-010")).unlink()
    with pytest.raises(DataError, match=r"sub-010_task-eyesclosed_eeg\.set: recording not found"):
        adftd.load_adftd(tmp_path)


def test_channel_mismatch_names_the_file(tmp_path):
    ramp_set(tmp_path, raw_too=False)
    renamed = CH[:12] + ["T7"] + CH[13:]  # T3 under its 10-10 name
    write_set(tmp_path / adftd.recording_path("sub-003"), ramp_uv(3, 1000), ch_names=renamed)
    pattern = r"sub-003_task-eyesclosed_eeg\.set: channels .*extra \['T7'\], missing \['T3'\]"
    with pytest.raises(DataError, match=pattern):
        adftd.load_adftd(tmp_path)
    swapped = [CH[1], CH[0]] + CH[2:]
    write_set(tmp_path / adftd.recording_path("sub-003"), ramp_uv(3, 1000), ch_names=swapped)
    with pytest.raises(DataError, match=r"sub-003_task-eyesclosed_eeg\.set: .*different order"):
        adftd.load_adftd(tmp_path)
    write_set(tmp_path / adftd.recording_path("sub-003"), ramp_uv(3, 1000)[:18], ch_names=CH[:18])
    with pytest.raises(DataError, match=r"sub-003_task-eyesclosed_eeg\.set: channels .*missing \['Pz'\]"):
        adftd.load_adftd(tmp_path)


def test_sampling_rate_and_too_short(tmp_path):
    make_adftd(tmp_path, {1: ("C", ramp_uv(1, 1000))}, raw_too=False)
    write_set(tmp_path / adftd.recording_path("sub-001"), ramp_uv(1, 1000), sfreq=250.0)
    with pytest.raises(DataError, match=r"sub-001_task-eyesclosed_eeg\.set: sampling rate 250\.0 Hz"):
        adftd.load_adftd(tmp_path)
    # 499 samples -> int(499 * 0.512) = 255 at 256 Hz: no whole 1-s window
    write_set(tmp_path / adftd.recording_path("sub-001"), ramp_uv(1, 499))
    with pytest.raises(DataError, match=r"sub-001_task-eyesclosed_eeg\.set: 499 samples .*no whole 256-sample"):
        adftd.load_adftd(tmp_path)


@pytest.mark.parametrize(("text", "pattern"), [
    ("participant_id\tGender\tAge\tMMSE\r\nsub-001\tF\t57\t16", r"participants\.tsv: missing column\(s\) Group"),
    ("participant_id\tGroup\r\nsub-001\tA\r\nsub-002\tX", r"participants\.tsv: row 2 \(sub-002\): Group 'X'"),
    ("participant_id\tGroup\r\nsub-001\tA\r\nsubject2\tC", r"participants\.tsv: row 2: participant_id 'subject2'"),
    ("participant_id\tGroup\r\nsub-001\tA\r\nsub-01\tC", r"participants\.tsv: duplicated participant_id"),
])
def test_bad_participants_rows(tmp_path, text, pattern):
    (tmp_path / adftd.DERIVATIVES_DIR).mkdir()
    (tmp_path / adftd.PARTICIPANTS_TSV).write_text(text)
    with pytest.raises(DataError, match=pattern):
        adftd.read_participants(tmp_path)
    (tmp_path / adftd.PARTICIPANTS_TSV).unlink()
    with pytest.raises(DataError, match=r"participants\.tsv: file not found"):
        adftd.read_participants(tmp_path)


# ----------------------------------------------------------------------------- signal helpers


def test_linear_resample_is_fhbench_interp1d():
    x = np.random.default_rng(0).standard_normal((3, 1537))
    np.testing.assert_allclose(linear_resample(x, 500, 256), _fhbench_resample(x), rtol=0, atol=1e-12)
    # output length is FHBench's float expression int(n / 500 * 256), for a run of n
    for n in range(2, 3000, 7):
        assert linear_resample(np.zeros((1, n)), 500, 256).shape == (1, int(n / 500 * 256))
    with pytest.raises(ValueError, match="grid"):
        linear_resample(x, 500, 256, grid="cubic")


@given(n=st.integers(0, 5000), win=st.integers(1, 600))
def test_middle_window_starts_properties(n, win):
    s = middle_window_starts(n, win)
    c = n // 2
    assert len(s) == c // win + (n - c) // win
    if len(s):
        assert (np.diff(s) == win).all()  # contiguous, non-overlapping
        assert c in set(s.tolist()) or c == s[-1] + win  # a boundary at the middle
        assert 0 <= s[0] < win and n - (s[-1] + win) < win  # less than a window left at each end
        assert s[-1] + win <= n


def test_middle_window_starts_small_case():
    # n = 10, win = 3: middle 5; 5 // 3 = 1 window before it (start 2), (10 - 5) // 3 = 1 after (start 5)
    assert middle_window_starts(10, 3).tolist() == [2, 5]
    assert middle_window_starts(2, 3).tolist() == []


# ----------------------------------------------------------------------------- checksums


def test_parse_annex_key_and_symlink_target():
    key = "SHA256E-s24357408--2bee41ac31694c06688bd4e36e4fd1233b4744c5ac80a822ec2a9cd67c5efe0d.set"
    want = (24357408, "2bee41ac31694c06688bd4e36e4fd1233b4744c5ac80a822ec2a9cd67c5efe0d")
    assert adftd.parse_annex_key(key) == want
    assert adftd.parse_annex_key(f"../../../.git/annex/objects/j7/xF/{key}/{key}") == want
    for bad in ("MD5E-s1--d41d8cd98f00b204e9800998ecf8427e.set", "SHA256E-s12--abc.set", "sub-001.set"):
        with pytest.raises(ValueError):
            adftd.parse_annex_key(bad)


def test_verify_file(tmp_path):
    f = tmp_path / "sub-001_task-eyesclosed_eeg.set"
    f.write_bytes(b"EEG" * 1000)
    key = f"SHA256E-s3000--{hashlib.sha256(b'EEG' * 1000).hexdigest()}.set"
    adftd.verify_file(f, key)  # passes
    f.write_bytes(b"EEG" * 999 + b"EEX")  # same size, one byte changed
    with pytest.raises(DataError, match=r"sub-001_task-eyesclosed_eeg\.set: sha256 .*expected"):
        adftd.verify_file(f, key)
    f.write_bytes(b"EEG")
    with pytest.raises(DataError, match=r"sub-001_task-eyesclosed_eeg\.set: 3 bytes, expected 3000"):
        adftd.verify_file(f, key)


def test_verify_recording_uses_the_1_0_8_keys(tmp_path, monkeypatch):
    from medpfl.data import adftd_checksums

    keys = adftd_checksums.DERIVATIVE_KEYS
    assert sorted(keys) == list(range(1, 89))  # 88 subjects
    assert all(adftd.parse_annex_key(k)[0] > 10_000_000 for k in keys.values())
    make_adftd(tmp_path, {7: ("C", ramp_uv(7, 1000))}, raw_too=False)
    with pytest.raises(DataError, match=r"sub-007_task-eyesclosed_eeg\.set: \d+ bytes, expected"):
        adftd.verify_recording(tmp_path, 7)  # our synthetic file is not the real one
    data = (tmp_path / adftd.recording_path("sub-007")).read_bytes()
    monkeypatch.setitem(keys, 7, f"SHA256E-s{len(data)}--{hashlib.sha256(data).hexdigest()}.set")
    adftd.verify_recording(tmp_path, 7)
