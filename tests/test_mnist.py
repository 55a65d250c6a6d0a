"""Tests of the ``mnist`` data set: the Keras ``mnist.npz`` fetched from a mirror with its checksum,
preprocessed to uint8 [N, 1, 28, 28] (train then test, no val), normalised as the pFedKD-WCL
code (``ToTensor()`` then ``Normalize(0.1307, 0.3081)``), and partitioned from the 60,000
training images only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import partition_config
from medpfl.data import sources
from medpfl.data.partition import build_partition
from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.sources import MNIST, DataError, dataset_spec, fetch
from medpfl.fl.data import FederatedData
from medpfl.io import md5sum

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist" / "mnist.npz"


def _keras_file(path: Path, n_train=300, n_test=50, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    np.savez_compressed(path, x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                        y_train=rng.integers(0, 10, n_train).astype(np.uint8),
                        x_test=rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                        y_test=rng.integers(0, 10, n_test).astype(np.uint8))
    return path


def test_spec_and_params():
    spec = dataset_spec("mnist")
    assert spec is MNIST
    assert spec.url == "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
    assert (spec.md5, spec.layout, spec.norm, spec.n_channels, spec.num_classes) == (
        "1645a3b44f673782419eaed6fa02cb86", "keras", (0.1307, 0.3081), 1, 10)
    validate_params({"data": {"datasets": ["mnist"]}})


def test_preprocess_synthetic_keras_layout_and_normalisation(tmp_path):
    raw = _keras_file(tmp_path / "mnist.npz")
    arrays, samples = tmp_path / "p.npz", tmp_path / "p.samples.parquet"
    table = preprocess(raw, arrays, samples, 10, 1, layout="keras", norm=MNIST.norm)
    assert table.groupby("split").size().to_dict() == {"train": 300, "test": 50}
    data = load_processed(arrays, samples)
    assert data.images.shape == (350, 1, 28, 28) and data.images.dtype == np.uint8
    assert data.norm == (0.1307, 0.3081)
    with np.load(raw) as z:
        np.testing.assert_array_equal(data.images[:300, 0], z["x_train"])
        np.testing.assert_array_equal(data.labels[300:], z["y_test"])
    pool = data.samples[data.samples["split"] == "train"]
    cfg = partition_config(scheme="per_client_dirichlet", num_clients=4, alpha=0.5, size_start=20, size_stop=40)
    part = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "m")
    assert part["sample_id"].max() < 300  # only training images
    fd = FederatedData.build(data, part, torch.device("cpu"))
    idx = fd.client_train[0][:7]
    # torchvision: ToTensor() = uint8 / 255 (float32), Normalize = (t - mean) / std
    ref = (torch.as_tensor(data.images[idx.numpy()]).to(torch.float32).div(255) - 0.1307) / 0.3081
    assert torch.equal(fd.x(idx), ref)
    assert fd.in_channels == 1 and fd.global_test.numel() == 50


def test_medmnist_normalisation_unchanged(synthetic_processed):
    """Without a stored norm (MedMNIST) the images keep Normalize(0.5, 0.5): x / 127.5 - 1."""
    assert synthetic_processed.norm is None
    from tests.conftest import make_fed_data

    fd = make_fed_data(synthetic_processed)
    idx = fd.client_train[0][:3]
    assert torch.equal(fd.x(idx), fd.images[idx].to(torch.float32) / 127.5 - 1.0)


def test_fetch_checks_md5_of_a_mirror_file(tmp_path):
    fake = tmp_path / "mirror"
    fake.mkdir()
    _keras_file(fake / "mnist.npz")
    with pytest.raises(DataError, match=r"mirror/mnist\.npz: MD5 mismatch for mnist\.npz: expected "
                                        r"1645a3b44f673782419eaed6fa02cb86 \(or SHA-256 731c5ac6"):
        fetch("mnist", tmp_path / "out.npz", mirrors=[fake], retries=0)
    assert not (tmp_path / "out.npz").exists()


def test_alternative_sha256_accepted(tmp_path, monkeypatch):
    """The network file (Keras' own, other bytes than the mirror's re-pack) passes by SHA-256."""
    import hashlib

    (tmp_path / "m").mkdir()
    f = _keras_file(tmp_path / "m" / "mnist.npz")
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    spec = sources.DatasetSpec(**{**MNIST.__dict__, "alt_sha256": (sha,)})
    monkeypatch.setitem(sources.OTHER_DATASETS, "mnist", spec)
    assert fetch("mnist", tmp_path / "out.npz", mirrors=[tmp_path / "m"]).startswith("mirror")


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not present")
def test_real_mirror_file_through_the_stages(tmp_path, monkeypatch):
    monkeypatch.delenv(sources.MIRROR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # default mirrors are ../shared/data/* beside the project
    raw = tmp_path / "raw" / "mnist.npz"
    where = fetch("mnist", raw, mirrors=[REAL.parent])
    assert where == f"mirror {REAL}" and md5sum(raw) == MNIST.md5
    job = json.dumps({"dataset": "mnist", "custom": {}})
    arrays, samples = tmp_path / "mnist.npz", tmp_path / "mnist.samples.parquet"
    assert main(["preprocess", "--job", job, "--raw", str(raw), "--out", str(arrays), "--samples", str(samples)]) == 0
    data = load_processed(arrays, samples)
    assert data.samples.groupby("split").size().to_dict() == {"train": 60000, "test": 10000}
    assert np.bincount(data.labels[:60000]).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    pool = data.samples[data.samples["split"] == "train"]
    cfg = partition_config(scheme="per_client_dirichlet", num_clients=20, alpha=0.5, top_k=2)
    part = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "m")
    assert part.groupby("client_id").size().tolist() == np.linspace(1165, 3834, 20, dtype=int).tolist()
    assert part["sample_id"].max() < 60000
    # the processed pixels' mean/std under the stored normalisation are ~0/1 on the train pool
    x = (data.images[:60000].astype(np.float32) / 255 - 0.1307) / 0.3081
    assert abs(x.mean()) < 1e-3 and abs(x.std() - 1) < 2e-3
