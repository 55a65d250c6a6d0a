"""ICBHI 2017 and SPRSound readers: tiny synthetic data sets in the official layouts (soundfile)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

sf = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from medpfl.data import audio  # noqa: E402
from medpfl.errors import DataError  # noqa: E402

N = audio.N_SAMPLES
F = audio.FADE_SAMPLES
RAMP = np.linspace(0.0, 1.0, F)


# --- fixture writers ---------------------------------------------------------------------------

def _tone(sr: int, seconds: float, freq: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    mono = 0.4 * np.sin(2 * np.pi * freq * t) + 0.1 * np.sin(2 * np.pi * 3.7 * freq * t)
    if channels == 1:
        return mono
    return np.stack([mono + 0.05 * (c - (channels - 1) / 2) for c in range(channels)], axis=1)


# stem -> (rate Hz, channels, seconds, frequency Hz, cycles as written (onset, offset, crackles,
# wheezes), official split). Lines are deliberately not in onset order.
ICBHI_RECS = {
    "130_2p5_Tc_mc_AKGC417L": (44100, 2, 4.0, 300.0, [(1.4, 3.9, 0, 0), (0.2, 1.4, 0, 1)], "train"),
    "101_1b1_Al_sc_Meditron": (4000, 1, 12.0, 200.0, [(5.5, 7.0, 1, 1), (0.5, 2.5, 0, 0), (2.5, 5.5, 1, 0)], "test"),
    "107_2b3_Pr_mc_LittC2SE": (10000, 1, 11.0, 250.0, [(0.25, 10.0, 0, 1)], "test"),
}


def write_icbhi(folder, recs=ICBHI_RECS, subtype="PCM_16", split_file=True) -> None:
    """Official layout: ``<stem>.wav`` + ``<stem>.txt`` (tab-separated onset, offset, crackles,
    wheezes) in one folder, plus ``ICBHI_challenge_train_test.txt`` (``<stem>\\t<split>``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stem, (sr, ch, sec, f, cycles, _) in recs.items():
        sf.write(str(folder / f"{stem}.wav"), _tone(sr, sec, f, ch), sr, subtype=subtype)
        (folder / f"{stem}.txt").write_text("".join(f"{a}\t{b}\t{c}\t{w}\n" for a, b, c, w in cycles))
    if split_file:
        lines = [f"{stem}\t{r[5]}" for stem, r in reversed(recs.items())]
        (folder / audio.ICBHI_SPLIT_FILE).write_text("\n".join(lines) + "\n")


# stem -> (part index in audio.SPRSOUND_PARTS, rate, seconds, frequency, record annotation,
# events (start, end, type); start/end written as strings like the release, except one file).
SPRS_RECS = {
    "65058931_3.4_1_p2_1086": (0, 8000, 9.0, 220.0, "CAS & DAS",
                               [("4300", "5600", "Wheeze"), ("1000", "2500", "Normal"),
                                ("6000", "7000", "Fine Crackle")]),
    "40794666_4.4_1_p1_41": (0, 8000, 6.0, 180.0, "DAS",
                             [(3000, 4200, "Coarse Crackle"), (500, 1900, "Wheeze+Crackle")]),
    "40794666_4.4_1_p4_44": (0, 8000, 5.0, 190.0, "Poor Quality", []),
    "41225759_7.2_1_p1_4205": (1, 8000, 5.0, 260.0, "CAS", [("200", "1800", "Rhonchi")]),
    "64779933_1.3_0_p3_3817": (2, 16000, 5.0, 240.0, "CAS", [("2100", "3300", "Stridor")]),
}


def write_sprsound(root, recs=SPRS_RECS) -> None:
    """Official layout: ``BioCAS2022/{train2022,test2022}_wav/<stem>.wav``, annotations in
    ``train2022_json/`` and ``test2022_json/{inter,intra}_test_json/`` (``record_annotation``,
    ``event_annotation`` with start/end in ms)."""
    base = root / audio.SPRSOUND_FOLDER
    for _, _, wav_dir, json_dir in audio.SPRSOUND_PARTS:
        (base / wav_dir).mkdir(parents=True, exist_ok=True)
        (base / json_dir).mkdir(parents=True, exist_ok=True)
    for stem, (part, sr, sec, f, record, events) in recs.items():
        _, _, wav_dir, json_dir = audio.SPRSOUND_PARTS[part]
        sf.write(str(base / wav_dir / f"{stem}.wav"), _tone(sr, sec, f), sr, subtype="PCM_16")
        doc = {"record_annotation": record,
               "event_annotation": [{"start": s, "end": e, "type": t} for s, e, t in events]}
        (base / json_dir / f"{stem}.json").write_text(json.dumps(doc))


@pytest.fixture
def icbhi_root(tmp_path):
    write_icbhi(tmp_path / "ICBHI_final_database")
    return tmp_path


@pytest.fixture
def sprs_root(tmp_path):
    write_sprsound(tmp_path)
    return tmp_path


# --- ICBHI -------------------------------------------------------------------------------------

def test_icbhi_index_order_labels_subjects_split(icbhi_root):
    t = audio.icbhi_index(icbhi_root)
    # recordings by name, cycles by onset, whatever the file and line order
    assert t["recording"].tolist() == ["101_1b1_Al_sc_Meditron"] * 3 + ["107_2b3_Pr_mc_LittC2SE"] \
        + ["130_2p5_Tc_mc_AKGC417L"] * 2
    assert t["onset_s"].tolist() == [0.5, 2.5, 5.5, 0.25, 0.2, 1.4]
    assert t["cycle"].tolist() == [0, 1, 2, 0, 0, 1]
    # normal 0, crackles 1, wheezes 2, both flags 3
    assert t["label"].tolist() == [0, 1, 3, 2, 2, 0]
    assert t["subject_id"].tolist() == [101, 101, 101, 107, 130, 130]
    assert t["subject_id"].dtype == np.int64 and t["label"].dtype == np.int64
    assert t["split"].tolist() == ["test"] * 4 + ["train"] * 2
    assert t["file"].iloc[0] == "ICBHI_final_database/101_1b1_Al_sc_Meditron.wav"
    assert audio.ICBHI_CLASSES == ("normal", "crackle", "wheeze", "both")


def test_icbhi_label_map():
    assert [audio.icbhi_label(c, w) for c, w in [(0, 0), (1, 0), (0, 1), (1, 1)]] == [0, 1, 2, 3]


def test_icbhi_load_shapes_crop_and_normalisation(icbhi_root):
    raw = audio.load_icbhi(icbhi_root, normalize=False)
    s = audio.load_icbhi(icbhi_root)
    assert s.x.shape == (6, N) and s.x.dtype == np.float32
    assert s.table["sample_id"].tolist() == list(range(6))
    assert s.class_names == audio.ICBHI_CLASSES
    # each cycle: the [int(on*sr), int(off*sr)) crop of its own file, mono, resampled, faded, 8 s
    for row, xr in zip(raw.table.itertuples(), raw.x):
        sig, sr = audio.read_wav(icbhi_root / row.file)
        seg = sig[int(row.onset_s * sr):int(row.offset_s * sr)]
        np.testing.assert_allclose(xr, audio.cycle_waveform(seg, sr, normalize_input=False), atol=1e-6)
    # per-sample normalisation of the 128,000 values, (x - mean) / sqrt(var + 1e-7)
    for xr, xn in zip(raw.x.astype(np.float64), s.x):
        want = (xr - xr.mean()) / np.sqrt(xr.var() + 1e-7)
        np.testing.assert_allclose(xn, want, atol=2e-5)
        assert abs(float(xn.mean())) < 1e-5 and abs(float(xn.std()) - 1) < 1e-3


def test_icbhi_long_cycle_is_cut_at_8_s_without_second_fade(icbhi_root):
    raw = audio.load_icbhi(icbhi_root, normalize=False)
    row = raw.table.index[raw.table["recording"] == "107_2b3_Pr_mc_LittC2SE"][0]
    x = raw.x[row].astype(np.float64)
    # the 9.75-s cycle from 0.25 s: the first 8 s of a 250 Hz (+ 925 Hz) tone at 16 kHz
    t = 0.25 + np.arange(N) / 16000
    tone = 0.4 * np.sin(2 * np.pi * 250 * t) + 0.1 * np.sin(2 * np.pi * 925 * t)
    np.testing.assert_allclose(x[F:], tone[F:], atol=3e-3)  # PCM_16 + resampler error
    np.testing.assert_allclose(x[:F], tone[:F] * RAMP, atol=3e-3)  # fade-in only, no fade-out


def test_mono_is_channel_mean(tmp_path):
    st = np.stack([np.linspace(-0.5, 0.5, 400), np.linspace(0.25, 0.0, 400)], axis=1)
    sf.write(str(tmp_path / "s.wav"), st, 4000, subtype="FLOAT")
    mono, sr = audio.read_wav(tmp_path / "s.wav")
    assert sr == 4000 and mono.dtype == np.float32 and mono.shape == (400,)
    np.testing.assert_allclose(mono, st.mean(axis=1), atol=1e-7)


def test_crop_is_sample_exact_at_16khz(tmp_path):
    sr = 16000
    sig = (np.arange(4 * sr) % 7919) / 10000.0  # value identifies the sample
    folder = tmp_path / "db"
    folder.mkdir()
    sf.write(str(folder / "150_1b2_Al_sc_Meditron.wav"), sig, sr, subtype="FLOAT")
    (folder / "150_1b2_Al_sc_Meditron.txt").write_text("0.5\t3.25\t0\t0\n")
    (folder / audio.ICBHI_SPLIT_FILE).write_text("150_1b2_Al_sc_Meditron\ttrain\n")
    x = audio.load_icbhi(folder, normalize=False, dtype=np.float64).x[0]
    seg = sig[8000:52000]  # [int(0.5 * 16000), int(3.25 * 16000))
    np.testing.assert_allclose(x[F:len(seg) - F], seg[F:len(seg) - F], atol=1e-7)


# --- the signal steps --------------------------------------------------------------------------

def test_fade_ramps_first_and_last_sixteenth_second():
    y = audio.fade(np.ones(3 * 16000))
    np.testing.assert_array_equal(y[:F], RAMP)
    np.testing.assert_array_equal(y[-F:], RAMP[::-1])
    assert (y[F:-F] == 1).all() and y[0] == 0 and y[-1] == 0
    assert F == 16000 // 16
    with pytest.raises(ValueError):
        audio.fade(np.ones(F - 1))


def test_short_cycle_is_repeated_circularly_then_faded_out():
    rng = np.random.default_rng(0)
    src = rng.standard_normal(24000).astype(np.float32)  # 1.5 s at 16 kHz: no resampling
    out = audio.cycle_waveform(src, 16000, normalize_input=False)
    faded = audio.fade(src)
    k = np.arange(N)
    rep = faded[k % len(src)]  # 6 copies, the last one cut: 128,000 = 5 x 24,000 + 8,000
    np.testing.assert_allclose(out[:N - F], rep[:N - F], rtol=0, atol=0)
    np.testing.assert_allclose(out[N - F:], rep[N - F:] * RAMP[::-1], atol=1e-15)
    assert out.shape == (N,)
    # each repeat starts with the faded-in cycle: a 0 at every period
    assert (out[::24000][:5] == 0).all()


def test_long_cycle_is_cut_at_128000():
    src = np.linspace(0.1, 1.0, 10 * 16000, dtype=np.float32).astype(np.float64)
    out = audio.cycle_waveform(src, 16000, normalize_input=False)
    np.testing.assert_allclose(out[F:], src[F:N])
    np.testing.assert_allclose(out[:F], src[:F] * RAMP)
    assert out[-1] == src[N - 1]


def test_cycle_of_exactly_8_s_is_faded_out_twice():
    out = audio.cycle_waveform(np.ones(N), 16000, normalize_input=False)
    np.testing.assert_allclose(out[-F:], RAMP[::-1] ** 2)  # as FHBench's `<=` branch


@pytest.mark.parametrize("sr", [4000, 8000, 10000, 44100])
def test_resampled_length_and_content(sr):
    n = int(1.3 * sr) + 7
    t = np.arange(n) / sr
    y = audio.resample(np.sin(2 * np.pi * 180 * t), sr)
    assert y.dtype == np.float32
    assert y.shape == (audio.resampled_length(n, sr),) == (math.floor(n * 16000 / sr + 0.5),)
    t16 = np.arange(len(y)) / 16000
    mid = slice(800, len(y) - 800)  # away from the filter's edge transients
    np.testing.assert_allclose(y[mid], np.sin(2 * np.pi * 180 * t16[mid]), atol=2e-3)


def test_too_short_cycle_names_the_file(tmp_path):
    folder = tmp_path / "db"
    write_icbhi(folder, {"101_1b1_Al_sc_Meditron": (4000, 1, 3.0, 200.0, [(1.0, 1.05, 0, 0)], "test")})
    with pytest.raises(DataError, match=r"101_1b1_Al_sc_Meditron\.wav: cycle 0 .*fade"):
        audio.load_icbhi(folder)


# --- streaming, limit, dtype ---------------------------------------------------------------------

def test_limit_dtype_and_subset_streaming(icbhi_root):
    full = audio.load_icbhi(icbhi_root)
    two = audio.load_icbhi(icbhi_root, limit=2)
    assert len(two.table) == 2 and two.table["recording"].tolist() == full.table["recording"][:2].tolist()
    np.testing.assert_array_equal(two.x, full.x[:2])
    # any subset, in any order, decodes to the same rows
    sub = full.table.iloc[[5, 0, 3]]
    x = audio.waveforms(icbhi_root, sub, audio.icbhi_crop)
    np.testing.assert_array_equal(x, full.x[[5, 0, 3]])
    half = audio.waveforms(icbhi_root, sub, audio.icbhi_crop, dtype=np.float16)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, full.x[[5, 0, 3]], atol=5e-3, rtol=1e-3)


