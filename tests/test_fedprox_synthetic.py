"""Tests of Synthetic(alpha, beta) (spec A.3.2; HengruiH/pFedKD ``utils/synthetic.py``): the
generator's formula and shapes, alpha/beta as standard deviations, seeds, and the data set
``synthetic_<alpha>_<beta>`` through download (generation), preprocess and the ``natural``
partition."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import partition_config
from medpfl.data.sources import dataset_job
from medpfl.data.fedprox_synthetic import SyntheticArgs, client_sizes, generate, write_fedprox_synthetic
from medpfl.data.partition import PartitionError, build_partition
from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.sources import DataError, dataset_spec, fetch
from medpfl.io import md5sum, read_parquet


@pytest.fixture(scope="module")
def small():
    return generate(0.5, 0.5, num_clients=20, seed=3)


def test_shapes_classes_and_sizes_follow_the_formula(small):
    rng = np.random.RandomState(3)
    expected = (rng.lognormal(4, 2, 20).astype(int) + 50) * 5
    np.testing.assert_array_equal(small.sizes, expected)
    np.testing.assert_array_equal(np.bincount(small.client_id), expected)
    assert small.features.shape == (expected.sum(), 60)
    assert small.labels.min() >= 0 and small.labels.max() <= 9
    assert len(np.unique(small.labels)) == 10
    assert (small.sizes % 5 == 0).all() and small.sizes.min() >= 250


def test_defaults_are_the_papers_setting():
    g = generate(0.5, 0.5)
    assert len(g.sizes) == 100 and g.features.shape[1] == 60 and len(np.unique(g.labels)) == 10
    assert SyntheticArgs(0.5, 0.5) == SyntheticArgs(0.5, 0.5, 100, 60, 10, 0, 0.75)


def test_local_split_is_the_first_75_percent_of_each_client(small):
    for k, n_k in enumerate(small.sizes):
        s = small.local_split[small.client_id == k]
        np.testing.assert_array_equal(s, (np.arange(n_k) >= int(0.75 * n_k)).astype(np.uint8))
    # rows are grouped by client
    assert (np.diff(small.client_id) >= 0).all()


def test_labels_are_the_argmax_of_the_clients_own_model():
    """Reproduce client 0's W, b and samples from the documented order of draws."""
    k, d, c = 4, 6, 3
    g = generate(1.0, 0.3, num_clients=k, dimension=d, num_classes=c, seed=9)
    rng = np.random.RandomState(9)
    sizes = client_sizes(rng, k)
    u = rng.normal(0, 1.0, k)
    rng.normal(0, 0.3, k)
    [rng.normal(0, 1, d) for _ in range(k)]  # v_k (means checked via the data below)
    w = rng.normal(u[0], 1, (d, c))
    b = rng.normal(u[0], 1, c)
    x0 = g.features[g.client_id == 0]
    assert len(x0) == sizes[0]
    np.testing.assert_array_equal(g.labels[g.client_id == 0], np.argmax(x0 @ w + b, axis=1))


def test_covariance_is_diag_j_to_the_minus_1_2():
    # one client with many samples: pick a seed giving a big client
    seed = next(s for s in range(200) if client_sizes(np.random.RandomState(s), 1)[0] >= 5000)
    g = generate(0.0, 0.0, num_clients=1, dimension=5, seed=seed)
    var = g.features.var(axis=0)
    np.testing.assert_allclose(var, np.arange(1, 6) ** -1.2, rtol=0.1)


def test_alpha_and_beta_are_standard_deviations():
    """u_k ~ N(0, alpha) and B_k ~ N(0, beta): empirical std over many clients ~ alpha, beta
    (a variance reading would give sqrt(alpha) = 1.41 for alpha = 2)."""
    g = generate(2.0, 0.25, num_clients=4000, dimension=2, num_classes=2, seed=1)
    assert abs(g.u.std() - 2.0) < 0.1
    assert abs(g.b_mean.std() - 0.25) < 0.02
    g0 = generate(0.0, 0.0, num_clients=50, dimension=2, num_classes=2, seed=1)
    assert (g0.u == 0).all() and (g0.b_mean == 0).all()


