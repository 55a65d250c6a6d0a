"""Tests of the ``official_test`` local rule (the PFPS-LWC spec's READING of per-client test data,
``../shared/docs/methods-fedmic-pfpslwc.md`` B.4): a client's whole share is its local train
split, and its local test split is cut from the OFFICIAL test split per class in proportion to
its training samples of that class (largest remainder), so the local tests partition the
official test set and follow each client's training class distribution; a training job reads
such a partition and scores local test on test-split images."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.compose import validate_params
from medpfl.config import partition_config
from medpfl.data.partition import PartitionError, build_partition, largest_remainder, split_official_test
from medpfl.data.schemas import PartitionTable, SharedPartitionTable, validate


def test_largest_remainder_hand_cases():
    assert largest_remainder(10, np.array([1, 1, 1])).tolist() == [4, 3, 3]  # tie: the lower index
    assert largest_remainder(7, np.array([0, 3, 2, 0])).tolist() == [0, 4, 3, 0]  # 4.2, 2.8 -> 4, 3
    assert largest_remainder(5, np.array([100, 1])).tolist() == [5, 0]  # 4.95, 0.05
    assert largest_remainder(0, np.array([2, 3])).tolist() == [0, 0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = rng.integers(0, 50, rng.integers(1, 12))
        if w.sum() == 0:
            continue
        total = int(rng.integers(0, 500))
        s = largest_remainder(total, w)
        exact = total * w / w.sum()
        assert s.sum() == total and np.all(np.abs(s - exact) < 1) and np.all(s[w == 0] == 0)
    with pytest.raises(ValueError, match="positive sum"):
        largest_remainder(3, np.array([0, 0]))


def _hand_case():
    """Two clients. Client 0 trains on 30 x class 0 and 10 x class 1; client 1 on 10 x class 0
    and 20 x class 2. The official test split: 8 x class 0, 5 x class 1, 3 x class 2 and 4 x
    class 3 (a class nobody trains on)."""
    pool = np.array([0] * 30 + [1] * 10 + [0] * 10 + [2] * 20)
    clients = [np.random.default_rng(1).permutation(40), 40 + np.random.default_rng(2).permutation(30)]
    test = np.random.default_rng(3).permutation(np.array([0] * 8 + [1] * 5 + [2] * 3 + [3] * 4))
    return pool, clients, test


def test_hand_made_proportions():
    pool, clients, test = _hand_case()
    out = split_official_test(clients, pool, test, np.random.RandomState(0), key="partitions.h.local_test")
    counts = [np.bincount(test[t], minlength=4).tolist() for _, t in out]
    # class 0: 8 x 30/40 = 6 and 8 x 10/40 = 2; class 1 all to client 0; class 2 all to client 1; class 3 to nobody
    assert counts == [[6, 5, 0, 0], [2, 0, 3, 0]]
    for (train, t), idx in zip(out, clients):
        assert train.tolist() == idx.tolist()  # the whole share, in the client's order
    t0, t1 = out[0][1], out[1][1]
    assert len(np.intersect1d(t0, t1)) == 0
    assert sorted(np.concatenate([t0, t1]).tolist()) == np.flatnonzero(test != 3).tolist()


def test_draw_is_seeded_and_only_the_choice_of_samples_changes():
    pool, clients, test = _hand_case()
    a = split_official_test(clients, pool, test, np.random.RandomState(5))
    b = split_official_test(clients, pool, test, np.random.RandomState(5))
    c = split_official_test(clients, pool, test, np.random.RandomState(6))
    assert all(np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert any(not np.array_equal(x[1], y[1]) for x, y in zip(a, c))
    assert [np.bincount(test[x[1]], minlength=4).tolist() for x in a] == \
        [np.bincount(test[x[1]], minlength=4).tolist() for x in c]


@pytest.fixture(scope="module")
def pool_and_test():
    """An imbalanced 8-class train pool (2000) and test split (400), ids that are not positions."""
    rng = np.random.default_rng(11)
    pool_y = rng.permutation(np.repeat(np.arange(8), [400, 300, 300, 250, 250, 200, 200, 100]))
    test_y = rng.permutation(np.repeat(np.arange(8), [80, 60, 60, 50, 50, 40, 40, 20]))
    pool_ids = (rng.permutation(2000) + 100).astype(np.int64)
    test_ids = (rng.permutation(400) + 5000).astype(np.int64)
    return pool_ids, pool_y, test_ids, test_y


SCHEMES = {
    "dirichlet": dict(scheme="dirichlet", num_clients=6, alpha=0.5, min_samples=20),
    "shards": dict(scheme="shards", num_clients=6, shards_per_client=3, min_samples=1),
    "pathological": dict(scheme="pathological", num_clients=8, classes_per_client=2),
    "iid": dict(scheme="iid", num_clients=5),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_local_tests_partition_the_official_test_set_in_proportion(scheme, pool_and_test):
    pool_ids, pool_y, test_ids, test_y = pool_and_test
    cfg = partition_config(**SCHEMES[scheme], seed=2, local_test={"rule": "official_test"})
    table = build_partition(pool_ids, pool_y, cfg, "o", official_test=(test_ids, test_y))
    validate(PartitionTable, table, "t")  # sample ids unique over both splits
    train, test = table[table["local_split"] == "train"], table[table["local_split"] == "test"]
    assert sorted(train["sample_id"]) == sorted(pool_ids.tolist())  # the whole pool trains
    assert sorted(test["sample_id"]) == sorted(test_ids.tolist())  # the local tests cover the test split once
    id_to_label = dict(zip(test_ids.tolist(), test_y.tolist()))
    assert test["label"].tolist() == [id_to_label[s] for s in test["sample_id"]]
    k = cfg.num_clients
    t = np.zeros((k, 8), int)
    m = np.zeros((k, 8), int)
    np.add.at(t, (train["client_id"], train["label"]), 1)
    np.add.at(m, (test["client_id"], test["label"]), 1)
    assert (m.sum(0) == np.bincount(test_y)).all()  # per class, the shares sum to its test count
    exact = np.bincount(test_y) * t / t.sum(0)
    assert np.all(np.abs(m - exact) < 1) and np.all(m[t == 0] == 0)  # proportional, nobody gets an unheld class


def test_same_seed_same_table(pool_and_test):
    pool_ids, pool_y, test_ids, test_y = pool_and_test
    cfg = partition_config(**SCHEMES["dirichlet"], seed=2, local_test={"rule": "official_test"})
    a = build_partition(pool_ids, pool_y, cfg, "o", official_test=(test_ids, test_y))
    pd.testing.assert_frame_equal(a, build_partition(pool_ids, pool_y, cfg, "o", official_test=(test_ids, test_y)))
    c = build_partition(pool_ids, pool_y, cfg.model_copy(update={"seed": 3}), "o", official_test=(test_ids, test_y))
    assert not a["sample_id"].reset_index(drop=True).equals(c["sample_id"].reset_index(drop=True))


def test_overlapping_clients_still_get_disjoint_local_tests(pool_and_test):
    pool_ids, pool_y, test_ids, test_y = pool_and_test
    cfg = partition_config(scheme="per_client_dirichlet", num_clients=4, alpha=0.5, size_start=100, size_stop=300,
                          local_test={"rule": "official_test"})
    table = build_partition(pool_ids, pool_y, cfg, "o", official_test=(test_ids, test_y))
    validate(SharedPartitionTable, table, "t")
    test = table[table["local_split"] == "test"]
    assert test["sample_id"].is_unique and set(test["sample_id"]) <= set(test_ids.tolist())


def test_no_official_test_split_names_the_key(pool_and_test):
    pool_ids, pool_y, _, _ = pool_and_test
    cfg = partition_config(**SCHEMES["iid"], local_test={"rule": "official_test"})
    for official in (None, (np.array([], dtype=np.int64), np.array([], dtype=np.int64))):
        with pytest.raises(PartitionError, match=r"partitions\.o\.local_test\.rule='official_test' .* has none"):
            build_partition(pool_ids, pool_y, cfg, "o", official_test=official)


def test_a_client_without_a_test_sample_names_the_key():
    """Client 1 trains on 1 of 101 class-0 samples: 5 test samples x 1/101 rounds to none."""
    pool = np.zeros(101, dtype=np.int64)
    with pytest.raises(PartitionError, match=r"partitions\.z\.local_test: client 1 gets no local test sample with "
                                             r"rule='official_test'.*\{0: 1\}.*partitions\.z\.local_test\.rule"):
        split_official_test([np.arange(100), np.array([100])], pool, np.zeros(5, dtype=np.int64),
                            np.random.RandomState(0), key="partitions.z.local_test")


def test_params_accept_the_rule():
    p = validate_params({"partitions": [{"name": "o", "scheme": "shards", "shards_per_client": 5, "num_clients": 10,
                                         "local_test": {"rule": "official_test"}}]})
    assert p.partitions["o"].local_test.rule == "official_test"


def test_a_training_job_scores_local_test_on_test_split_images(tmp_path):
    """A job on a tiny synthetic set (4 classes; train 200, val 20, test 60) with an
    official_test partition: every client's local test ids are test-split ids, and the records
    score each client on exactly its share of the test split."""
    from medpfl.data.preprocess import load_processed
    from medpfl.fl.data import FederatedData
    from medpfl.io import read_parquet, write_parquet
    from medpfl.train import run_training
    from tests.conftest import prepare_train_job

    job, _ = prepare_train_job(tmp_path, method="fedavg", num_clients=4, mlflow=False,
                               train={"rounds": 1, "local_epochs": 1, "batch_size": 32, "checkpoint_every": 0})
    data = load_processed(tmp_path / "arrays.npz", tmp_path / "samples.parquet")
    pool = data.samples[data.samples["split"] == "train"]
    test = data.samples[data.samples["split"] == "test"]
    cfg = partition_config(num_clients=4, alpha=1.0, min_samples=10, seed=1, local_test={"rule": "official_test"})
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "p",
                            official_test=(test["sample_id"].to_numpy(), test["label"].to_numpy()))
    write_parquet(tmp_path / "partition.parquet", table)

    fd = FederatedData.build(data, table, torch.device("cpu"))
    test_ids = set(test["sample_id"].tolist())
    for cid, ids in enumerate(fd.client_test):
        assert ids.numel() > 0 and set(ids.tolist()) <= test_ids
        rows = table[(table["client_id"] == cid) & (table["local_split"] == "test")]
        assert fd.labels[ids].tolist() == rows["label"].tolist()  # ids resolve to the test-split images
    assert sorted(torch.cat(fd.client_test).tolist()) == sorted(fd.global_test.tolist())

    out = tmp_path / "run"
    run_training(job, tmp_path / "arrays.npz", tmp_path / "samples.parquet", tmp_path / "partition.parquet", out)
    rec = read_parquet(out / "records.parquet")
    local = rec[(rec["view"] == "global_on_local") & (rec["round"] == rec["round"].max())]
    sizes = table[table["local_split"] == "test"].groupby("client_id").size()
    assert local.set_index("client_id")["n_samples"].sort_index().tolist() == sizes.sort_index().tolist()
    assert local["n_samples"].sum() == len(test)
    g = rec[rec["view"] == "global_test"]
    assert (g["n_samples"] == len(test)).all()  # the global test set is still the whole test split
