"""Tests of the pFedKD-WCL partition ``per_client_dirichlet`` (spec A.3.1; HengruiH/pFedKD
``utils/MNIST_dirichlet.py`` and ``utils/MNIST.py``): linspace client sizes, per-client
Dirichlet proportions with top-k truncation and the remainder-to-the-last-class rule, samples
shared between clients (allowed here only), the ordered 75/25 local split, the clustered
variant, seeds and errors."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import PartitionConfig, partition_config
from medpfl.data.partition import PartitionError, PerClientDirichletPartitioner, build_partition
from medpfl.data.schemas import PartitionTable, SharedPartitionTable, TableError, validate

NUM_CLASSES = 10
CLASS_SIZE = 600  # N = 6000, 10 balanced classes (an MNIST-like pool, small)


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    y = np.repeat(np.arange(NUM_CLASSES), CLASS_SIZE).astype(np.int64)
    return np.random.default_rng(5).permutation(y)


@pytest.fixture(scope="module")
def pool_ids(labels) -> np.ndarray:
    """Ids that are not positions (offset, shuffled), so id/position confusion shows."""
    return (np.random.default_rng(9).permutation(len(labels)) + 1000).astype(np.int64)


def _cfg(**kw) -> PartitionConfig:
    d = dict(scheme="per_client_dirichlet", num_clients=12, alpha=0.5, size_start=100, size_stop=377, seed=4)
    d.update(kw)
    return partition_config(**d)


def _counts(table: pd.DataFrame, cid: int) -> np.ndarray:
    return np.bincount(table.loc[table["client_id"] == cid, "label"], minlength=NUM_CLASSES)


# ----------------------------------------------------------------------------- sizes, split


def test_defaults_are_the_papers_sizes_and_ordered_75_25_split():
    cfg = partition_config(scheme="per_client_dirichlet", num_clients=20, alpha=0.05)
    assert (cfg.size_start, cfg.size_stop, cfg.top_k, cfg.clustered) == (1165, 3834, None, False)
    assert (cfg.local_test.rule, cfg.local_test.fraction) == ("ordered", 0.25)
    part = PerClientDirichletPartitioner(20, 0.05)
    np.testing.assert_array_equal(part.sizes(), np.linspace(1165, 3834, 20, dtype=int))
    # an explicit local_test wins over the scheme's default
    cfg = partition_config(scheme="per_client_dirichlet", num_clients=20, alpha=0.05, local_test={"rule": "random"})
    assert cfg.local_test.rule == "random"


@pytest.mark.parametrize("kw", [dict(), dict(top_k=2), dict(alpha=0.05), dict(clustered=True, n_clusters=4)])
def test_client_sizes_are_exactly_linspace_and_split_is_first_75_percent(kw, labels, pool_ids):
    cfg = _cfg(**kw)
    table = build_partition(pool_ids, labels, cfg, "p")
    sizes = table.groupby("client_id").size().to_numpy()
    np.testing.assert_array_equal(sizes, np.linspace(100, 377, 12, dtype=int))
    for cid, n_k in enumerate(sizes):
        rows = table[table["client_id"] == cid]
        assert (rows["local_split"] == "train").sum() == int(0.75 * n_k)
        # the table keeps the client's order: its train rows come first, then its test rows
        assert rows["local_split"].tolist() == ["train"] * int(0.75 * n_k) + ["test"] * (n_k - int(0.75 * n_k))
        # a sample at most once per client, labels agree with the pool
        assert rows["sample_id"].is_unique
    lab = dict(zip(pool_ids.tolist(), labels.tolist()))
    assert (table["label"] == table["sample_id"].map(lab)).all()


def test_matches_the_pseudo_code_draw_for_draw(labels, pool_ids):
    """An independent transcription of spec A.3.1 on the same RandomState stream."""
    cfg = _cfg(top_k=3)
    table = build_partition(pool_ids, labels, cfg, "p")
    rng = np.random.RandomState(cfg.seed)
    for cid, n_k in enumerate(np.linspace(100, 377, 12, dtype=int)):
        q = rng.dirichlet([0.5] * NUM_CLASSES)
        top = np.argsort(q)[-3:]
        q2 = np.zeros(NUM_CLASSES)
        q2[top] = q[top] / q[top].sum()
        counts = np.floor(q2 * n_k).astype(int)
        counts[-1] += n_k - counts.sum()
        chosen = []
        for c in range(NUM_CLASSES):
            if counts[c]:
                members = np.where(labels == c)[0]
                chosen.append(members[rng.permutation(len(members))[:counts[c]]])
        x = np.concatenate(chosen)
        x = x[rng.permutation(len(x))]
        split = int(0.75 * len(x))
        rows = table[table["client_id"] == cid]
        np.testing.assert_array_equal(rows.loc[rows["local_split"] == "train", "sample_id"], pool_ids[x[:split]])
        np.testing.assert_array_equal(rows.loc[rows["local_split"] == "test", "sample_id"], pool_ids[x[split:]])


# ----------------------------------------------------------------------------- top-k, remainder


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_respected_except_the_remainder_in_the_last_class(top_k, labels, pool_ids):
    table = build_partition(pool_ids, labels, _cfg(num_clients=40, top_k=top_k, size_stop=500), "p")
    quirks = 0
    for cid in range(40):
        counts = _counts(table, cid)
        held = np.flatnonzero(counts)
        if len(held) > top_k:
            # only the remainder quirk may add a class, and only the last one, with fewer
            # samples than the number of kept classes (floor leaves < 1 per kept class)
            assert len(held) == top_k + 1 and held[-1] == NUM_CLASSES - 1
            assert counts[-1] < top_k
            quirks += 1
        else:
            assert len(held) <= top_k
    if top_k > 1:
        assert quirks > 0, "the documented remainder quirk never showed in 40 clients"


def test_remainder_goes_to_the_last_class_index(labels):
    part = PerClientDirichletPartitioner(30, 0.5, size_start=101, size_stop=599, top_k=2)
    rng = np.random.RandomState(11)
    clients = part.partition(labels, rng)
    rng = np.random.RandomState(11)
    for k, (idx, n_k) in enumerate(zip(clients, part.sizes())):
        q = rng.dirichlet([0.5] * NUM_CLASSES)
        top = np.argsort(q)[-2:]
        q2 = np.zeros(NUM_CLASSES)
        q2[top] = q[top] / q[top].sum()
        floor = np.floor(q2 * n_k).astype(int)
        got = np.bincount(labels[idx], minlength=NUM_CLASSES)
        np.testing.assert_array_equal(got[:-1], floor[:-1])
        assert got[-1] == floor[-1] + (n_k - floor.sum())
        # advance the stream exactly as the partitioner did
        for c in range(NUM_CLASSES):
            if got[c]:
                rng.permutation(CLASS_SIZE)
        rng.permutation(n_k)


# ----------------------------------------------------------------------------- overlap


def test_clients_share_samples_and_the_shared_schema_allows_it(labels, pool_ids):
    # demand 12 * ~240 = 2.9k of a 6k pool, per class with Dir(0.05) concentrating on few
    # classes: shared samples are all but certain
    table = build_partition(pool_ids, labels, _cfg(alpha=0.05), "p")
    assert table["sample_id"].duplicated().any()
    validate(SharedPartitionTable, table, "shared")
    with pytest.raises(TableError, match="sample_id"):
        validate(PartitionTable, table, "disjoint")


def test_overlap_still_rejected_for_the_disjoint_schemes():
    dup = pd.DataFrame({"sample_id": [0, 1, 2, 1], "client_id": [0, 0, 1, 1],
                        "local_split": ["train", "test", "train", "test"], "label": [1, 2, 1, 2]})
    validate(SharedPartitionTable, dup, "ok")
    with pytest.raises(TableError, match=r"(?s)part\.parquet.*sample_id"):
        validate(PartitionTable, dup, "part.parquet")
    twice = dup.copy()
    twice.loc[3, "client_id"] = 0  # sample 1 twice in client 0: never allowed
    with pytest.raises(TableError, match=r"(?s)SharedPartitionTable.*client_id.*sample_id"):
        validate(SharedPartitionTable, twice, "shared.parquet")


def test_dirichlet_scheme_stays_disjoint(labels, pool_ids):
    cfg = partition_config(scheme="dirichlet", num_clients=12, alpha=0.05, min_samples=5, seed=4)
    table = build_partition(pool_ids, labels, cfg, "d")
    assert table["sample_id"].is_unique and len(table) == len(pool_ids)


def test_shared_samples_work_end_to_end_in_federated_data(labels, pool_ids):
    """FederatedData builds per-client index tensors from the table: a sample in two clients is
    in both clients' tensors and reads the same image."""
    from medpfl.data.preprocess import ProcessedData
    from medpfl.fl.data import FederatedData

    table = build_partition(pool_ids, labels, _cfg(alpha=0.05), "p")
    n = int(pool_ids.max()) + 1
    all_labels = np.zeros(n, dtype=np.int64)
    all_labels[pool_ids] = labels
    images = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8).reshape(n, 1, 1, 1).repeat(4, axis=2)
    samples = pd.DataFrame({"sample_id": np.arange(n), "split": "train", "index_in_split": np.arange(n),
                            "label": all_labels})
    data = ProcessedData(images=images, labels=all_labels, samples=samples, num_classes=NUM_CLASSES)
    fd = FederatedData.build(data, table, torch.device("cpu"))
    shared = table.loc[table["sample_id"].duplicated(), "sample_id"].iloc[0]
    holders = [c for c in range(fd.num_clients)
               if shared in torch.cat([fd.client_train[c], fd.client_test[c]]).tolist()]
    assert len(holders) >= 2
    assert sum(len(t) + len(s) for t, s in zip(fd.client_train, fd.client_test)) == len(table)
    hist = np.stack([_counts(table[table["local_split"] == "train"], c) for c in range(fd.num_clients)])
    np.testing.assert_array_equal(fd.train_hist.numpy(), hist)