def test_seed_reproducibility_and_file_bytes(tmp_path):
    a = write_fedprox_synthetic(tmp_path / "a.npz", SyntheticArgs(0.5, 0.5, num_clients=10, seed=2))
    b = write_fedprox_synthetic(tmp_path / "b.npz", SyntheticArgs(0.5, 0.5, num_clients=10, seed=2))
    c = write_fedprox_synthetic(tmp_path / "c.npz", SyntheticArgs(0.5, 0.5, num_clients=10, seed=3))
    assert a == b != c
    with np.load(tmp_path / "a.npz") as z:
        assert z["features"].dtype == np.float32
        assert json.loads(str(z["params"]))["seed"] == 2


@pytest.mark.parametrize("kw, pattern", [
    (dict(alpha=-1.0, beta=0.5), "standard deviations"),
    (dict(alpha=0.5, beta=0.5, train_fraction=1.0), "train_fraction"),
    (dict(alpha=0.5, beta=0.5, num_classes=1), "num_classes"),
])
def test_generator_errors(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        generate(**kw)


# ----------------------------------------------------------------------------- through the stages


def test_name_params_and_spec():
    p = validate_params({"data": {"datasets": ["synthetic_0.5_0.5"],
                                  "synthetic": {"synthetic_0.5_0.5": {"num_clients": 30, "seed": 4}}},
                         "partitions": [{"name": "nat", "scheme": "natural", "num_clients": 30}]})
    job = dataset_job(p, "synthetic_0.5_0.5")
    assert job["synthetic"] == {"num_clients": 30, "dimension": 60, "num_classes": 10, "seed": 4,
                                "train_fraction": 0.75}
    spec = dataset_spec("synthetic_0.5_0.5", synthetic=job["synthetic"])
    assert (spec.layout, spec.n_channels, spec.num_classes) == ("synthetic", 60, 10)
    assert spec.generator["alpha"] == 0.5 and spec.generator["num_clients"] == 30
    # a MedMNIST data set's job is unchanged (no synthetic key)
    assert "synthetic" not in dataset_job(validate_params({}), "bloodmnist")


@pytest.mark.parametrize("data, pattern", [
    ({"datasets": ["synthetic_0.5"]}, r"synthetic_<alpha>_<beta>"),
    ({"datasets": ["synthetic_a_b"]}, r"synthetic_<alpha>_<beta>"),
    ({"datasets": ["synthetic_1_1"], "synthetic": {"synthetic_x": {}}}, r"synthetic\.synthetic_x: not a synthetic"),
    ({"datasets": ["synthetic_1_1"], "synthetic": {"synthetic_1_1": {"num_clients": 0}}},
     r"data\.synthetic\.synthetic_1_1\.num_clients"),
])
def test_bad_names_and_keys(data, pattern):
    with pytest.raises(Exception, match=pattern):
        validate_params({"data": data})


def test_download_preprocess_natural_partition(tmp_path):
    gen = {"num_clients": 8, "dimension": 60, "num_classes": 10, "seed": 1, "train_fraction": 0.75}
    raw = tmp_path / "raw" / "synthetic_0.5_0.5.npz"
    where = fetch("synthetic_0.5_0.5", raw, mirrors=[], synthetic=gen)
    assert where.startswith("generated")
    first = md5sum(raw)
    fetch("synthetic_0.5_0.5", raw, mirrors=[], synthetic=gen)
    assert md5sum(raw) == first

    spec = dataset_spec("synthetic_0.5_0.5", synthetic=gen)
    arrays, samples = tmp_path / "p.npz", tmp_path / "p.samples.parquet"
    preprocess(raw, arrays, samples, spec.num_classes, spec.n_channels, layout=spec.layout)
    data = load_processed(arrays, samples)
    assert data.images.dtype == np.float32 and data.images.shape[1] == 60 and data.norm is None
    assert set(data.samples["split"]) == {"train"}
    g = generate(0.5, 0.5, num_clients=8, seed=1)
    np.testing.assert_array_equal(data.images, g.features.astype(np.float32))

    pool = data.samples
    cfg = partition_config(scheme="natural", num_clients=8)
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "nat",
                            natural=(pool["natural_client"].to_numpy(), pool["natural_split"].to_numpy()))
    sizes = table.groupby("client_id").size().to_numpy()
    np.testing.assert_array_equal(sizes, g.sizes)
    for k, n_k in enumerate(g.sizes):
        assert ((table["client_id"] == k) & (table["local_split"] == "train")).sum() == int(0.75 * n_k)

    from medpfl.fl.data import FederatedData

    fd = FederatedData.build(data, table, torch.device("cpu"))
    x = fd.x(fd.client_train[0][:5])
    assert x.dtype == torch.float32 and x.shape == (5, 60)
    torch.testing.assert_close(x, torch.as_tensor(data.images[fd.client_train[0][:5].numpy()]))

    with pytest.raises(PartitionError, match=r"partitions\.nat\.num_clients=5, but the data set has 8 natural"):
        build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                        partition_config(scheme="natural", num_clients=5), "nat",
                        natural=(pool["natural_client"].to_numpy(), pool["natural_split"].to_numpy()))
    with pytest.raises(PartitionError, match=r"partitions\.nat\.scheme=natural: the data set has no natural"):
        build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "nat")