# --- SPRSound ----------------------------------------------------------------------------------

def test_sprsound_index_labels_order_split_subjects(sprs_root):
    t = audio.sprsound_index(sprs_root)
    assert t["recording"].tolist() == ["40794666_4.4_1_p1_41"] * 2 + ["41225759_7.2_1_p1_4205"] \
        + ["64779933_1.3_0_p3_3817"] + ["65058931_3.4_1_p2_1086"] * 3  # Poor Quality: no events
    assert t["start_ms"].tolist() == [500, 3000, 200, 2100, 1000, 4300, 6000]
    assert t["onset_s"].tolist() == [0.5, 3.0, 0.2, 2.1, 1.0, 4.3, 6.0]
    assert t["cycle"].tolist() == [0, 1, 0, 0, 0, 1, 2]
    assert t["type"].tolist() == ["Wheeze+Crackle", "Coarse Crackle", "Rhonchi", "Stridor",
                                  "Normal", "Wheeze", "Fine Crackle"]
    assert t["label"].tolist() == [4, 3, 5, 6, 0, 2, 1]
    assert t["subject_id"].tolist() == [40794666] * 2 + [41225759, 64779933] + [65058931] * 3
    assert t["split"].tolist() == ["train", "train", "test", "test", "train", "train", "train"]
    assert t["test_set"].tolist()[2:4] == ["inter_test", "intra_test"]
    assert t["file"].iloc[2] == "BioCAS2022/test2022_wav/41225759_7.2_1_p1_4205.wav"