# ----------------------------------------------------------------------------- seeds, clustered


def test_same_seed_same_table_different_seed_different_table(labels, pool_ids):
    a = build_partition(pool_ids, labels, _cfg(top_k=2), "p")
    b = build_partition(pool_ids, labels, _cfg(top_k=2), "p")
    c = build_partition(pool_ids, labels, _cfg(top_k=2, seed=5), "p")
    pd.testing.assert_frame_equal(a, b)
    assert not a["sample_id"].equals(c["sample_id"])


def test_clustered_clients_share_one_pair_per_cluster(labels, pool_ids):
    table = build_partition(pool_ids, labels, _cfg(clustered=True, n_clusters=4), "c")
    pairs = []
    for cluster in range(4):
        held = {tuple(np.flatnonzero(_counts(table, cluster * 3 + j))) for j in range(3)}
        assert len(held) == 1
        pair = held.pop()
        assert len(pair) == 2
        pairs.append(pair)
    assert len(set(pairs)) > 1


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, pattern", [
    (dict(alpha=0.0), r"(?s)alpha.*> 0 for the per_client_dirichlet"),
    (dict(alpha=None), r"(?s)alpha.*> 0"),
    (dict(size_start=500, size_stop=100), r"size_stop=100 is below size_start=500"),
    (dict(size_start=0), r"size_start"),
    (dict(top_k=0), r"top_k"),
    (dict(clustered=True), r"n_clusters is required"),
    (dict(clustered=True, n_clusters=5), r"multiple of n_clusters=5"),
    (dict(clustered=True, n_clusters=4, top_k=2), r"top_k does not apply to clustered"),
])
def test_config_errors_name_the_key(kw, pattern):
    with pytest.raises(ValidationError, match=pattern):
        _cfg(**kw)