def test_cli_stages(tmp_path):
    job = json.dumps({"dataset": "synthetic_0.5_0.5", "custom": {},
                      "synthetic": {"num_clients": 6, "dimension": 60, "num_classes": 10, "seed": 0,
                                    "train_fraction": 0.75}})
    raw, arrays, samples = tmp_path / "r.npz", tmp_path / "a.npz", tmp_path / "s.parquet"
    assert main(["download", "--job", job, "--out", str(raw)]) == 0
    assert main(["preprocess", "--job", job, "--raw", str(raw), "--out", str(arrays), "--samples", str(samples)]) == 0
    pjob = json.dumps({"dataset": "synthetic_0.5_0.5", "name": "nat",
                       "config": {"scheme": "natural", "num_clients": 6}})
    out = tmp_path / "part"
    assert main(["partition", "--job", pjob, "--arrays", str(arrays), "--samples", str(samples),
                 "--out-dir", str(out)]) == 0
    table = read_parquet(out / "partition.parquet")
    assert table["client_id"].nunique() == 6 and table["sample_id"].is_unique
    stats = json.loads((out / "client_stats.json").read_text())
    assert stats["class_names"] is None  # generated data: classes are named by index
    assert not (out / "heatmap.png").exists()  # the figure is its own stage, outside the data
    fig = tmp_path / "figures" / "heatmap.png"
    assert main(["partition-figure", "--stats", str(out / "client_stats.json"), "--out", str(fig)]) == 0
    assert fig.read_bytes().startswith(b"\x89PNG")


def test_corrupt_synthetic_file_names_the_file(tmp_path):
    raw = tmp_path / "s.npz"
    np.savez(raw, features=np.zeros((4, 60), np.float32), labels=np.array([0, 1, 2, 11]),
             client_id=np.zeros(4, np.int64), local_split=np.zeros(4, np.uint8))
    with pytest.raises(DataError, match=r"s\.npz: labels has labels in \[0, 11\]"):
        preprocess(raw, tmp_path / "a.npz", tmp_path / "b.parquet", 10, 60, layout="synthetic")
    np.savez(raw, features=np.zeros((4, 60), np.float32))
    with pytest.raises(DataError, match=r"s\.npz: missing array 'labels'"):
        preprocess(raw, tmp_path / "a.npz", tmp_path / "b.parquet", 10, 60, layout="synthetic")
