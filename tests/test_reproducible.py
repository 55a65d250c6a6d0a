"""Byte-reproducible data (docs/pipeline.md, "Byte-reproducible data"): the raw, processed and
partition files depend only on the inputs and params, not on the folder, the time, the locale,
the hash seed or the user's matplotlib settings; the partition figure sits outside the
DVC-versioned data and carries no version strings; the figure names the classes.

The end-to-end test builds the data stages twice, in two folders, the second under a different
environment, and compares every byte (it cannot change the machine: fonts, CPU and library
builds are the same in both builds; docs/pipeline.md says what that leaves open).
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from helpers import copy_repo, make_env, snakemake, tiny_params, write_params, write_synthetic
from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.sources import dataset_spec
from medpfl.data.synthetic import write_synthetic_npz
from medpfl.io import NPZ_DATE_TIME, write_json, write_npz, write_parquet, write_text
from medpfl.report.partition_figure import class_tick_labels, figure_style, heatmap_figure, partition_heatmap

PNG = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- writers

def test_npz_entries_have_fixed_fields_and_round_trip(tmp_path):
    arrays = {"images": np.arange(24, dtype=np.uint8).reshape(2, 3, 4), "labels": np.array([3, 1], dtype=">i8"),
              "names": np.array(["basophil", "eosinophil"]), "n": np.int64(2)}
    write_npz(tmp_path / "a.npz", arrays)
    time.sleep(2.1)  # a zip entry time has a 2 s resolution
    (tmp_path / "elsewhere").mkdir()
    write_npz(tmp_path / "elsewhere" / "a.npz", arrays)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "elsewhere" / "a.npz").read_bytes()
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:
        for info in zf.infolist():
            assert (info.date_time, info.create_system, info.external_attr >> 16) == (NPZ_DATE_TIME, 3, 0o600)
            assert info.compress_type == zipfile.ZIP_STORED
    with np.load(tmp_path / "a.npz", allow_pickle=False) as z:
        assert z["labels"].dtype == np.dtype("<i8") and z["labels"].tolist() == [3, 1]  # stored little-endian
        assert np.array_equal(z["images"], arrays["images"]) and z["names"].tolist() == ["basophil", "eosinophil"]
        assert int(z["n"]) == 2
    write_npz(tmp_path / "c.npz", arrays, compress=True)
    with zipfile.ZipFile(tmp_path / "c.npz") as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}


def test_parquet_has_no_version_strings_and_keeps_dtypes(tmp_path):
    import pyarrow

    df = pd.DataFrame({"sample_id": np.arange(4, dtype=np.int64), "split": ["train", "val", "test", "train"],
                       "maybe": pd.array([1, None, 3, 4], dtype="Int64")})
    write_parquet(tmp_path / "t.parquet", df)
    raw = (tmp_path / "t.parquet").read_bytes()
    assert b"pandas_version" not in raw and pd.__version__.encode() not in raw.replace(pyarrow.__version__.encode(), b"")
    meta = pq.ParquetFile(tmp_path / "t.parquet").schema_arrow.metadata
    pandas_meta = json.loads(meta[b"pandas"])
    assert "creator" not in pandas_meta and "pandas_version" not in pandas_meta
    back = pd.read_parquet(tmp_path / "t.parquet")
    pd.testing.assert_frame_equal(back, df)  # the pandas metadata still restores Int64 and the index
    write_parquet(tmp_path / "u.parquet", df)
    assert (tmp_path / "u.parquet").read_bytes() == raw


def test_text_and_json_are_utf8_with_newlines(tmp_path):
    write_text(tmp_path / "t.txt", "a\nb é\n")
    assert (tmp_path / "t.txt").read_bytes() == "a\nb é\n".encode("utf-8")
    write_json(tmp_path / "j.json", {"b": 0.1, "a": [1, 2], "name": "é"})
    assert (tmp_path / "j.json").read_bytes() == b'{\n  "a": [\n    1,\n    2\n  ],\n  "b": 0.1,\n  "name": "\\u00e9"\n}\n'


def test_synthetic_test_file_is_reproducible(tmp_path):
    a = write_synthetic_npz(tmp_path / "a.npz", counts=(20, 4, 4), seed=3)
    time.sleep(2.1)
    b = write_synthetic_npz(tmp_path / "b.npz", counts=(20, 4, 4), seed=3)
    assert a == b


# ----------------------------------------------------------------------------- figure

COUNTS = {"0": {"train": [5, 0, 2], "test": [1, 0, 1]}, "1": {"train": [0, 7, 1], "test": [0, 2, 0]}}


def test_png_has_no_software_entry_and_ignores_the_users_matplotlib_settings(tmp_path):
    import matplotlib
    from PIL import Image

    partition_heatmap(COUNTS, 3, tmp_path / "a.png", title="t", class_names=["a", "b", "c"])
    with matplotlib.rc_context({"font.family": "serif", "font.size": 14, "axes.titleweight": "bold",
                                "image.cmap": "gray", "savefig.bbox": "tight"}):  # as a user's matplotlibrc
        partition_heatmap(COUNTS, 3, tmp_path / "b.png", title="t", class_names=["a", "b", "c"])
    assert (tmp_path / "a.png").read_bytes().startswith(PNG)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    with Image.open(tmp_path / "a.png") as im:
        assert "Software" not in im.info
    assert b"Matplotlib" not in (tmp_path / "a.png").read_bytes()


def test_class_tick_labels():
    assert class_tick_labels(3) == ["0", "1", "2"]
    assert class_tick_labels(3, ["adipose", "background", "x" * 40]) == \
        ["0 adipose", "1 background", "2 " + "x" * 23 + "\u2026"]
    assert class_tick_labels(1, ["collecting duct (long explanation here)"]) == ["0 collecting duct"]
    assert class_tick_labels(2, ["0", "1"]) == ["0", "1"]  # MNIST digits and RetinaMNIST grades
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        class_tick_labels(3, ["a", "b"])


def test_figure_names_medmnist_classes():
    import matplotlib.pyplot as plt

    names = dataset_spec("bloodmnist").class_names
    assert names[:3] == ("basophil", "eosinophil", "erythroblast") and len(names) == 8
    assert dataset_spec("mnist").class_names == tuple("0123456789")
    counts = {"0": {"train": [1] * 8, "test": [0] * 8}}
    with figure_style():
        fig = heatmap_figure(counts, 8, names)
    try:
        ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    finally:
        plt.close(fig)
    assert ticks[0] == "0 basophil" and ticks[3] == "3 immature granulocytes"  # "(myelocytes, ...)" dropped
    with figure_style():
        fig = heatmap_figure(counts, 8, None)
    try:
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [str(c) for c in range(8)]
    finally:
        plt.close(fig)


def test_heatmap_shows_client_totals_and_spells_out_the_scheme(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from medpfl.report import partition_figure as pf

    counts = {**COUNTS, "2": {"train": [0, 0, 3], "test": [0, 0, 1], "val": [1, 0, 0]}}
    assert pf.client_totals(counts) == {"0": 9, "1": 10, "2": 5}  # val counts where a partition has it
    with figure_style():
        fig = heatmap_figure(counts, 3, None, title="t")
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0 (9)", "1 (10)", "2 (5)"]
        assert ax.get_ylabel() == "client (samples in all)"
    finally:
        plt.close(fig)
    stats = {"dataset": "bloodmnist", "partition": "dir0.1", "num_classes": 3, "clients": counts,
             "config": {"scheme": "dirichlet", "alpha": 0.1, "num_clients": 3}}
    assert pf.partition_title(stats) == ("bloodmnist / dir0.1: Dirichlet label skew, α = 0.1\n"
                                         "3 clients, 24 samples (5–10 per client)\n"
                                         "samples per class and client (local train + test)")
    assert pf.describe_partition({"scheme": "iid"}) == "IID"
    assert pf.describe_partition({"scheme": "pathological", "classes_per_client": 2}) == \
        "pathological, 2 classes per client"
    assert pf.describe_partition({"scheme": "per_client_dirichlet", "alpha": 0.05}) == "per client dirichlet, α = 0.05"
    # the CLI (the partition_figure rule) titles the figure from client_stats.json
    seen = {}
    monkeypatch.setattr(pf, "partition_heatmap", lambda *a, **k: seen.update(k))
    from medpfl.cli import main

    (tmp_path / "client_stats.json").write_text(json.dumps(stats))
    main(["partition-figure", "--stats", str(tmp_path / "client_stats.json"), "--out", str(tmp_path / "h.png")])
    assert seen["title"] == pf.partition_title(stats)


def test_class_names_travel_from_preprocess_to_client_stats(tmp_path):
    from medpfl.cli import main

    write_synthetic_npz(tmp_path / "raw.npz", num_classes=3, n_channels=1, counts=(60, 6, 6), seed=0)
    preprocess(tmp_path / "raw.npz", tmp_path / "p.npz", tmp_path / "s.parquet", 3, 1,
               class_names=["normal", "benign", "malignant"])
    assert load_processed(tmp_path / "p.npz", tmp_path / "s.parquet").class_names == ("normal", "benign", "malignant")
    job = {"dataset": "x", "name": "d", "config": {"num_clients": 2, "alpha": 1.0, "min_samples": 5}}
    assert main(["partition", "--job", json.dumps(job), "--arrays", str(tmp_path / "p.npz"),
                 "--samples", str(tmp_path / "s.parquet"), "--out-dir", str(tmp_path / "part")]) == 0
    stats = json.loads((tmp_path / "part" / "client_stats.json").read_text())
    assert stats["class_names"] == ["normal", "benign", "malignant"]
    assert main(["partition-figure", "--stats", str(tmp_path / "part" / "client_stats.json"),
                 "--out", str(tmp_path / "fig.png")]) == 0
    preprocess(tmp_path / "raw.npz", tmp_path / "q.npz", tmp_path / "t.parquet", 3, 1)  # custom data: no names
    assert load_processed(tmp_path / "q.npz", tmp_path / "t.parquet").class_names is None


# ----------------------------------------------------------------------------- end to end

def _build(work: Path, synth: dict, extra_env: dict, snakefile: Path) -> Path:
    params = tiny_params(synth)
    params["data"] = {"datasets": ["synth", "synthetic_0.5_0.5"], "custom": {"synth": synth},
                      "synthetic": {"synthetic_0.5_0.5": {"num_clients": 5, "dimension": 6, "num_classes": 3}}}
    params["partitions"] = [
        {"name": "d", "num_clients": 4, "alpha": 0.5, "min_samples": 5, "datasets": ["synth"]},
        {"name": "s", "num_clients": 3, "alpha": 0.5, "min_samples": 5, "datasets": ["synth"],
         "local_test": {"fraction": 0.25, "rule": "stratified"}},
        {"name": "nat", "scheme": "natural", "num_clients": 5, "alpha": None, "datasets": ["synthetic_0.5_0.5"]},
    ]
    write_params(work, params)
    env = make_env(work) | extra_env
    snakemake(work, "data_all", env=env, snakefile=snakefile)
    return work


@pytest.mark.slow
def test_data_stages_are_byte_identical_in_two_folders(tmp_path):
    snakefile = copy_repo(tmp_path / "workflow") / "Snakefile"  # a snapshot: edits meanwhile change nothing
    synth = write_synthetic(tmp_path / "input" / "synth.npz")
    first = tmp_path / "a"
    first.mkdir()
    _build(first, synth, {}, snakefile)
    # another folder (deeper, other name), later, under another locale, time zone, hash seed
    # and a user matplotlibrc that changes fonts and sizes
    rc = tmp_path / "mplconfig"
    rc.mkdir()
    (rc / "matplotlibrc").write_text("font.family: serif\nfont.size: 13\naxes.titleweight: bold\n"
                                     "savefig.bbox: tight\nimage.cmap: gray\n")
    second_dir = tmp_path / "elsewhere" / "clone two"
    second_dir.mkdir(parents=True)
    time.sleep(2.1)
    second = _build(second_dir, synth, {"MPLCONFIGDIR": str(rc), "TZ": "Pacific/Kiritimati", "LC_ALL": "C",
                                        "LANG": "C", "PYTHONHASHSEED": "4242"}, snakefile)

    files = sorted(p.relative_to(first) for p in (first / "data").rglob("*") if p.is_file())
    expected = {f"data/{d}/{n}" for d in ("raw", "processed") for n in ("synth.npz", "synthetic_0.5_0.5.npz")}
    expected |= {f"data/processed/{n}.samples.parquet" for n in ("synth", "synthetic_0.5_0.5")}
    for ds, part in (("synth", "d"), ("synth", "s"), ("synthetic_0.5_0.5", "nat")):
        expected |= {f"data/partitions/{ds}/{part}/{n}" for n in ("partition.parquet", "client_stats.json")}
        expected |= {f"data/figures/{ds}/{part}/heatmap.png"}
    assert {str(f) for f in files} == expected
    different = [str(f) for f in files if (first / f).read_bytes() != (second / f).read_bytes()]
    assert different == [], f"not byte-identical between the two builds: {different}"
