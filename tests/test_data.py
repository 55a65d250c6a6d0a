"""Tests of medpfl.data.sources (names, specs, mirror fetch with MD5) and medpfl.data.preprocess
(official .npz -> NCHW uint8 arrays + sample table, and its DataError checks)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medpfl.data import sources
from medpfl.data.preprocess import SPLIT_ORDER, load_official_npz, load_processed, preprocess
from medpfl.data.schemas import SampleTable, TableError, validate
from medpfl.data.sources import DataError, dataset_spec, fetch, medmnist_info, parse_dataset_name
from medpfl.data.synthetic import write_synthetic_npz
from medpfl.io import md5sum

BLOOD_DIR = Path("/work/shared/data/medmnist")
BLOOD_MD5 = "7053d0359d879ad8a5505303e11de1dc"
COUNTS = (40, 8, 12)


@pytest.fixture(autouse=True)
def _no_network_sleep(monkeypatch):
    """fetch backs off with time.sleep between download attempts; keep failing tests fast."""
    monkeypatch.setattr(sources.time, "sleep", lambda s: None)


@pytest.fixture
def synth(tmp_path) -> tuple[Path, str]:
    """A small synthetic RGB data set in the official layout and its MD5."""
    path = tmp_path / "src" / "synth.npz"
    path.parent.mkdir()
    md5 = write_synthetic_npz(path, num_classes=4, n_channels=3, counts=COUNTS, seed=0)
    return path, md5


def _custom(path: Path, md5: str, name: str = "synth") -> dict:
    return {name: {"path": str(path), "md5": md5, "n_channels": 3, "num_classes": 4}}


# ----------------------------------------------------------------------------- names and specs


@pytest.mark.parametrize("name,expected", [
    ("bloodmnist", ("bloodmnist", 28)),
    ("bloodmnist_64", ("bloodmnist", 64)),
    ("bloodmnist_128", ("bloodmnist", 128)),
    ("organcmnist_224", ("organcmnist", 224)),
])
def test_parse_dataset_name_accepts(name, expected):
    assert parse_dataset_name(name) == expected


@pytest.mark.parametrize("name,pattern", [
    ("foomnist", r"unknown MedMNIST flag 'foomnist'.*bloodmnist"),
    ("bloodmnist_32", r"'bloodmnist_32'.*size must be one of"),
    ("bloodmnist_28", r"'bloodmnist_28'.*size must be one of 28 \(no suffix\)"),
    ("BloodMNIST", r"'BloodMNIST'.*expected a MedMNIST file stem"),
    ("bloodmnist_", r"expected a MedMNIST file stem"),
    ("blood-mnist", r"expected a MedMNIST file stem"),
])
def test_parse_dataset_name_rejects(name, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_dataset_name(name)


def test_dataset_spec_uses_medmnist_info():
    info, _ = medmnist_info()
    spec = dataset_spec("bloodmnist")
    assert spec.url == info["bloodmnist"]["url"] and spec.url.startswith("https://zenodo.org/")
    assert spec.url.split("?")[0].endswith("/bloodmnist.npz")
    assert spec.md5 == info["bloodmnist"]["MD5"] == BLOOD_MD5
    assert (spec.flag, spec.size, spec.n_channels, spec.num_classes) == ("bloodmnist", 28, 3, 8)
    assert spec.filename == "bloodmnist.npz"
    s64 = dataset_spec("bloodmnist_64")
    assert s64.md5 == info["bloodmnist"]["MD5_64"] != spec.md5
    assert s64.url == info["bloodmnist"]["url_64"]
    assert (s64.size, s64.filename) == (64, "bloodmnist_64.npz")


def test_dataset_spec_custom(synth):
    path, md5 = synth
    spec = dataset_spec("synth", _custom(path, md5))
    assert spec.md5 == md5 and spec.filename == "synth.npz" and spec.num_classes == 4 and spec.n_channels == 3
    assert spec.url == path.resolve().as_uri()


# ----------------------------------------------------------------------------- fetch


def test_fetch_from_mirror_copies_and_verifies(synth, tmp_path):
    path, md5 = synth
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copyfile(path, mirror / "synth.npz")
    out = tmp_path / "raw" / "synth.npz"
    origin = fetch("synth", out, mirrors=[tmp_path / "empty", mirror], retries=1, custom=_custom(path, md5))
    assert origin == f"mirror {mirror / 'synth.npz'}"
    assert out.read_bytes() == path.read_bytes()
    assert md5sum(out) == md5
    # no temporary files left beside the output
    assert sorted(p.name for p in out.parent.iterdir()) == ["synth.npz"]


def test_fetch_mirror_with_wrong_md5_raises_naming_the_mirror(synth, tmp_path):
    path, md5 = synth
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    write_synthetic_npz(mirror / "synth.npz", counts=COUNTS, seed=1)  # same layout, other content
    out = tmp_path / "raw" / "synth.npz"
    with pytest.raises(DataError) as e:
        fetch("synth", out, mirrors=[mirror], retries=1, custom=_custom(path, md5))
    msg = str(e.value)
    assert str(mirror / "synth.npz") in msg and "MD5" in msg and md5 in msg
    assert not out.exists()


def test_fetch_keeps_existing_correct_output(synth, tmp_path):
    path, md5 = synth
    out = tmp_path / "raw" / "synth.npz"
    out.parent.mkdir()
    shutil.copyfile(path, out)
    os.utime(out, (1_000_000, 1_000_000))
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    write_synthetic_npz(mirror / "synth.npz", counts=COUNTS, seed=1)  # would fail if it were used
    assert fetch("synth", out, mirrors=[mirror], retries=1, custom=_custom(path, md5)) == f"existing {out}"
    assert out.stat().st_mtime == 1_000_000 and md5sum(out) == md5


def test_fetch_replaces_corrupt_existing_output(synth, tmp_path):
    path, md5 = synth
    out = tmp_path / "raw" / "synth.npz"
    out.parent.mkdir()
    out.write_bytes(b"garbage")
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copyfile(path, mirror / "synth.npz")
    assert fetch("synth", out, mirrors=[mirror], retries=1, custom=_custom(path, md5)).startswith("mirror ")
    assert md5sum(out) == md5


def test_fetch_without_any_source_says_how_to_provide_the_file(tmp_path):
    missing = tmp_path / "nowhere" / "synth.npz"
    out = tmp_path / "raw" / "synth.npz"
    with pytest.raises(DataError) as e:
        fetch("synth", out, mirrors=[tmp_path / "empty"], retries=1, custom=_custom(missing, "0" * 32))
    msg = str(e.value)
    assert "synth.npz" in msg and "MEDPFL_DATA_MIRROR" in msg and str(tmp_path / "empty") in msg
    assert not out.exists()


def test_fetch_real_bloodmnist_from_mirror(tmp_path):
    if not (BLOOD_DIR / "bloodmnist.npz").is_file():
        pytest.skip("BloodMNIST mirror not present")
    out = tmp_path / "bloodmnist.npz"
    origin = fetch("bloodmnist", out, mirrors=[BLOOD_DIR], retries=1)
    assert origin == f"mirror {BLOOD_DIR / 'bloodmnist.npz'}"
    assert md5sum(out) == BLOOD_MD5


def test_fetch_real_name_rejects_fake_mirror_file(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "bloodmnist.npz").write_bytes(b"not the official file")
    with pytest.raises(DataError, match=r"MD5 mismatch for bloodmnist\.npz: expected " + BLOOD_MD5) as e:
        fetch("bloodmnist", tmp_path / "out.npz", mirrors=[mirror], retries=1)
    assert str(mirror / "bloodmnist.npz") in str(e.value)


def test_default_mirrors_env(monkeypatch, tmp_path):
    monkeypatch.setenv(sources.MIRROR_ENV, f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    assert sources.default_mirrors() == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.delenv(sources.MIRROR_ENV)
    assert sources.default_mirrors(tmp_path / "proj") == [tmp_path / "shared" / "data" / "medmnist",
                                                          tmp_path / "shared" / "data" / "mnist",
                                                          tmp_path / "shared" / "data" / "cifar",
                                                          tmp_path / "shared" / "data" / "multimodal"]


# ----------------------------------------------------------------------------- preprocess


def _process(tmp_path: Path, raw: Path, num_classes=4, n_channels=3, stem="p"):
    arrays, samples = tmp_path / f"{stem}.npz", tmp_path / f"{stem}.samples.parquet"
    table = preprocess(raw, arrays, samples, num_classes=num_classes, n_channels=n_channels)
    return arrays, samples, table


def test_preprocess_outputs(synth, tmp_path):
    raw, _ = synth
    arrays, samples, table = _process(tmp_path, raw)
    with np.load(raw) as z:
        official = {k: z[k] for k in z.files}
    with np.load(arrays) as z:
        images, labels, num_classes = z["images"], z["labels"], int(z["num_classes"])
    n = sum(COUNTS)
    assert images.dtype == np.uint8 and images.shape == (n, 3, 28, 28)
    assert labels.dtype == np.int64 and labels.shape == (n,)
    assert num_classes == 4
    # order train, val, test; NCHW is the official NHWC with channels moved first
    assert np.array_equal(images, np.concatenate([np.moveaxis(official[f"{s}_images"], -1, 1) for s in SPLIT_ORDER]))
    assert np.array_equal(labels, np.concatenate([official[f"{s}_labels"][:, 0] for s in SPLIT_ORDER]))
    # sample table
    validate(SampleTable, table, "t")
    assert table["split"].tolist() == ["train"] * 40 + ["val"] * 8 + ["test"] * 12
    assert table["sample_id"].tolist() == list(range(n))
    assert table["index_in_split"].tolist() == list(range(40)) + list(range(8)) + list(range(12))
    assert np.array_equal(table["label"].to_numpy(), labels)
    pd.testing.assert_frame_equal(pd.read_parquet(samples), table, check_dtype=False)
    # round trip
    data = load_processed(arrays, samples)
    assert np.array_equal(data.images, images) and np.array_equal(data.labels, labels) and data.num_classes == 4
    assert data.split_ids("val").tolist() == list(range(40, 48))
    assert data.split_ids("test").tolist() == list(range(48, 60))


def test_preprocess_greyscale_becomes_single_channel(tmp_path):
    raw = tmp_path / "grey.npz"
    write_synthetic_npz(raw, num_classes=3, n_channels=1, counts=(10, 4, 6))
    with np.load(raw) as z:
        assert z["train_images"].shape == (10, 28, 28)
        train = z["train_images"]
    arrays, samples, _ = _process(tmp_path, raw, num_classes=3, n_channels=1)
    data = load_processed(arrays, samples)
    assert data.images.shape == (20, 1, 28, 28) and data.images.dtype == np.uint8
    assert np.array_equal(data.images[:10, 0], train)


def test_preprocess_channel_count_must_match_metadata(synth, tmp_path):
    raw, _ = synth
    with pytest.raises(DataError, match=r"train_images has 3 channels; the data set's metadata says 1"):
        load_official_npz(raw, 4, 1)


def _official(raw: Path) -> dict[str, np.ndarray]:
    with np.load(raw) as z:
        return {k: z[k] for k in z.files}


def _write(path: Path, arrays: dict) -> Path:
    np.savez(path, **arrays)
    return path


def test_truncated_npz(synth, tmp_path):
    raw, _ = synth
    bad = tmp_path / "trunc.npz"
    data = raw.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"not a readable \.npz") as e:
        load_official_npz(bad, 4, 3)
    assert str(bad) in str(e.value)
    with pytest.raises(DataError, match=str(bad)):
        preprocess(bad, tmp_path / "o.npz", tmp_path / "o.parquet", 4, 3)
    assert not (tmp_path / "o.npz").exists() and not (tmp_path / "o.parquet").exists()
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=str(empty)):
        load_official_npz(empty, 4, 3)


def test_npy_instead_of_npz(tmp_path):
    bad = tmp_path / "arr.npz"
    with open(bad, "wb") as f:
        np.save(f, np.zeros((4, 28, 28), np.uint8))
    with pytest.raises(DataError, match=str(bad)):
        load_official_npz(bad, 4, 3)


def test_missing_keys(synth, tmp_path):
    arrays = _official(synth[0])
    del arrays["val_labels"]
    bad = _write(tmp_path / "missing.npz", arrays)
    with pytest.raises(DataError, match=r"missing arrays \['val_labels'\]") as e:
        load_official_npz(bad, 4, 3)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("key,value,pattern", [
    ("train_images", np.zeros((40, 28), np.uint8), r"train_images has shape \(40, 28\)"),
    ("test_images", np.zeros((12, 28, 28, 2), np.uint8), r"test_images has shape \(12, 28, 28, 2\)"),
    ("train_labels", np.full((40, 1), 4, np.uint8), r"train_labels has labels in \[4, 4\]; expected 0\.\.3"),
    ("val_labels", -np.ones((8, 1), np.int64), r"val_labels has labels in \[-1, -1\]"),
    ("train_labels", np.zeros((39, 1), np.uint8), r"train_labels has 39 labels for 40 images"),
    ("train_labels", np.zeros((40, 2), np.uint8), r"train_labels has shape \(40, 2\).*multi-label"),
    ("val_labels", np.full((8, 1), 0.5), r"val_labels must hold integer class labels"),
    ("val_images", np.zeros((0, 28, 28, 3), np.uint8), r"val_images is empty"),
    ("test_images", np.full((12, 28, 28, 3), 300, np.int32), r"test_images has dtype int32 with values outside"),
    ("test_images", np.zeros((12, 14, 14, 3), np.uint8), r"image shapes differ between splits"),
])
def test_bad_arrays_raise_data_error_naming_the_file(synth, tmp_path, key, value, pattern):
    arrays = _official(synth[0])
    arrays[key] = value
    if key == "val_images" and len(value) == 0:
        arrays["val_labels"] = np.zeros((0, 1), np.uint8)
    bad = _write(tmp_path / "bad.npz", arrays)
    with pytest.raises(DataError, match=pattern) as e:
        load_official_npz(bad, 4, 3)
    assert str(e.value).startswith(str(bad))


def test_nan_images(synth, tmp_path):
    arrays = _official(synth[0])
    x = arrays["train_images"].astype(np.float32)
    x[3, 1, 2, 0] = np.nan
    arrays["train_images"] = x
    bad = _write(tmp_path / "nan.npz", arrays)
    with pytest.raises(DataError, match=r"train_images contains NaN values") as e:
        load_official_npz(bad, 4, 3)
    assert str(bad) in str(e.value)


def test_float_images_with_integer_values_are_accepted(synth, tmp_path):
    arrays = _official(synth[0])
    arrays["train_images"] = arrays["train_images"].astype(np.float64)
    arrays["train_labels"] = arrays["train_labels"].astype(np.float32)
    ok = _write(tmp_path / "float.npz", arrays)
    out = load_official_npz(ok, 4, 3)
    assert out["train"][0].dtype == np.uint8 and out["train"][1].dtype == np.int64
    assert np.array_equal(out["train"][0], np.moveaxis(_official(synth[0])["train_images"], -1, 1))


def test_load_processed_detects_mismatched_sample_table(synth, tmp_path):
    raw, _ = synth
    arrays_a, samples_a, _ = _process(tmp_path, raw, stem="a")
    other = tmp_path / "other.npz"
    write_synthetic_npz(other, counts=(30, 8, 12), seed=5)
    _, samples_b, _ = _process(tmp_path, other, stem="b")
    with pytest.raises(DataError, match=r"sample table does not match") as e:
        load_processed(arrays_a, samples_b)
    assert str(samples_b) in str(e.value) and str(arrays_a) in str(e.value)
    # same length, different labels
    same_len = tmp_path / "same.npz"
    write_synthetic_npz(same_len, counts=COUNTS, seed=9)
    _, samples_c, table_c = _process(tmp_path, same_len, stem="c")
    assert len(table_c) == sum(COUNTS)
    with pytest.raises(DataError, match=r"sample table does not match"):
        load_processed(arrays_a, samples_c)
    # a table that breaks its schema
    broken = pd.read_parquet(samples_a)
    broken.loc[0, "split"] = "holdout"
    bad_samples = tmp_path / "broken.samples.parquet"
    broken.to_parquet(bad_samples, index=False)
    with pytest.raises(TableError, match=r"broken\.samples\.parquet"):
        load_processed(arrays_a, bad_samples)
    # an unreadable array file
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(DataError, match=r"junk\.npz: unreadable processed array file"):
        load_processed(tmp_path / "junk.npz", samples_a)


def test_real_bloodmnist_preprocess(tmp_path):
    raw = BLOOD_DIR / "bloodmnist.npz"
    if not raw.is_file():
        pytest.skip("BloodMNIST mirror not present")
    spec = dataset_spec("bloodmnist")
    parts = load_official_npz(raw, spec.num_classes, spec.n_channels)
    assert {s: len(parts[s][1]) for s in SPLIT_ORDER} == {"train": 11959, "val": 1712, "test": 3421}
    assert parts["train"][0].shape[1:] == (3, 28, 28) and parts["train"][0].dtype == np.uint8
    assert sorted(np.unique(parts["train"][1]).tolist()) == list(range(8))
