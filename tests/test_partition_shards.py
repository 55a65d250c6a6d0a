"""Tests of the ``shards`` partition scheme (McMahan et al. 2017; the PFPS-LWC spec's READING of
its pathological partition, ``../shared/docs/methods-fedmic-pfpslwc.md`` B.4): the pool sorted
by label, cut into ``num_clients * shards_per_client`` shards, ``shards_per_client`` random
shards per client, so at most ``shards_per_client`` classes per client."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from medpfl.compose import validate_params
from medpfl.config import ParamsError, PartitionConfig, partition_config, partition_from_job
from medpfl.data.partition import PartitionError, ShardsPartitioner, build_partition
from medpfl.data.schemas import PartitionTable, validate

CLASS_SIZES = [400, 300, 300, 250, 250, 200, 200, 100]  # imbalanced, N = 2000


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    y = np.repeat(np.arange(len(CLASS_SIZES)), CLASS_SIZES).astype(np.int64)
    return np.random.default_rng(123).permutation(y)


@pytest.fixture(scope="module")
def pool_ids(labels) -> np.ndarray:
    """Ids that are not positions (offset and shuffled)."""
    return (np.random.default_rng(7).permutation(len(labels)) + 5000).astype(np.int64)


def _parts(labels, k=10, spc=2, seed=3, min_samples=1):
    return ShardsPartitioner(k, spc, min_samples, key="partitions.sh").partition(labels, np.random.RandomState(seed))


def _cfg(**kw) -> PartitionConfig:
    return partition_config(**{"scheme": "shards", "num_clients": 10, "shards_per_client": 2, "seed": 3,
                              "min_samples": 1, **kw})


@pytest.mark.parametrize("k,spc", [(10, 2), (8, 1), (5, 3), (20, 4), (100, 20)])
def test_disjoint_complete_and_at_most_k_classes(labels, k, spc):
    parts = _parts(labels, k, spc)
    assert len(parts) == k
    flat = np.concatenate(parts)
    assert len(flat) == len(labels) and len(np.unique(flat)) == len(labels)  # every sample exactly once
    for p in parts:
        assert len(np.unique(labels[p])) <= spc


def test_balanced_classes_give_equal_shards_of_one_class_each():
    """10 classes x 100 samples, 10 clients x 5 shards: 50 shards of exactly 20, every shard one
    class (the CIFAR-10 setting in miniature), so clients have 100 samples and <= 5 classes."""
    y = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 100))
    sp = ShardsPartitioner(10, 5)
    assert sp.shard_counts(np.full(10, 100)).tolist() == [5] * 10
    parts = sp.partition(y, np.random.RandomState(1))
    assert [len(p) for p in parts] == [100] * 10
    for p in parts:
        counts = np.bincount(y[p], minlength=10)
        assert set(counts.tolist()) <= {0, 20, 40, 60, 80, 100} and (counts > 0).sum() <= 5


def test_shard_counts_make_shards_as_equal_as_class_boundaries_allow():
    sp = ShardsPartitioner(10, 30)  # the CIFAR-100 setting: 300 shards over 100 classes of 500
    assert sp.shard_counts(np.full(100, 500)).tolist() == [3] * 100
    # imbalanced: one shard each, then to the class whose shards are largest (ties: lower class)
    assert ShardsPartitioner(3, 2).shard_counts(np.array([10, 1, 5])).tolist() == [3, 1, 2]
    counts = ShardsPartitioner(10, 2).shard_counts(np.array(CLASS_SIZES))
    assert counts.sum() == 20 and counts.min() >= 1
    sizes = np.array(CLASS_SIZES) / counts
    assert sizes.max() <= 2 * sizes.min()


def test_shard_sizes_differ_by_at_most_one_within_a_class(labels):
    """With one shard per client, each client is exactly one shard: one class, and the shards of
    a class differ by at most one sample."""
    k = 16
    parts = _parts(labels, k, 1)
    by_class: dict[int, list[int]] = {}
    for p in parts:
        (c,) = np.unique(labels[p])
        by_class.setdefault(int(c), []).append(len(p))
    assert sorted(by_class) == list(range(len(CLASS_SIZES)))
    for c, sizes in by_class.items():
        assert sum(sizes) == CLASS_SIZES[c] and max(sizes) - min(sizes) <= 1


def test_same_seed_same_table_other_seed_other_table(labels, pool_ids):
    a = build_partition(pool_ids, labels, _cfg(), "sh")
    pd.testing.assert_frame_equal(a, build_partition(pool_ids, labels, _cfg(), "sh"))
    b = build_partition(pool_ids, labels, _cfg(seed=4), "sh")
    ma = a.set_index("sample_id")["client_id"].sort_index()
    mb = b.set_index("sample_id")["client_id"].sort_index()
    assert (ma != mb).any()


def test_client_lists_are_shuffled(labels):
    for p in _parts(labels, 5, 2):
        assert not np.all(np.diff(labels[p]) >= 0)  # not left in label order


@pytest.mark.parametrize("rule", ["stratified", "random", "fedkper", "ordered"])
def test_table_with_each_local_rule(labels, pool_ids, rule):
    table = build_partition(pool_ids, labels, _cfg(local_test={"rule": rule, "fraction": 0.2}), "sh")
    validate(PartitionTable, table, "t")
    assert sorted(table["sample_id"]) == sorted(pool_ids.tolist())
    train = table[table["local_split"] == "train"]
    whole = table.groupby("client_id")["label"].nunique()
    assert whole.max() <= 2 and train["client_id"].nunique() == 10


# ----------------------------------------------------------------------------- errors


def test_config_requires_shards_per_client_and_validates_it():
    with pytest.raises(ValidationError, match=r"shards_per_client\n.*is required for the shards scheme"):
        partition_config(scheme="shards")
    with pytest.raises(ValidationError, match=r"shards_per_client\n.*greater than or equal to 1"):
        partition_config(scheme="shards", shards_per_client=0)
    with pytest.raises(ParamsError, match=r"partitions\.sh\.shards_per_client: is required"):
        validate_params({"partitions": [{"name": "sh", "scheme": "shards"}]})


def test_config_dump_leaves_out_an_unset_shards_per_client():
    """Partitions of the other schemes keep the job description (and client_stats.json) they had."""
    assert "shards_per_client" not in partition_config().job_dict()
    cfg = partition_config(scheme="shards", shards_per_client=3)
    assert cfg.job_dict()["shards_per_client"] == 3
    assert partition_config(cfg.model_dump()) == cfg == partition_from_job(cfg.job_dict())


def test_more_shards_than_samples_names_the_keys(labels):
    with pytest.raises(PartitionError, match=r"partitions\.sh: num_clients x shards_per_client = 100 x 30 = 3000 "
                                             r"shards exceed the 2000 samples.*partitions\.sh\.shards_per_client"):
        build_partition(np.arange(len(labels)), labels, _cfg(num_clients=100, shards_per_client=30), "sh")


def test_fewer_shards_than_classes_names_the_keys(labels):
    with pytest.raises(PartitionError, match=r"partitions\.sh: num_clients x shards_per_client = 6 shards cannot "
                                             r"cover the 8 classes.*partitions\.sh\.shards_per_client"):
        build_partition(np.arange(len(labels)), labels, _cfg(num_clients=3, shards_per_client=2), "sh")


def test_min_samples_names_the_key(labels):
    with pytest.raises(PartitionError, match=r"partitions\.sh: clients .* hold fewer than min_samples=190"):
        build_partition(np.arange(len(labels)), labels, _cfg(min_samples=190), "sh")
