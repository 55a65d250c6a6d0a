"""MedMNIST 3D (``organmnist3d``, ``organmnist3d_64`` and the other 3D flags): the official URL
and MD5 from ``medmnist.INFO``, the official layout (``{split}_images`` uint8 [N, D, H, W], no
channel axis) preprocessed into [N, C=D, H, W] without moving a value, custom 3D files, and a
tiny organmnist3d-like file through the stages' commands (download from a mirror, preprocess,
partition, two training rounds of ``resnet18_3d`` and of ``resnet18`` on the slices)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import train_job
from medpfl.data.sources import dataset_job
from medpfl.data import sources
from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.sources import DataError, dataset_spec, fetch, medmnist_info
from medpfl.io import md5sum, read_json, write_npz

FLAGS_3D = ("organmnist3d", "nodulemnist3d", "adrenalmnist3d", "fracturemnist3d", "vesselmnist3d", "synapsemnist3d")
COUNTS = {"train": 30, "val": 6, "test": 12}


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    def refuse(*a, **k):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(sources.urllib.request, "urlopen", refuse)


def write_volumes(path: Path, num_classes: int = 3, depth: int = 8, counts: dict = COUNTS, seed: int = 0) -> dict:
    """A tiny data set in the official MedMNIST 3D layout: ``{split}_images`` uint8 [n, D, D, D]
    (a blocky class pattern plus noise), ``{split}_labels`` uint8 [n, 1]. Returns the arrays."""
    g = np.random.default_rng(seed)
    protos = g.uniform(40, 215, size=(num_classes, 2, 2, 2))
    half = -(-depth // 2)
    protos = protos.repeat(half, 1).repeat(half, 2).repeat(half, 3)[:, :depth, :depth, :depth]
    arrays = {}
    for split, n in counts.items():
        y = np.arange(n) % num_classes  # every class in every split
        x = np.clip(np.round(protos[y] + g.normal(0, 25, size=(n, depth, depth, depth))), 0, 255).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = x, y.astype(np.uint8)[:, None]
    write_npz(path, arrays, compress=True)
    return arrays


# ----------------------------------------------------------------------------- names and specs


@pytest.mark.parametrize("flag", FLAGS_3D)
def test_3d_flags_are_the_official_files(flag):
    info = medmnist_info()[0][flag]
    for name, key, size in ((flag, "", 28), (f"{flag}_64", "_64", 64)):
        spec = dataset_spec(name)
        assert (spec.url, spec.md5, spec.size) == (info[f"url{key}"], info[f"MD5{key}"], size)
        assert spec.layout == "medmnist3d" and spec.n_channels == size  # the depth: slices are channels
        assert spec.num_classes == len(info["label"]) and spec.filename == f"{name}.npz"
    with pytest.raises(DataError, match=rf"has no 128-px file for {flag}"):
        dataset_spec(f"{flag}_128")


def test_organmnist3d_64_spec():
    spec = dataset_spec("organmnist3d_64")
    assert spec.url == "https://zenodo.org/records/10519652/files/organmnist3d_64.npz?download=1"
    assert spec.md5 == "58a2205adf14a9d0a189cb06dc78bf10"
    assert spec.num_classes == 11 and spec.class_names[:3] == ("liver", "kidney-right", "kidney-left")
    assert dataset_spec("bloodmnist_64").layout == "medmnist" and dataset_spec("bloodmnist_64").n_channels == 3


def test_unknown_flag_lists_the_3d_flags_too():
    with pytest.raises(DataError, match=r"known 2D flags: .*bloodmnist.*; 3D flags: .*organmnist3d"):
        dataset_spec("organmnist4d")


# ----------------------------------------------------------------------------- preprocess


def test_volumes_are_stored_as_depth_slices(tmp_path):
    """[N, D, H, W] as in the file, splits in the order train, val, test: the depth axis is the
    stored sample's channel axis; uint8 values untouched; byte-reproducible."""
    arrays = write_volumes(tmp_path / "v.npz", depth=8)
    samples = preprocess(tmp_path / "v.npz", tmp_path / "a.npz", tmp_path / "s.parquet", 3, 8, layout="medmnist3d",
                         class_names=("a", "b", "c"))
    data = load_processed(tmp_path / "a.npz", tmp_path / "s.parquet")
    want = np.concatenate([arrays[f"{s}_images"] for s in ("train", "val", "test")])
    assert data.images.dtype == np.uint8 and data.images.shape == (48, 8, 8, 8)
    np.testing.assert_array_equal(data.images, want)
    np.testing.assert_array_equal(data.labels, np.concatenate([arrays[f"{s}_labels"][:, 0] for s in COUNTS]))
    assert samples.groupby("split").size().to_dict() == {"train": 30, "val": 6, "test": 12}
    assert data.norm is None and data.class_names == ("a", "b", "c")
    preprocess(tmp_path / "v.npz", tmp_path / "b.npz", tmp_path / "t.parquet", 3, 8, layout="medmnist3d",
               class_names=("a", "b", "c"))
    assert md5sum(tmp_path / "a.npz") == md5sum(tmp_path / "b.npz")


