"""Tests of the ``cifar10`` and ``cifar100`` data sets: the official python archives fetched from a
mirror folder with their MD5 (or a clear error), read without torchvision into uint8
[N, 3, 32, 32] (train 50k then test 10k, no val; CIFAR-100's fine labels; class names from the
meta files), and partitioned from the train split, through the stages' own commands.

The archives here are tiny stand-ins in exactly the official layout (``cifar-10-batches-py/
data_batch_1..5``, ``test_batch``, ``batches.meta``; ``cifar-100-python/train``, ``test``,
``meta``), pickled with bytes keys; their MD5 reaches the download stage through
``sources.OTHER_DATASETS`` (monkeypatched), the hook that ``tests/test_mnist.py`` uses too.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import make_env, planned_jobs, snakemake, tiny_params, write_params, write_synthetic
from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.data import sources
from medpfl.data.preprocess import CIFAR_LAYOUTS, load_cifar_archive, load_processed, preprocess
from medpfl.data.sources import CIFAR10, CIFAR100, DataError, dataset_spec, fetch
from medpfl.io import md5sum

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """No test here reaches the network: urlopen fails at once as offline, and fetch does not
    sleep between attempts."""
    def offline(url, timeout=None):
        raise urllib.error.URLError("offline (tests)")

    monkeypatch.setattr(sources.urllib.request, "urlopen", offline)
    monkeypatch.setattr(sources.time, "sleep", lambda s: None)


def _pickle(obj, protocol: int, py2_numpy: bool) -> bytes:
    data = pickle.dumps(obj, protocol=protocol)
    if py2_numpy:  # the official batches were pickled by Python 2 with numpy 1.x: numpy.core, not numpy._core
        assert protocol == 2
        data = data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    return data


def _add(tf: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644
    tf.addfile(info, io.BytesIO(payload))


def cifar_arrays(num_classes: int, n_train: int, n_test: int, seed: int = 0):
    """Random HWC images and labels: ``(train_hwc uint8 [n, 32, 32, 3], train labels, test_hwc,
    test labels)``, with ``n_train`` / ``n_test`` images per class in random order."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (n_train, n_test):
        y = rng.permutation(np.repeat(np.arange(num_classes), n))
        out += [rng.integers(0, 256, (len(y), 32, 32, 3), dtype=np.uint8), y]
    return tuple(out)


def official_rows(hwc: np.ndarray) -> np.ndarray:
    """HWC images as the archive stores them: uint8 [n, 3072], the R plane (1024 values, row-major),
    then G, then B."""
    return np.ascontiguousarray(hwc.transpose(0, 3, 1, 2).reshape(len(hwc), 3072))