def test_params_error_names_the_dotted_key():
    with pytest.raises(Exception, match=r"partitions\.pc.*size_stop=1 is below"):
        validate_params({"partitions": [{"name": "pc", "scheme": "per_client_dirichlet", "alpha": 0.5,
                                         "size_start": 10, "size_stop": 1}]})


def test_partition_errors_name_the_key(labels, pool_ids):
    with pytest.raises(PartitionError, match=r"partitions\.big: client \d+ needs \d+ samples of class \d+, the train pool "
                                             r"holds 600; lower partitions\.big\.size_stop"):
        build_partition(pool_ids, labels, _cfg(size_start=3000, size_stop=5000, alpha=0.01), "big")
    with pytest.raises(PartitionError, match=r"partitions\.k\.top_k=11 exceeds the 10 classes"):
        build_partition(pool_ids, labels, _cfg(top_k=11), "k")
    with pytest.raises(PartitionError, match=r"partitions\.s\.size_start=1: every client needs at least 2"):
        build_partition(pool_ids, labels, _cfg(size_start=1, size_stop=1), "s")
    with pytest.raises(PartitionError, match=r"partitions\.c\.clustered: client \d+ needs 5000 samples of classes"):
        build_partition(pool_ids, labels, _cfg(clustered=True, n_clusters=4, size_start=5000, size_stop=5000), "c")


def test_partition_stage_writes_table_stats_and_heatmap(tmp_path, synthetic_processed):
    """The CLI stage on a preprocessed set: shared samples survive parquet, stats and figure."""
    from medpfl.io import read_parquet

    data_dir = tmp_path / "d"
    data_dir.mkdir()
    np.savez(data_dir / "a.npz", images=synthetic_processed.images, labels=synthetic_processed.labels,
             num_classes=np.int64(synthetic_processed.num_classes))
    synthetic_processed.samples.to_parquet(data_dir / "s.parquet")
    job = {"dataset": "synth", "name": "pc",
           "config": {"scheme": "per_client_dirichlet", "num_clients": 6, "alpha": 0.3, "size_start": 30,
                      "size_stop": 80, "top_k": 2}}
    out = tmp_path / "part"
    assert main(["partition", "--job", json.dumps(job), "--arrays", str(data_dir / "a.npz"),
                 "--samples", str(data_dir / "s.parquet"), "--out-dir", str(out)]) == 0
    table = read_parquet(out / "partition.parquet")
    validate(SharedPartitionTable, table, "t")
    assert table["sample_id"].duplicated().any()  # 6 clients x ~55 of a 400-sample pool
    stats = json.loads((out / "client_stats.json").read_text())
    assert sum(sum(c["train"]) + sum(c["test"]) for c in stats["clients"].values()) == len(table)
    fig = tmp_path / "fig" / "heatmap.png"
    assert main(["partition-figure", "--stats", str(out / "client_stats.json"), "--out", str(fig)]) == 0
    assert fig.stat().st_size > 0