@pytest.mark.parametrize("name,label", list(zip(audio.SPRSOUND_CLASSES, range(7))))
def test_sprsound_label_map(tmp_path, name, label):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"record_annotation": "CAS", "event_annotation": [
        {"start": "10", "end": "900", "type": name}]}))
    _, ev = audio.read_sprsound_annotation(p)
    assert ev["label"].tolist() == [label]


def test_sprsound_load_crop_in_ms(sprs_root):
    s = audio.load_sprsound(sprs_root, normalize=False)
    assert s.x.shape == (7, N) and s.class_names == audio.SPRSOUND_CLASSES
    row = s.table.iloc[3]  # 64779933: 16 kHz, 2100-3300 ms -> samples [33600, 52800)
    sig, sr = audio.read_wav(sprs_root / row["file"])
    assert sr == 16000
    seg = sig[33600:52800].astype(np.float64)
    np.testing.assert_allclose(s.x[3][F:len(seg) - F], seg[F:len(seg) - F], atol=1e-7)
    row = s.table.iloc[0]  # 8 kHz, 500-1900 ms -> [4000, 15200)
    sig, sr = audio.read_wav(sprs_root / row["file"])
    np.testing.assert_allclose(s.x[0], audio.cycle_waveform(sig[4000:15200], 8000, False), atol=1e-6)
    normed = audio.load_sprsound(sprs_root, limit=1)
    xr = s.x[0].astype(np.float64)
    np.testing.assert_allclose(normed.x[0], (xr - xr.mean()) / np.sqrt(xr.var() + 1e-7), atol=2e-5)