def write_cifar_archive(path: Path, layout: str = "cifar10", n_train: int = 3, n_test: int = 2, seed: int = 0,
                        names: list[str] | None = None, drop: str | None = None, replace: dict | None = None):
    """A tiny archive in the official layout; returns ``(path, arrays from cifar_arrays)``.

    cifar10: the train images in 5 data batches (protocol 2, with Python 2's numpy module
    names, as the official files); cifar100: ``train``/``test`` with ``fine_labels`` and
    (different) ``coarse_labels`` (protocol 4). ``drop``: a member left out; ``replace``:
    ``{member: payload bytes}`` written instead.
    """
    num_classes = 10 if layout == "cifar10" else 100
    arrays = cifar_arrays(num_classes, n_train, n_test, seed)
    tr_x, tr_y, te_x, te_y = arrays
    folder = CIFAR_LAYOUTS[layout]["folder"]
    members: dict[str, bytes] = {}
    if layout == "cifar10":
        for i, (xs, ys) in enumerate(zip(np.array_split(tr_x, 5), np.array_split(tr_y, 5)), start=1):
            members[f"data_batch_{i}"] = _pickle({b"batch_label": f"training batch {i} of 5".encode(),
                                                  b"labels": [int(v) for v in ys], b"data": official_rows(xs),
                                                  b"filenames": [b"x.png"] * len(ys)}, 2, True)
        members["test_batch"] = _pickle({b"batch_label": b"testing batch 1 of 1", b"labels": [int(v) for v in te_y],
                                         b"data": official_rows(te_x), b"filenames": [b"x.png"] * len(te_y)}, 2, True)
        members["batches.meta"] = _pickle({b"num_cases_per_batch": 10000, b"num_vis": 3072,
                                           b"label_names": [n.encode() for n in names or CIFAR10_NAMES]}, 2, True)
    else:
        for split, xs, ys in (("train", tr_x, tr_y), ("test", te_x, te_y)):
            members[split] = _pickle({b"filenames": [b"x.png"] * len(ys), b"batch_label": split.encode(),
                                      b"fine_labels": [int(v) for v in ys], b"coarse_labels": [int(v) // 5 for v in ys],
                                      b"data": official_rows(xs)}, 4, False)
        fine = names or [f"fine{c:02d}" for c in range(100)]
        members["meta"] = _pickle({b"fine_label_names": [n.encode() for n in fine],
                                   b"coarse_label_names": [f"coarse{c}".encode() for c in range(20)]}, 4, False)
    members.update(replace or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name, payload in members.items():
            if name != drop:
                _add(tf, f"{folder}/{name}", payload)
    return path, arrays


def _tiny_spec(monkeypatch, spec, archive: Path):
    """Replace the official spec by one whose MD5 is the tiny archive's (the same URL and names)."""
    tiny = dataclasses.replace(spec, md5=md5sum(archive))
    monkeypatch.setitem(sources.OTHER_DATASETS, spec.name, tiny)
    return tiny


# ----------------------------------------------------------------------------- specs and download


def test_specs_are_the_official_releases():
    for name, spec, url, md5, n in (
            ("cifar10", CIFAR10, "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
             "c58f30108f718f92721af3b95e74349a", 10),
            ("cifar100", CIFAR100, "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
             "eb9058c3a382ffc7106e4002c42a8d85", 100)):
        s = dataset_spec(name)
        assert s is spec
        assert (s.url, s.md5, s.num_classes, s.n_channels, s.layout, s.norm) == (url, md5, n, 3, name, None)
        assert s.filename == url.rsplit("/", 1)[1] and s.raw_filename == f"{name}.tar.gz"
    assert dataset_spec("bloodmnist").raw_filename == "bloodmnist.npz" == dataset_spec("bloodmnist").filename
    p = validate_params({"data": {"datasets": ["cifar10", "cifar100"]}})
    assert p.data.datasets == ["cifar10", "cifar100"]


def test_fetch_from_a_mirror_folder_checks_the_md5(tmp_path, monkeypatch):
    archive, _ = write_cifar_archive(tmp_path / "mirror" / "cifar-10-python.tar.gz")
    _tiny_spec(monkeypatch, CIFAR10, archive)
    out = tmp_path / "data" / "raw" / "cifar10.tar.gz"
    where = fetch("cifar10", out, mirrors=[tmp_path / "empty", tmp_path / "mirror"])
    assert where == f"mirror {archive}"
    assert out.read_bytes() == archive.read_bytes()
    assert fetch("cifar10", out, mirrors=[]) == f"existing {out}"  # a verified copy is kept


def test_default_mirror_folder_is_shared_data_cifar(tmp_path, monkeypatch):
    monkeypatch.delenv(sources.MIRROR_ENV, raising=False)
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    assert tmp_path / "shared" / "data" / "cifar" in sources.default_mirrors()
    archive, _ = write_cifar_archive(tmp_path / "shared" / "data" / "cifar" / "cifar-100-python.tar.gz",
                                     layout="cifar100", n_train=1, n_test=1)
    _tiny_spec(monkeypatch, CIFAR100, archive)
    assert fetch("cifar100", project / "raw.tar.gz") == f"mirror {archive}"


def test_checksum_mismatch_names_the_file_and_the_expected_md5(tmp_path):
    write_cifar_archive(tmp_path / "mirror" / "cifar-10-python.tar.gz")  # not the official bytes
    out = tmp_path / "cifar10.tar.gz"
    with pytest.raises(DataError) as e:
        fetch("cifar10", out, mirrors=[tmp_path / "mirror"])
    msg = str(e.value)
    assert str(tmp_path / "mirror" / "cifar-10-python.tar.gz") in msg
    assert "MD5 mismatch for cifar-10-python.tar.gz: expected c58f30108f718f92721af3b95e74349a" in msg
    assert "https://www.cs.toronto.edu/~kriz/cifar.html" in msg and not out.exists()


@pytest.mark.parametrize("name,file", [("cifar10", "cifar-10-python.tar.gz"), ("cifar100", "cifar-100-python.tar.gz")])
def test_offline_without_a_mirror_says_where_to_put_the_file(tmp_path, name, file):
    out = tmp_path / "data" / "raw" / f"{name}.tar.gz"
    with pytest.raises(DataError) as e:
        fetch(name, out, mirrors=[tmp_path / "empty"], retries=2)
    msg = str(e.value)
    for part in (file, f"https://www.cs.toronto.edu/~kriz/{file}", str(tmp_path / "empty"), "MEDPFL_DATA_MIRROR",
                 str(out), dataset_spec(name).md5, "offline (tests)"):
        assert part in msg, part
    assert not out.exists()


# ----------------------------------------------------------------------------- preprocess


def test_cifar10_archive_to_processed_arrays(tmp_path):
    raw, (tr_x, tr_y, te_x, te_y) = write_cifar_archive(tmp_path / "cifar10.tar.gz", n_train=3, n_test=2)
    arrays, samples = tmp_path / "p.npz", tmp_path / "p.samples.parquet"
    table = preprocess(raw, arrays, samples, 10, 3, layout="cifar10")
    assert table.groupby("split").size().to_dict() == {"train": 30, "test": 20}  # official splits, no val
    data = load_processed(arrays, samples)
    assert data.images.dtype == np.uint8 and data.images.shape == (50, 3, 32, 32)  # NCHW as bloodmnist
    assert data.norm is None  # the project's default Normalize(0.5, 0.5) on every channel
    # train = data_batch_1..5 in order, then test_batch; channel c at (h, w) is the HWC image's [h, w, c]
    np.testing.assert_array_equal(data.images[:30], tr_x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(data.images[30:], te_x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(data.labels, np.concatenate([tr_y, te_y]))
    assert data.labels.dtype == np.int64 and data.class_names == tuple(CIFAR10_NAMES)
    assert table["sample_id"].tolist() == list(range(50))
    assert table.loc[table["split"] == "test", "index_in_split"].tolist() == list(range(20))


def test_the_official_row_layout_is_r_then_g_then_b_planes(tmp_path):
    """One hand-made image: value 1 at row entry 1 (red, y 0, x 1), 2 at 1024 + 32 (green, y 1,
    x 0), 3 at 2048 + 1023 (blue, y 31, x 31)."""
    row = np.zeros((1, 3072), dtype=np.uint8)
    row[0, 1], row[0, 1024 + 32], row[0, 2048 + 1023] = 1, 2, 3
    batch = lambda: pickle.dumps({b"labels": [0], b"data": row}, protocol=2)  # noqa: E731
    members = {f"data_batch_{i}": batch() for i in range(1, 6)} | {"test_batch": batch()}
    raw, _ = write_cifar_archive(tmp_path / "c.tar.gz", replace=members)
    parts, _ = load_cifar_archive(raw, 10, "cifar10")
    img = parts["train"][0][0]
    assert (img[0, 0, 1], img[1, 1, 0], img[2, 31, 31]) == (1, 2, 3) and img.sum() == 6


def test_cifar100_uses_the_fine_labels_and_names(tmp_path):
    names = [f"name{c}" for c in range(100)]
    raw, (_, tr_y, _, te_y) = write_cifar_archive(tmp_path / "c100.tar.gz", layout="cifar100", n_train=2,
                                                 n_test=1, names=names)
    arrays, samples = tmp_path / "p.npz", tmp_path / "p.samples.parquet"
    preprocess(raw, arrays, samples, 100, 3, layout="cifar100")
    data = load_processed(arrays, samples)
    assert data.images.shape == (300, 3, 32, 32) and data.num_classes == 100
    np.testing.assert_array_equal(data.labels, np.concatenate([tr_y, te_y]))  # fine, not coarse (y // 5)
    assert data.class_names == tuple(names)


def test_preprocess_is_byte_reproducible(tmp_path):
    raw, _ = write_cifar_archive(tmp_path / "c.tar.gz")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        preprocess(raw, tmp_path / d / "p.npz", tmp_path / d / "s.parquet", 10, 3, layout="cifar10")
    for f in ("p.npz", "s.parquet"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize("kind,pattern", [
    ("not_gzip", r"c\.tar\.gz: not a readable \.tar\.gz archive"),
    ("missing", r"c\.tar\.gz: missing cifar-10-batches-py/data_batch_3; expected the official CIFAR"),
    ("garbage", r"c\.tar\.gz: cifar-10-batches-py/test_batch is not a readable CIFAR batch pickle"),
    ("global", r"test_batch is not a readable CIFAR batch pickle \(refusing to load (__builtin__|builtins)\.print"),
    ("shape", r"cifar-10-batches-py/test_batch b'data' is uint8 \(2, 1024\); expected uint8 \(n, 3072\)"),
    ("dtype", r"cifar-10-batches-py/test_batch b'data' is float32 \(1, 3072\)"),
    ("key", r"cifar-10-batches-py/test_batch has no b'labels' entry"),
    ("label", r"cifar-10-batches-py/test_batch b'labels' has labels in \[10, 10\]; expected 0\.\.9"),
    ("count", r"test_batch b'labels' has 3 labels for 1 images"),
    ("names", r"cifar-10-batches-py/batches\.meta has 9 b'label_names' entries; expected 10"),
])
def test_bad_archives_raise_data_error_naming_the_file(tmp_path, kind, pattern):
    raw = tmp_path / "c.tar.gz"
    ok = np.zeros((1, 3072), dtype=np.uint8)
    bad = {
        "garbage": b"\x80\x02not a pickle",
        "global": pickle.dumps({b"labels": [0], b"data": ok, b"x": _Evil()}, protocol=2),
        "shape": pickle.dumps({b"labels": [0, 1], b"data": np.zeros((2, 1024), np.uint8)}, protocol=2),
        "dtype": pickle.dumps({b"labels": [0], b"data": ok.astype(np.float32)}, protocol=2),
        "key": pickle.dumps({b"data": ok}, protocol=2),
        "label": pickle.dumps({b"labels": [10], b"data": ok}, protocol=2),
        "count": pickle.dumps({b"labels": [0, 1, 2], b"data": ok}, protocol=2),
    }
    if kind == "not_gzip":
        raw.write_bytes(b"<html>a proxy's error page</html>")
    elif kind == "missing":
        write_cifar_archive(raw, drop="data_batch_3")
    elif kind == "names":
        write_cifar_archive(raw, names=CIFAR10_NAMES[:9])
    else:
        write_cifar_archive(raw, replace={"test_batch": bad[kind]})
    with pytest.raises(DataError, match=pattern):
        preprocess(raw, tmp_path / "p.npz", tmp_path / "s.parquet", 10, 3, layout="cifar10")
    assert not (tmp_path / "p.npz").exists()


def test_truncated_archive(tmp_path):
    raw, _ = write_cifar_archive(tmp_path / "c.tar.gz", n_train=20)
    raw.write_bytes(raw.read_bytes()[: raw.stat().st_size // 2])
    with pytest.raises(DataError, match=r"c\.tar\.gz: .*(truncated|not a readable)"):
        load_cifar_archive(raw, 10, "cifar10")


# ----------------------------------------------------------------------------- the stages


def test_download_preprocess_partition_commands(tmp_path, monkeypatch):
    """The stages' commands on a tiny CIFAR-10 archive in a mirror folder: the raw copy is the
    archive (MD5-checked), the processed set has the official splits, and a shards partition
    with official-test local splits takes its pool from train and its local tests from test."""
    archive, _ = write_cifar_archive(tmp_path / "mirror" / "cifar-10-python.tar.gz", n_train=10, n_test=4)
    _tiny_spec(monkeypatch, CIFAR10, archive)
    monkeypatch.setenv(sources.MIRROR_ENV, str(tmp_path / "mirror"))
    job = json.dumps({"dataset": "cifar10", "custom": {}})
    raw = tmp_path / "data" / "raw" / "cifar10.tar.gz"
    assert main(["download", "--job", job, "--out", str(raw)]) == 0
    assert md5sum(raw) == md5sum(archive)
    arrays, samples = tmp_path / "data" / "processed" / "cifar10.npz", tmp_path / "data" / "processed" / "c.parquet"
    arrays.parent.mkdir(parents=True)
    assert main(["preprocess", "--job", job, "--raw", str(raw), "--out", str(arrays), "--samples", str(samples)]) == 0
    data = load_processed(arrays, samples)
    assert data.samples.groupby("split").size().to_dict() == {"train": 100, "test": 40}
    cfg = {"scheme": "shards", "num_clients": 5, "shards_per_client": 2, "min_samples": 1, "seed": 4,
           "local_test": {"rule": "official_test"}}
    pjob = json.dumps({"dataset": "cifar10", "name": "sh", "config": cfg})
    out = tmp_path / "part"
    assert main(["partition", "--job", pjob, "--arrays", str(arrays), "--samples", str(samples),
                 "--out-dir", str(out)]) == 0
    part = pd.read_parquet(out / "partition.parquet")
    split_of = data.samples.set_index("sample_id")["split"]
    assert (split_of[part.loc[part["local_split"] == "train", "sample_id"]] == "train").all()
    assert (split_of[part.loc[part["local_split"] == "test", "sample_id"]] == "test").all()
    assert len(part[part["local_split"] == "train"]) == 100
    assert sorted(part.loc[part["local_split"] == "test", "sample_id"]) == list(range(100, 140))  # the whole test set
    assert part[part["local_split"] == "train"].groupby("client_id")["label"].nunique().max() <= 2
    stats = json.loads((out / "client_stats.json").read_text())
    assert stats["class_names"] == CIFAR10_NAMES and stats["config"] == cfg
    for c in stats["clients"].values():  # each client's test classes are its train classes
        assert {i for i, n in enumerate(c["test"]) if n} <= {i for i, n in enumerate(c["train"]) if n}


def test_offline_download_command_fails_with_the_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(sources.MIRROR_ENV, str(tmp_path / "nothing-here"))
    job = json.dumps({"dataset": "cifar100", "custom": {}})
    assert main(["download", "--job", job, "--out", str(tmp_path / "cifar100.tar.gz")]) == 2
    err = capsys.readouterr().err
    assert "cifar-100-python.tar.gz" in err and "MEDPFL_DATA_MIRROR" in err


@pytest.mark.slow
def test_snakemake_routes_cifar_through_a_tar_gz_raw_file(tmp_path):
    """The DAG: cifar10's raw file is data/raw/cifar10.tar.gz (download wildcard ext=tar.gz), the
    MedMNIST-layout set's stays .npz, and preprocess reads each."""
    work = tmp_path / "w"
    work.mkdir()
    synth = write_synthetic(tmp_path / "input" / "synth.npz")
    params = tiny_params(synth)
    params["data"]["datasets"] = ["synth", "cifar10"]
    write_params(work, params)
    dry = snakemake(work, "data_all", "--dry-run", env=make_env(work)).stdout
    downloads = sorted((w["dataset"], w["ext"]) for r, w in planned_jobs(dry) if r == "download")
    assert downloads == [("cifar10", "tar.gz"), ("synth", "npz")]
    assert "data/raw/cifar10.tar.gz" in dry and "data/raw/cifar10.npz" not in dry