def test_wrong_shapes_name_the_file(tmp_path):
    write_volumes(tmp_path / "v.npz", depth=8)
    with pytest.raises(DataError, match=r"v\.npz: train_images has volumes of depth 8; .*says 28"):
        preprocess(tmp_path / "v.npz", tmp_path / "a.npz", tmp_path / "s.parquet", 3, 28, layout="medmnist3d")
    with pytest.raises(DataError, match=r"v\.npz: train_images has shape \(30, 8, 8, 8\); expected \(N, H, W\)"):
        preprocess(tmp_path / "v.npz", tmp_path / "a.npz", tmp_path / "s.parquet", 3, 8)  # read as 2D
    flat = {f"{s}_{k}": v[..., 0] if k == "images" else v
            for s in COUNTS for k, v in (("images", np.zeros((4, 8, 8, 1), np.uint8)),
                                         ("labels", np.zeros((4, 1), np.uint8)))}
    write_npz(tmp_path / "flat.npz", flat)
    with pytest.raises(DataError, match=r"flat\.npz: train_images has shape \(4, 8, 8\); expected 3D volumes"):
        preprocess(tmp_path / "flat.npz", tmp_path / "a.npz", tmp_path / "s.parquet", 2, 8, layout="medmnist3d")


def test_custom_3d_data_set(tmp_path):
    """``data.custom.<name>.layout: medmnist3d`` (n_channels = the depth); a 2D custom entry's
    data job is what it was before the key existed."""
    write_volumes(tmp_path / "vol.npz", depth=8)
    entry = {"path": str(tmp_path / "vol.npz"), "md5": md5sum(tmp_path / "vol.npz"), "n_channels": 8,
             "num_classes": 3}
    params = validate_params({"data": {"datasets": ["vol", "img"], "custom": {
        "vol": {**entry, "layout": "medmnist3d"}, "img": {**entry, "n_channels": 3}}}})
    assert dataset_job(params, "vol")["custom"]["vol"]["layout"] == "medmnist3d"
    assert dataset_job(params, "img")["custom"]["img"] == {**entry, "n_channels": 3}  # no layout key
    job = dataset_job(params, "vol")
    spec = dataset_spec("vol", job["custom"])
    assert spec.layout == "medmnist3d" and spec.n_channels == 8
    out = tmp_path / "raw" / "vol.npz"
    assert fetch("vol", out, mirrors=[tmp_path], retries=1, custom=job["custom"]) == f"mirror {tmp_path / 'vol.npz'}"
    preprocess(out, tmp_path / "a.npz", tmp_path / "s.parquet", spec.num_classes, spec.n_channels, layout=spec.layout)
    assert load_processed(tmp_path / "a.npz", tmp_path / "s.parquet").images.shape == (48, 8, 8, 8)
    with pytest.raises(Exception, match=r"layout"):
        validate_params({"data": {"datasets": ["vol"], "custom": {"vol": {**entry, "layout": "nifti"}}}})


# ----------------------------------------------------------------------------- the stages' commands