# --- errors --------------------------------------------------------------------------------------

def test_missing_roots_name_url_and_terms(tmp_path):
    with pytest.raises(DataError, match="bhichallenge.med.auth.gr.*research"):
        audio.load_icbhi(tmp_path / "nowhere")
    with pytest.raises(DataError, match="SJTU-YONGFU-RESEARCH-GRP/SPRSound.*licence"):
        audio.load_sprsound(tmp_path)


def test_damaged_wav_named(icbhi_root):
    bad = icbhi_root / "ICBHI_final_database" / "107_2b3_Pr_mc_LittC2SE.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk")
    with pytest.raises(DataError, match=r"107_2b3_Pr_mc_LittC2SE\.wav: cannot be read as audio"):
        audio.load_icbhi(icbhi_root)


def test_missing_icbhi_annotation_named(icbhi_root):
    (icbhi_root / "ICBHI_final_database" / "130_2p5_Tc_mc_AKGC417L.txt").unlink()
    with pytest.raises(DataError, match=r"130_2p5_Tc_mc_AKGC417L\.txt: ICBHI annotation file not found"):
        audio.icbhi_index(icbhi_root)


def test_bad_icbhi_annotation_line_named(icbhi_root):
    p = icbhi_root / "ICBHI_final_database" / "101_1b1_Al_sc_Meditron.txt"
    p.write_text("0.5\t2.5\t0\t0\n2.5\t5.5\t2\t0\n")
    with pytest.raises(DataError, match=r"101_1b1_Al_sc_Meditron\.txt: line 2: crackles must be 0 or 1"):
        audio.icbhi_index(icbhi_root)


