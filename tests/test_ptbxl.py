"""PTB-XL reader: tiny synthetic records in the official 1.0.3 layout (wfdb.wrsamp)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

wfdb = pytest.importorskip("wfdb")

from medpfl.data import ptbxl  # noqa: E402
from medpfl.errors import DataError  # noqa: E402

LEADS = ["I", "II", "III", "AVR", "AVL", "AVF", "V1", "V2", "V3", "V4", "V5", "V6"]

STATEMENTS = pd.DataFrame(
    {"description": ["normal", "inferior MI", "ST-T", "LBBB", "LVH", "sinus rhythm", "low voltage"],
     "diagnostic": [1, 1, 1, 1, 1, np.nan, np.nan],
     "diagnostic_class": ["NORM", "MI", "STTC", "CD", "HYP", np.nan, np.nan]},
    index=["NORM", "IMI", "NDT", "CLBBB", "LVH", "SR", "LVOLT"])

# ecg_id -> (patient_id, scp_codes, expected superclass or None)
RECORDS = {
    1: (10.0, "{'NORM': 100.0, 'SR': 0.0}", "NORM"),
    2: (11.0, "{'NDT': 50.0, 'IMI': 80.0, 'SR': 0.0}", "MI"),  # highest likelihood wins
    3: (12.0, "{'LVOLT': 100.0, 'LVH': 50.0}", None),  # top code not diagnostic -> other
    4: (13.0, "{'NORM': 100.0}", "NORM"),  # patient 13: mixed NORM / CD -> dropped
    5: (13.0, "{'CLBBB': 100.0}", "CD"),
    6: (14.0, "{'LVH': 100.0}", "HYP"),
    7: (14.0, "{'LVH': 35.0, 'SR': 0.0}", "HYP"),  # patient 14: two HYP records -> kept
    8: (15.0, "{'NDT': 100.0}", "STTC"),
}


def _signal(ecg_id: int, n: int = 5000, fs: int = 500, leads: int = 12) -> np.ndarray:
    t = np.arange(n) / fs
    rng = np.random.default_rng(ecg_id)
    sig = np.stack([(0.5 + 0.1 * j) * np.sin(2 * np.pi * (1 + ecg_id + j) * t / 3) + 0.2 * j
                    for j in range(leads)], axis=1)
    return sig + 0.01 * rng.standard_normal(sig.shape)


def write_record(root, ecg_id: int, n: int = 5000, fs: int = 500, leads: int = 12) -> str:
    folder = f"{(ecg_id // 1000) * 1000:05d}"
    name = f"{ecg_id:05d}_hr"
    d = root / "records500" / folder
    d.mkdir(parents=True, exist_ok=True)
    wfdb.wrsamp(name, fs=fs, units=["mV"] * leads, sig_name=LEADS[:leads], p_signal=_signal(ecg_id, n, fs, leads),
                fmt=["16"] * leads, write_dir=str(d))
    return f"records500/{folder}/{name}"


def make_ptbxl(root, ids=None, order=None, **rec_kw) -> None:
    ids = list(RECORDS) if ids is None else ids
    for e in (order or ids):
        write_record(root, e, **rec_kw)
    rows = [{"ecg_id": e, "patient_id": RECORDS[e][0], "age": 50.0, "scp_codes": RECORDS[e][1],
             "strat_fold": 1 + e % 10, "filename_lr": f"records100/00000/{e:05d}_lr",
             "filename_hr": f"records500/00000/{e:05d}_hr"} for e in ids]
    pd.DataFrame(rows).to_csv(root / ptbxl.DATABASE_CSV, index=False)
    STATEMENTS.to_csv(root / ptbxl.STATEMENTS_CSV)


def test_labels_highest_likelihood_and_patient_filter(tmp_path):
    make_ptbxl(tmp_path)
    db = ptbxl.read_database(tmp_path)
    assert db["superclass"].tolist() == [RECORDS[e][2] for e in RECORDS]
    assert db["patient_id"].dtype == np.int64 and db["patient_id"].tolist()[:2] == [10, 11]
    kept = ptbxl.label_records(db)
    # 3: "other" patient dropped; 4, 5: mixed patient dropped
    assert kept["ecg_id"].tolist() == [1, 2, 6, 7, 8]
    assert kept["label"].tolist() == [0, 1, 4, 4, 2]
    assert ptbxl.SUPERCLASSES == ("NORM", "MI", "STTC", "CD", "HYP")


def test_other_record_drops_its_whole_patient(tmp_path):
    db = pd.DataFrame({"ecg_id": [1, 2], "patient_id": [7, 7], "strat_fold": [1, 1],
                       "filename_hr": ["a", "b"], "top_code": ["NORM", "SR"], "superclass": ["NORM", None]})
    assert ptbxl.label_records(db).empty


def test_shapes_dtypes_table(tmp_path):
    make_ptbxl(tmp_path)
    s = ptbxl.load_ptbxl(tmp_path)
    assert s.x.shape == (50, 12, 512) and s.x.dtype == np.float32
    t = s.table
    assert list(t.columns) == ["sample_id", "ecg_id", "patient_id", "subject_id", "strat_fold", "window", "label"]
    assert t["subject_id"].tolist() == t["patient_id"].tolist() and s.class_names == ptbxl.SUPERCLASSES
    assert t["sample_id"].tolist() == list(range(50))
    assert t["window"].tolist() == list(range(10)) * 5
    assert t["ecg_id"].tolist() == [e for e in [1, 2, 6, 7, 8] for _ in range(10)]
    assert t["patient_id"].tolist()[::10] == [10, 11, 14, 14, 15]
    assert t["strat_fold"].tolist()[::10] == [2, 3, 7, 8, 9]
    assert t["label"].tolist()[::10] == [0, 1, 4, 4, 2]
    assert all(t[c].dtype == np.int64 for c in t.columns)
    # left zero padding: 262 zeros, then 250 real samples
    assert not s.x[:, :, :262].any()
    assert (np.abs(s.x[:, :, 262:]).sum(axis=2) > 0).all()


def test_missing_root_names_url_and_terms(tmp_path):
    with pytest.raises(DataError) as e:
        ptbxl.load_ptbxl(tmp_path / "nowhere")
    msg = str(e.value)
    assert "\n" not in msg and ptbxl.OFFICIAL_URL in msg and ptbxl.ACCESS_TERMS in msg


def test_ecg_id_order_not_directory_order(tmp_path):
    ids = [8, 2, 6, 1, 7]  # CSV rows shuffled; files written in yet another order
    make_ptbxl(tmp_path, ids=ids, order=[7, 1, 8, 6, 2])
    s = ptbxl.load_ptbxl(tmp_path)
    assert s.records["ecg_id"].tolist() == [1, 2, 6, 7, 8]
    for i, e in enumerate([1, 2, 6, 7, 8]):
        want = ptbxl.record_windows(ptbxl.read_record(tmp_path, f"records500/00000/{e:05d}_hr"))
        np.testing.assert_array_equal(s.x[10 * i:10 * (i + 1)], want)


def test_resampled_length_and_content():
    fs = 500
    t = np.arange(5000) / fs
    sig = np.stack([np.sin(2 * np.pi * 5 * t)] * 12, axis=1)  # 5 Hz, well under 125 Hz Nyquist
    r = ptbxl.resample(sig)
    assert r.shape == (2500, 12)
    t2 = np.arange(2500) / 250
    # away from the edges the resampled sine matches the 250 Hz sine
    np.testing.assert_allclose(r[100:-100, 0], np.sin(2 * np.pi * 5 * t2)[100:-100], atol=1e-3)


def test_standardisation_per_lead(tmp_path):
    sig = _signal(3)
    w = ptbxl.record_windows(sig, window_normalize=False)[:, :, 262:]  # [10, 12, 250]
    rec = w.transpose(1, 0, 2).reshape(12, 2500)  # the 10-s record, per lead
    np.testing.assert_allclose(rec.mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(rec.std(axis=1), 1, atol=1e-4)
    w2 = ptbxl.record_windows(sig)[:, :, 262:]  # FHBench's load-time per-window z-norm
    np.testing.assert_allclose(w2.mean(axis=2), 0, atol=1e-5)
    np.testing.assert_allclose(w2.std(axis=2), 1, atol=1e-4)
    # window w is 250 samples [250 w, 250 (w + 1)) of the standardised record
    x = ptbxl.standardise(ptbxl.resample(sig), axis=0)
    np.testing.assert_allclose(w[3], x[750:1000].T, atol=1e-5)


def test_constant_lead_is_only_centred():
    sig = _signal(1)
    sig[:, 4] = 2.5
    w = ptbxl.record_windows(sig)[:, :, 262:]
    assert np.isfinite(w).all() and np.abs(w).max() <= np.sqrt(250) + 1e-3
    # away from the resampler's edge transient (first and last window) the flat lead stays flat
    assert np.abs(w[1:9, 4]).max() < 1e-5


def test_missing_column_names_file(tmp_path):
    make_ptbxl(tmp_path, ids=[1])
    db = pd.read_csv(tmp_path / ptbxl.DATABASE_CSV).drop(columns=["scp_codes"])
    db.to_csv(tmp_path / ptbxl.DATABASE_CSV, index=False)
    with pytest.raises(DataError, match=r"ptbxl_database\.csv: missing column\(s\) scp_codes"):
        ptbxl.read_database(tmp_path)
    STATEMENTS.drop(columns=["diagnostic_class"]).to_csv(tmp_path / ptbxl.STATEMENTS_CSV)
    with pytest.raises(DataError, match=r"scp_statements\.csv: missing column\(s\) diagnostic_class"):
        ptbxl.read_statements(tmp_path)


def test_missing_csv_and_bad_codes(tmp_path):
    with pytest.raises(DataError, match=r"ptbxl_database\.csv: file not found"):
        ptbxl.read_database(tmp_path)
    make_ptbxl(tmp_path, ids=[1])
    db = pd.read_csv(tmp_path / ptbxl.DATABASE_CSV)
    db["scp_codes"] = "NORM: 100"
    db.to_csv(tmp_path / ptbxl.DATABASE_CSV, index=False)
    with pytest.raises(DataError, match=r"ptbxl_database\.csv: ecg_id 1: scp_codes .* not a dict literal"):
        ptbxl.read_database(tmp_path)


def test_missing_record_names_file(tmp_path):
    make_ptbxl(tmp_path)
    (tmp_path / "records500/00000/00006_hr.dat").unlink()
    with pytest.raises(DataError, match=r"records500/00000/00006_hr\.dat: record file not found"):
        ptbxl.load_ptbxl(tmp_path)


def test_wrong_lead_count_names_file(tmp_path):
    make_ptbxl(tmp_path, ids=[1])
    write_record(tmp_path, 1, leads=11)
    with pytest.raises(DataError, match=r"00001_hr\.hea: 11 leads, expected 12"):
        ptbxl.load_ptbxl(tmp_path)


def test_wrong_sampling_rate_names_file(tmp_path):
    make_ptbxl(tmp_path, ids=[1])
    write_record(tmp_path, 1, n=1000, fs=100)  # a records100 file where a records500 one belongs
    with pytest.raises(DataError, match=r"00001_hr\.hea: sampling rate 100 Hz, expected 500 Hz"):
        ptbxl.load_ptbxl(tmp_path)


def test_short_record_names_file(tmp_path):
    make_ptbxl(tmp_path, ids=[1])
    write_record(tmp_path, 1, n=4000)
    with pytest.raises(DataError, match=r"00001_hr\.hea: 4000 samples, expected at least 5000"):
        ptbxl.load_ptbxl(tmp_path)


def test_top_code_ties_take_the_first_in_string_order():
    assert ptbxl.top_code({"IMI": 50.0, "NORM": 50.0, "SR": 0.0}) == "IMI"
    assert ptbxl.top_code({"NORM": 50.0, "IMI": 50.0}) == "NORM"
    assert ptbxl.top_code({}) is None


def test_unknown_diagnostic_class_names_file(tmp_path):
    make_ptbxl(tmp_path, ids=[1])
    bad = STATEMENTS.copy()
    bad.loc["LVH", "diagnostic_class"] = "XYZ"
    bad.to_csv(tmp_path / ptbxl.STATEMENTS_CSV)
    with pytest.raises(DataError, match=r"scp_statements\.csv: diagnostic_class value\(s\) \['XYZ'\]"):
        ptbxl.read_statements(tmp_path)