def _tiny_organmnist3d(monkeypatch, mirror: Path) -> None:
    """A 28^3 organmnist3d-like file in ``mirror``, and medmnist.INFO with its MD5 in place of the
    release's (the same URL, name and labels)."""
    mirror.mkdir(parents=True)
    write_volumes(mirror / "organmnist3d.npz", num_classes=11, depth=28,
                  counts={"train": 44, "val": 11, "test": 22})
    info, version = medmnist_info()
    patched = {**info, "organmnist3d": {**info["organmnist3d"], "MD5": md5sum(mirror / "organmnist3d.npz")}}
    monkeypatch.setattr(sources, "medmnist_info", lambda: (patched, version))
    monkeypatch.setenv(sources.MIRROR_ENV, str(mirror))


def test_organmnist3d_download_preprocess_partition_and_two_rounds(tmp_path, monkeypatch):
    """organmnist3d through the commands the Snakemake rules run: the mirror copy is MD5-checked,
    the volumes are stored as [N, 28, 28, 28], the partition pools every split (FedMIC's 7:2:1 per
    client), and resnet18_3d (volumes) and resnet18 (the 28 slices as channels) train two rounds."""
    _tiny_organmnist3d(monkeypatch, tmp_path / "mirror")
    params = validate_params({
        "data": {"datasets": ["organmnist3d"]},
        "partitions": {"p": {"num_clients": 3, "alpha": 1.0, "min_samples": 5, "pool": "all",
                             "local_test": {"rule": "ratios", "ratios": [0.7, 0.2, 0.1]}}},
        "methods": ["fedavg", "fedavg-2d"],
        "method_params": {"fedavg-2d": {"algorithm": "fedavg", "train": {"model": "resnet18",
                                                                          "model_args": {"width": 2}}}},
        "train": {"model": "resnet18_3d", "model_args": {"width": 2}, "rounds": 2, "participation": 0.67,
                  "local_epochs": 1, "batch_size": 16, "executor": "sequential", "device": "cpu",
                  "checkpoint_every": 0},
        "eval": {"every": 1, "batch_size": 64},
    })
    job = json.dumps(dataset_job(params, "organmnist3d"))
    raw = tmp_path / "data" / "raw" / "organmnist3d.npz"
    assert main(["download", "--job", job, "--out", str(raw)]) == 0
    assert md5sum(raw) == md5sum(tmp_path / "mirror" / "organmnist3d.npz")
    arrays, samples = tmp_path / "data" / "processed" / "organmnist3d.npz", tmp_path / "data" / "processed" / "s.parquet"
    arrays.parent.mkdir(parents=True)
    assert main(["preprocess", "--job", job, "--raw", str(raw), "--out", str(arrays), "--samples", str(samples)]) == 0
    data = load_processed(arrays, samples)
    assert data.images.shape == (77, 28, 28, 28) and data.class_names[0] == "liver"
    pjob = json.dumps({"dataset": "organmnist3d", "name": "p", "config": params.partitions["p"].job_dict()})
    part = tmp_path / "part"
    assert main(["partition", "--job", pjob, "--arrays", str(arrays), "--samples", str(samples),
                 "--out-dir", str(part)]) == 0
    table = pd.read_parquet(part / "partition.parquet")
    assert len(table) == 77 and set(table["local_split"]) == {"train", "val", "test"}
    for method, conv1 in (("fedavg", [2, 1, 3, 3, 3]), ("fedavg-2d", [2, 28, 3, 3])):
        out = tmp_path / "runs" / method
        tjob = json.dumps(train_job(params, "organmnist3d", "p", method, 1))
        assert main(["train", "--job", tjob, "--arrays", str(arrays), "--samples", str(samples),
                     "--partition-table", str(part / "partition.parquet"), "--out-dir", str(out)]) == 0
        rounds = pd.read_parquet(out / "rounds.parquet")
        assert rounds["round"].tolist() == [0, 1] and rounds["bytes_up"].gt(0).all()
        records = pd.read_parquet(out / "records.parquet")
        assert records["accuracy"].between(0, 1).all()
        assert read_json(out / "job.json")["model_size"]
        final = torch.load(out / "final_model.pt", weights_only=False)
        assert list(final["global"]["conv1.weight"].shape) == conv1