def test_icbhi_split_list_checked(icbhi_root):
    folder = icbhi_root / "ICBHI_final_database"
    split = folder / audio.ICBHI_SPLIT_FILE
    split.write_text("101_1b1_Al_sc_Meditron\ttest\n107_2b3_Pr_mc_LittC2SE\ttest\n")
    with pytest.raises(DataError, match=r"ICBHI_challenge_train_test\.txt: recording 130_2p5_Tc_mc_AKGC417L"):
        audio.icbhi_index(icbhi_root)
    split.write_text("101_1b1_Al_sc_Meditron\ttest\n107_2b3_Pr_mc_LittC2SE\tval\n130_2p5_Tc_mc_AKGC417L\ttrain\n")
    with pytest.raises(DataError, match=r"split value\(s\) \['val'\]"):
        audio.icbhi_index(icbhi_root)
    split.unlink()
    with pytest.raises(DataError, match="ICBHI_challenge_train_test.txt: ICBHI train/test list not found"):
        audio.icbhi_index(icbhi_root)
    # the list may also sit next to the folder, or be passed explicitly
    write_icbhi(icbhi_root / "elsewhere", split_file=True)
    moved = icbhi_root / "elsewhere" / audio.ICBHI_SPLIT_FILE
    assert len(audio.icbhi_index(icbhi_root, split_file=moved)) == 6


def test_cycle_past_end_of_file_named(tmp_path):
    folder = tmp_path / "db"
    write_icbhi(folder, {"101_1b1_Al_sc_Meditron": (4000, 1, 3.0, 200.0, [(3.5, 4.0, 0, 0)], "test")})
    with pytest.raises(DataError, match=r"101_1b1_Al_sc_Meditron\.wav: cycle 0 .*empty"):
        audio.load_icbhi(folder)


def test_unknown_sprsound_event_type_named(sprs_root):
    p = sprs_root / "BioCAS2022/train2022_json/40794666_4.4_1_p1_41.json"
    p.write_text(json.dumps({"record_annotation": "DAS", "event_annotation": [
        {"start": "10", "end": "900", "type": "Normal"}, {"start": "900", "end": "1500", "type": "Squawk"}]}))
    with pytest.raises(DataError, match=r"40794666_4\.4_1_p1_41\.json: event 1: unknown event type 'Squawk'"):
        audio.sprsound_index(sprs_root)


def test_missing_sprsound_json_and_wav_named(sprs_root):
    base = sprs_root / "BioCAS2022"
    (base / "test2022_json/intra_test_json/64779933_1.3_0_p3_3817.json").unlink()
    with pytest.raises(DataError, match=r"64779933_1\.3_0_p3_3817\.wav: no annotation .*intra_test_json"):
        audio.sprsound_index(sprs_root)
    write_sprsound(sprs_root)
    (base / "train2022_wav/65058931_3.4_1_p2_1086.wav").unlink()
    with pytest.raises(DataError, match=r"65058931_3\.4_1_p2_1086\.wav: audio file not found"):
        audio.sprsound_index(sprs_root)


def test_sprsound_bad_times_named(tmp_path):
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"event_annotation": [{"start": "1200", "end": "800", "type": "Normal"}]}))
    with pytest.raises(DataError, match=r"b\.json: event 0: end 800 ms is not after start 1200 ms"):
        audio.read_sprsound_annotation(p)
    p.write_text(json.dumps({"event_annotation": [{"start": "12a", "end": "800", "type": "Normal"}]}))
    with pytest.raises(DataError, match=r"b\.json: event 0: start '12a'"):
        audio.read_sprsound_annotation(p)
