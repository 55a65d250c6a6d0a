"""The data side of the FHBench protocol (``../shared/docs/methods-pfedkdwcl-epfl.md`` B.3, B.4,
C.14) and FedMIC's per-client split (``../shared/docs/methods-fedmic-pfpslwc.md`` A.10):

- the ``dirichlet_pairs`` scheme (FHBench's ``build_non_iid_by_dirichlet``: clients in pairs,
  each pair a contiguous chunk of the shuffled pool, Dir(alpha, alpha) per class within a pair);
- the ``ratios`` local rule (train/test/val per class, FHBench 4:3:3, FedMIC 7:2:1) and the
  local val split as a partition part (table, ``client_stats.json``, ``FederatedData.client_val``);
- ``pool: all`` (official train + test + val merged; no global test set) and ``data_fraction``;
- ``train.transform`` (grayscale -> 3 channels, ImageNet normalisation) in ``FederatedData.x``.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import (LocalTestConfig, ParamsError, PartitionConfig, TrainConfig, TransformConfig, partition_config,
                           train_job)
from medpfl.data.partition import (PairwiseDirichletPartitioner, PartitionError, build_partition, client_class_counts,
                                   partition_pool, ratio_counts, split_local, split_ratios)
from medpfl.data.schemas import PartitionTable, validate
from medpfl.fl.data import IMAGENET_MEAN, IMAGENET_STD, FederatedData

CLASS_SIZES = [400, 300, 300, 250, 250, 200, 200, 100]  # N = 2000


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    y = np.repeat(np.arange(len(CLASS_SIZES)), CLASS_SIZES).astype(np.int64)
    return np.random.default_rng(123).permutation(y)


def _pairs(labels, k=10, alpha=0.1, seed=3, equal=True, max_draws=1000):
    return PairwiseDirichletPartitioner(k, alpha, equal, max_draws, key="partitions.fh").partition(
        labels, np.random.RandomState(seed))


# ----------------------------------------------------------------------------- dirichlet_pairs


@pytest.mark.parametrize("equal", [True, False])
def test_pairs_disjoint_and_each_pair_holds_exactly_its_chunk(labels, equal):
    """N = 2000, K = 10: chunks of int(2/10 * 2000) = 400 = 2 * int(2000/10), so the equal blocks
    line up with the chunks: clients 2j and 2j+1 together hold exactly chunk j (the j-th 400
    positions of the seeded permutation), hence every class's samples of a chunk stay in its pair."""
    parts = _pairs(labels, equal=equal)
    flat = np.concatenate(parts)
    assert len(flat) == len(labels) == len(np.unique(flat))  # disjoint and complete
    order = np.random.RandomState(3).permutation(len(labels))  # the partitioner's first draw
    for j in range(5):
        pair = np.concatenate([parts[2 * j], parts[2 * j + 1]])
        assert sorted(pair.tolist()) == sorted(order[400 * j:400 * (j + 1)].tolist())
    for p in parts:
        assert np.all(np.diff(p) > 0)  # listed in pool order (the code re-enumerates in data-set order)
    sizes = [len(p) for p in parts]
    if equal:
        assert sizes == [200] * 10  # exactly int(N / K) each
    else:
        assert min(sizes) >= int(0.5 * 400 / 2)  # the min-size rule: >= int(0.5 * chunk / 2)
        assert sum(sizes) == 2000


def test_pairs_label_skew_is_within_a_pair(labels):
    """Small alpha: inside a pair one client holds most of each class; large alpha: about half."""
    def within_pair_share(parts):
        shares = []
        for j in range(len(parts) // 2):
            a, b = (np.bincount(labels[parts[2 * j + i]], minlength=8) for i in (0, 1))
            tot = a + b
            shares += (np.maximum(a, b)[tot > 0] / tot[tot > 0]).tolist()
        return float(np.mean(shares))
    assert within_pair_share(_pairs(labels, alpha=0.05, equal=False)) > 0.85
    assert within_pair_share(_pairs(labels, alpha=100.0, equal=False)) < 0.65


def test_pairs_draw_order_by_hand():
    """K = 2 (one chunk = the whole pool), alpha large so the first draw passes: the permutation,
    then one Dir(alpha, alpha) per class (sorted) cut at cumsum(p) * n_c, with the balance rule
    (a client already holding >= N/2 gets nothing more)."""
    y = np.array([0] * 6 + [1] * 5 + [2] * 9, dtype=np.int64)
    rng = np.random.RandomState(4)
    order = rng.permutation(len(y))
    lists = [[], []]
    for c in (0, 1, 2):
        members = order[y[order] == c]
        p = rng.dirichlet([50.0, 50.0]) * np.array([len(b) < len(y) / 2 for b in lists])
        cuts = (np.cumsum(p / p.sum()) * len(members)).astype(int)[:-1]
        lists = [b + m.tolist() for b, m in zip(lists, np.split(members, cuts))]
    assert min(map(len, lists)) >= int(0.5 * 20 / 2)
    parts = PairwiseDirichletPartitioner(2, 50.0, equal_sizes=False).partition(y, np.random.RandomState(4))
    assert [p.tolist() for p in parts] == [sorted(b) for b in lists]
    # equal sizes: the two lists (each grouped by class) concatenated and cut in two halves
    flat = np.concatenate([np.array(b) for b in lists])
    parts = PairwiseDirichletPartitioner(2, 50.0, equal_sizes=True).partition(y, np.random.RandomState(4))
    assert [p.tolist() for p in parts] == [sorted(flat[:10].tolist()), sorted(flat[10:].tolist())]


def test_pairs_odd_number_of_clients_and_last_chunk(labels):
    """K = 5: chunks of int(2/5 * 2000) = 800 for the pairs (0, 1) and (2, 3); the last chunk, the
    remaining 400, goes to client 4 alone."""
    order = np.random.RandomState(3).permutation(len(labels))
    drawn = _pairs(labels, k=5, equal=False)
    assert sorted(drawn[4].tolist()) == sorted(order[1600:].tolist())
    assert sorted(np.concatenate(drawn[2:4]).tolist()) == sorted(order[800:1600].tolist())
    equal = _pairs(labels, k=5, equal=True)
    assert [len(p) for p in equal] == [400] * 5
    assert len(np.unique(np.concatenate(equal))) == 2000


def test_pairs_remainder_and_drift_as_the_code():
    """N = 2003, K = 4: chunks of int(2/4 * 2003) = 1001 and the rest (1002); equal blocks of
    int(2003/4) = 500, so 3 samples go to nobody, and block 2 starts one sample before pair 1's
    chunk (it takes the last sample of pair 0's second list)."""
    y = np.random.default_rng(5).integers(0, 4, 2003).astype(np.int64)
    parts = PairwiseDirichletPartitioner(4, 0.5, equal_sizes=True).partition(y, np.random.RandomState(1))
    assert [len(p) for p in parts] == [500] * 4
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == 2000
    order = np.random.RandomState(1).permutation(2003)
    chunk0 = set(order[:1001].tolist())
    assert set(np.concatenate(parts[:2]).tolist()) <= chunk0
    assert len(set(parts[2].tolist()) & chunk0) == 1  # the drift: one sample of pair 0 in block 2
    assert set(parts[3].tolist()).isdisjoint(chunk0)


def test_pairs_seeded(labels):
    a, b, c = _pairs(labels, seed=3), _pairs(labels, seed=3), _pairs(labels, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_pairs_min_size_rule_gives_up_naming_the_key():
    """One class only: Dir(0.01, 0.01) hands (nearly) all of it to one client of the pair; the
    other stays below int(0.5 * chunk / 2), so every draw fails."""
    y = np.zeros(100, dtype=np.int64)
    with pytest.raises(PartitionError, match=r"partitions\.fh: no Dirichlet draw of chunk 0 .* in 5 tries.*"
                                             r"partitions\.fh\.alpha"):
        PairwiseDirichletPartitioner(2, 0.01, max_draws=5, key="partitions.fh").partition(y, np.random.RandomState(0))


def test_pairs_config():
    with pytest.raises(ValidationError, match="dirichlet_pairs needs at least 2 clients"):
        partition_config(scheme="dirichlet_pairs", num_clients=1)
    with pytest.raises(ValidationError, match="must be > 0 for the dirichlet_pairs scheme"):
        partition_config(scheme="dirichlet_pairs", alpha=None)
    with pytest.raises(ValidationError, match="pair_sizes"):
        partition_config(scheme="dirichlet_pairs", pair_sizes="odd")
    assert "pair_sizes" not in partition_config(scheme="dirichlet_pairs").job_dict()
    assert partition_config(scheme="dirichlet_pairs", pair_sizes="drawn").job_dict()["pair_sizes"] == "drawn"


# ----------------------------------------------------------------------------- the ratios rule


@pytest.mark.parametrize("ratios,n,rounding,expected", [
    ([0.4, 0.3, 0.3], 10, "floor", (4, 3, 3)),
    ([0.4, 0.3, 0.3], 7, "floor", (2, 2, 3)),
    ([0.4, 0.3, 0.3], 1, "floor", (0, 0, 1)),
    ([0.4, 0.3, 0.3], 0, "floor", (0, 0, 0)),
    ([0.7, 0.2, 0.1], 90, "floor", (63, 18, 9)),  # exact decimals: the float int(0.7 * 90) is 62
    ([0.7, 0.2, 0.1], 4, "floor", (2, 0, 2)),
    ([0.7, 0.2, 0.1], 4, "nearest", (3, 1, 0)),  # 2.8, 0.8, 0.4
    ([0.4, 0.3, 0.3], 7, "nearest", (3, 2, 2)),  # 2.8, 2.1, 2.1
    ([0.4, 0.3, 0.3], 10, "nearest", (4, 3, 3)),
    ([0.5, 0.25, 0.25], 2, "nearest", (1, 1, 0)),  # 1, 0.5, 0.5: the tie to the earlier part
])
def test_ratio_counts_hand_cases(ratios, n, rounding, expected):
    assert ratio_counts(ratios, n, rounding) == expected


def test_split_ratios_takes_each_class_in_the_client_order():
    """A client of 10 samples of class 0 and 7 of class 1, interleaved: 4/3/3 and 2/2/3, the
    first ones (in the client's order) train, the next test, the rest val; parts keep that order."""
    y = np.array([0] * 10 + [1] * 7, dtype=np.int64)
    idx = np.array([0, 10, 1, 11, 2, 12, 3, 13, 4, 14, 5, 15, 6, 16, 7, 8, 9])  # positions into y
    cfg = LocalTestConfig(rule="ratios", ratios=[0.4, 0.3, 0.3])
    ((train, test, val),) = split_ratios([idx], y, cfg)
    assert train.tolist() == [0, 10, 1, 11, 2, 3]
    assert test.tolist() == [12, 13, 4, 5, 6]
    assert val.tolist() == [14, 15, 16, 7, 8, 9]
    # split_local dispatches the rule (and draws nothing)
    rng = np.random.RandomState(0)
    state = rng.get_state()[1].copy()
    ((t2, s2, v2),) = split_local([idx], y, cfg, rng)
    assert np.array_equal(t2, train) and np.array_equal(s2, test) and np.array_equal(v2, val)
    assert np.array_equal(rng.get_state()[1], state)


def test_split_ratios_errors_name_the_key():
    y = np.arange(5, dtype=np.int64)  # five classes of one sample: 0/0/1 each
    cfg = LocalTestConfig(rule="ratios", ratios=[0.4, 0.3, 0.3])
    with pytest.raises(PartitionError, match=r"partitions\.r\.local_test: client 0 .* gets no local train sample.*"
                                             r"partitions\.r\.local_test\.rounding: nearest"):
        split_ratios([np.arange(5)], y, cfg, key="partitions.r.local_test")


@pytest.mark.parametrize("local_test,msg", [
    ({"rule": "ratios"}, "is required for rule: ratios"),
    ({"rule": "ratios", "ratios": [0.5, 0.3, 0.3]}, "must sum to 1"),
    ({"rule": "ratios", "ratios": [0.7, 0.3]}, "three shares"),
    ({"rule": "ratios", "ratios": [1.2, 0.1, -0.3]}, "must be >= 0"),
    ({"rule": "ratios", "ratios": [0.7, 0.0, 0.3]}, "train and test shares must be > 0"),
    ({"rule": "stratified", "ratios": [0.4, 0.3, 0.3]}, "applies to rule: ratios only"),
    ({"rule": "ratios", "ratios": [0.4, 0.3, 0.3], "rounding": "up"}, "'floor' or 'nearest'"),
])
def test_ratios_params_errors_name_the_key(local_test, msg):
    key = "local_test.rounding" if "rounding" in local_test else "local_test.ratios"
    with pytest.raises(ParamsError, match=rf"partitions\.fh\.{key}: .*{msg}"):
        validate_params({"partitions": [{"name": "fh", "local_test": local_test}]})


def test_ratios_dump_only_when_used():
    assert LocalTestConfig().model_dump() == {"fraction": 0.2, "rule": "stratified"}
    assert LocalTestConfig(rule="ratios", ratios=[0.7, 0.2, 0.1]).model_dump() == {
        "fraction": 0.2, "rule": "ratios", "ratios": [0.7, 0.2, 0.1]}
    assert LocalTestConfig(rule="ratios", ratios=[0.7, 0.2, 0.1], rounding="nearest").model_dump()["rounding"] == \
        "nearest"


# ----------------------------------------------------------------------------- pool and data_fraction


def _samples(n_train=300, n_val=60, n_test=140, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    return pd.DataFrame({"sample_id": np.arange(len(splits), dtype=np.int64), "split": splits,
                         "index_in_split": np.concatenate([np.arange(n) for n in (n_train, n_val, n_test)]),
                         "label": rng.integers(0, 4, len(splits)).astype(np.int64)})


def test_partition_pool_orders_train_test_val():
    s = _samples()
    assert partition_pool(s, partition_config()).equals(s[s["split"] == "train"])
    pool = partition_pool(s, partition_config(pool="all"))
    assert pool["sample_id"].tolist() == list(range(300)) + list(range(360, 500)) + list(range(300, 360))


def test_pool_all_and_fraction_draw_a_seeded_subset_first():
    s = _samples()
    cfg = partition_config(scheme="iid", num_clients=4, pool="all", data_fraction=0.3, seed=7,
                          local_test={"rule": "ratios", "ratios": [0.4, 0.3, 0.3]})
    pool = partition_pool(s, cfg)
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "fh")
    keep = np.random.RandomState(7).choice(500, 150, replace=False)  # floor(0.3 * 500), the first draw
    assert sorted(table["sample_id"].tolist()) == sorted(pool["sample_id"].to_numpy()[keep].tolist())
    assert set(table["local_split"]) == {"train", "test", "val"}
    assert set(s.loc[s["sample_id"].isin(table["sample_id"]), "split"]) == {"train", "val", "test"}
    again = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "fh")
    assert again.equals(table)


def test_default_pool_and_fraction_change_nothing():
    s = _samples()
    pool = s[s["split"] == "train"]
    plain = partition_config(num_clients=4, alpha=0.5, min_samples=5)
    explicit = partition_config(num_clients=4, alpha=0.5, min_samples=5, pool="train", data_fraction=1.0)
    assert plain.job_dict() == explicit.job_dict() and "pool" not in plain.job_dict()
    a = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), plain, "d")
    b = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), explicit, "d")
    assert a.equals(b) and "val" not in set(a["local_split"])
    assert set(client_class_counts(a, 4)[0]) == {"train", "test"}  # client_stats.json as before


def test_pool_and_fraction_errors():
    with pytest.raises(ParamsError, match=r"partitions\.o: local_test\.rule: official_test .* pool: all"):
        validate_params({"partitions": [{"name": "o", "pool": "all", "local_test": {"rule": "official_test"}}]})
    with pytest.raises(ParamsError, match=r"partitions\.n\.data_fraction: not a key of the natural scheme"):
        validate_params({"partitions": [{"name": "n", "scheme": "natural", "data_fraction": 0.5}]})
    for bad in (0, 1.5):
        with pytest.raises(ParamsError, match=r"partitions\.f\.data_fraction"):
            validate_params({"partitions": [{"name": "f", "data_fraction": bad}]})
    with pytest.raises(ParamsError, match=r"partitions\.p\.pool: Input should be 'train' or 'all'"):
        validate_params({"partitions": [{"name": "p", "pool": "test"}]})
    s = _samples()
    pool = s[s["split"] == "train"]
    with pytest.raises(PartitionError, match=r"partitions\.f\.data_fraction=0\.01 keeps 3 of the 300 pool samples, "
                                             r"fewer than num_clients=4"):
        build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                        partition_config(scheme="iid", num_clients=4, data_fraction=0.01), "f")


# ----------------------------------------------------------------------------- FederatedData


def _fhbench_cfg(**kw) -> PartitionConfig:
    return partition_config(**{"scheme": "dirichlet_pairs", "num_clients": 4, "alpha": 0.5, "pool": "all",
                              "data_fraction": 0.8, "seed": 2025,
                              "local_test": {"rule": "ratios", "ratios": [0.4, 0.3, 0.3]}, **kw})


def test_val_rows_reach_federated_data_and_pool_all_has_no_global_test(synthetic_processed):
    data = synthetic_processed
    cfg = _fhbench_cfg()
    pool = partition_pool(data.samples, cfg)
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "fh")
    validate(PartitionTable, table, "t")
    fd = FederatedData.build(data, table, torch.device("cpu"), pool="all")
    assert fd.has_val and fd.global_test.numel() == 0 and fd.global_test.dtype == torch.int64
    for cid in range(4):
        rows = table[table["client_id"] == cid]
        for split, ids in (("train", fd.client_train[cid]), ("test", fd.client_test[cid]),
                           ("val", fd.client_val[cid])):
            assert ids.dtype == torch.int64
            assert ids.tolist() == rows.loc[rows["local_split"] == split, "sample_id"].tolist()
            assert fd.labels[ids].tolist() == rows.loc[rows["local_split"] == split, "label"].tolist()
    everything = torch.cat(fd.client_train + fd.client_test + fd.client_val)
    assert everything.numel() == len(table) == len(set(everything.tolist()))
    counts = client_class_counts(table, 4)
    assert all(set(c) == {"train", "test", "val"} for c in counts.values())
    assert sum(sum(sum(c[s]) for s in c) for c in counts.values()) == len(table)
    # the same table read as pool train would put official test samples in training: refused
    with pytest.raises(ParamsError, match="built with pool: all, but the training job says pool train"):
        FederatedData.build(data, table, torch.device("cpu"))


def test_without_val_rows_client_val_is_empty(fed_data, synthetic_processed):
    assert not fed_data.has_val
    assert [v.numel() for v in fed_data.client_val] == [0] * fed_data.num_clients
    assert all(v.dtype == torch.int64 for v in fed_data.client_val)
    assert fed_data.global_test.tolist() == synthetic_processed.split_ids("test").tolist()


# ----------------------------------------------------------------------------- transform


def _gray(transform=None, norm=None) -> FederatedData:
    """Two 1-channel 2x2 images: [[0, 255], [51, 102]] and all 128."""
    images = torch.tensor([[[[0, 255], [51, 102]]], [[[128, 128], [128, 128]]]], dtype=torch.uint8)
    one = torch.tensor([0, 1])
    return FederatedData(images=images, labels=torch.tensor([0, 1]), num_classes=2, global_test=one,
                         client_train=[one], client_test=[one], train_hist=torch.ones(1, 2),
                         device=torch.device("cpu"), norm=norm, transform=transform)


def test_imagenet_transform_hand_case():
    fd = _gray(TransformConfig(channels=3, normalize="imagenet"))
    assert fd.in_channels == 3 and fd.images.shape[1] == 1  # stored as 1 channel
    x = fd.x(torch.tensor([0, 1]))
    assert x.shape == (2, 3, 2, 2) and x.dtype == torch.float32
    for c in range(3):
        m, s = IMAGENET_MEAN[c], IMAGENET_STD[c]
        expected = torch.tensor([[[0 / 255, 1.0], [0.2, 0.4]], [[128 / 255] * 2] * 2])
        torch.testing.assert_close(x[:, c], (expected - m) / s)
    assert abs(float(x[0, 0, 0, 1]) - (1 - 0.485) / 0.229) < 1e-5  # white, red channel: 2.2489
    # a [A, B] index (the stacked executor) gives [A, B, 3, H, W]
    assert fd.x(torch.tensor([[0, 1], [1, 0]])).shape == (2, 2, 3, 2, 2)


def test_channel_expansion_keeps_the_data_sets_normalisation():
    plain, expanded = _gray(), _gray(TransformConfig(channels=3))
    assert plain.in_channels == 1 and expanded.in_channels == 3
    ids = torch.tensor([0, 1])
    torch.testing.assert_close(expanded.x(ids), plain.x(ids).expand(2, 3, 2, 2))
    mnist = _gray(TransformConfig(channels=3), norm=(0.1307, 0.3081))
    torch.testing.assert_close(mnist.x(ids)[:, 2], _gray(norm=(0.1307, 0.3081)).x(ids)[:, 0])
    # the default transform is no transform
    torch.testing.assert_close(_gray(TransformConfig()).x(ids), plain.x(ids))


def test_transform_on_rgb_images_only_normalises(fed_data):
    rgb = FederatedData(**{f: getattr(fed_data, f) for f in ("images", "labels", "num_classes", "global_test",
                                                             "client_train", "client_test", "train_hist", "device")},
                        transform=TransformConfig(channels=3, normalize="imagenet"))
    assert rgb.in_channels == 3
    ids = torch.arange(4)
    x = rgb.x(ids)
    v = fed_data.images[ids].float() / 255
    torch.testing.assert_close(x[:, 1], (v[:, 1] - 0.456) / 0.224)


def test_transform_errors_name_the_key():
    with pytest.raises(ParamsError, match=r"train\.transform\.normalize=imagenet needs 3-channel input.*"
                                          r"train\.transform\.channels: 3"):
        _gray(TransformConfig(normalize="imagenet"))
    vec = torch.zeros(2, 5)
    one = torch.tensor([0, 1])
    with pytest.raises(ParamsError, match=r"train\.transform=.*vector samples"):
        FederatedData(images=vec, labels=one, num_classes=2, global_test=one, client_train=[one], client_test=[one],
                      train_hist=torch.ones(1, 2), device=torch.device("cpu"), transform=TransformConfig(channels=3))
    with pytest.raises(ParamsError, match=r"train\.transform\.channels: Input should be 3"):
        validate_params({"train": {"transform": {"channels": 1}}})
    with pytest.raises(ParamsError, match=r"train\.transform\.normalise: unknown key"):
        validate_params({"train": {"transform": {"normalise": "imagenet"}}})
    with pytest.raises(ParamsError, match=r"method_params\.vit\.train\.transform\.normalize"):
        validate_params({"methods": ["vit"], "method_params": {"vit": {"algorithm": "fedavg", "train": {
            "transform": {"normalize": "cifar"}}}}})


def test_transform_is_part_of_the_train_job_only_when_set():
    base = {"methods": ["fedavg", "fedavg-vit"], "partitions": [{"name": "d"}],
            "method_params": {"fedavg-vit": {"algorithm": "fedavg", "train": {
                "transform": {"channels": 3, "normalize": "imagenet"}}}}}
    p = validate_params(base)
    assert "transform" not in train_job(p, "bloodmnist", "d", "fedavg", 1)["train"]
    assert train_job(p, "bloodmnist", "d", "fedavg-vit", 1)["train"]["transform"] == {"channels": 3,
                                                                                      "normalize": "imagenet"}
    assert "transform" not in TrainConfig().model_dump()
    assert "pool" not in train_job(p, "bloodmnist", "d", "fedavg", 1)
    p2 = validate_params({**base, "partitions": [{"name": "d", "pool": "all"}]})
    assert train_job(p2, "bloodmnist", "d", "fedavg", 1)["pool"] == "all"


# ----------------------------------------------------------------------------- the stages


def test_fhbench_partition_stage_and_a_training_job(tmp_path):
    """The partition stage (``medpfl partition``) with pool all, data_fraction, dirichlet_pairs and
    the ratios rule on a tiny 1-channel synthetic set; the table, client_stats.json (with val
    counts) and the heat map; then one training round with ``channels: 3`` + ImageNet
    normalisation: a 3-channel model, no global test view, every client scored on its local test."""
    from medpfl.data.preprocess import load_processed, preprocess
    from medpfl.data.synthetic import write_synthetic_npz
    from medpfl.io import md5sum, read_parquet
    from medpfl.train import run_training

    d = tmp_path
    write_synthetic_npz(d / "g.npz", num_classes=4, n_channels=1, size=28, counts=(240, 40, 120), seed=3)
    preprocess(d / "g.npz", d / "arrays.npz", d / "samples.parquet", 4, 1)
    params = validate_params({
        "data": {"datasets": ["gray"], "custom": {"gray": {"path": str(d / "g.npz"), "md5": md5sum(d / "g.npz"),
                                                          "n_channels": 1, "num_classes": 4}}},
        "partitions": [{"name": "fh", "scheme": "dirichlet_pairs", "num_clients": 4, "alpha": 0.5, "pool": "all",
                        "data_fraction": 0.5, "seed": 2025,
                        "local_test": {"rule": "ratios", "ratios": [0.4, 0.3, 0.3]}}],
        "methods": ["fedavg"], "seeds": [1],
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "participation": 1.0, "checkpoint_every": 0,
                  "executor": "sequential", "device": "cpu", "transform": {"channels": 3, "normalize": "imagenet"}},
    })
    job = {"dataset": "gray", "name": "fh", "config": params.partitions["fh"].job_dict()}
    out = d / "part"
    assert main(["partition", "--job", json.dumps(job), "--arrays", str(d / "arrays.npz"),
                 "--samples", str(d / "samples.parquet"), "--out-dir", str(out)]) == 0
    table = read_parquet(out / "partition.parquet")
    validate(PartitionTable, table, "t")
    assert len(table) == 200 and table.groupby("client_id").size().tolist() == [50] * 4  # int(0.5*400)/4
    assert set(table["local_split"]) == {"train", "test", "val"}
    stats = json.loads((out / "client_stats.json").read_text())
    assert stats["config"]["pool"] == "all" and stats["config"]["local_test"]["ratios"] == [0.4, 0.3, 0.3]
    assert all(set(c) == {"train", "test", "val"} for c in stats["clients"].values())
    assert sum(sum(sum(c[s]) for s in c) for c in stats["clients"].values()) == 200
    fig = d / "fig" / "heatmap.png"
    assert main(["partition-figure", "--stats", str(out / "client_stats.json"), "--out", str(fig)]) == 0
    assert fig.stat().st_size > 0

    tjob = train_job(params, "gray", "fh", "fedavg", 1)
    assert tjob["pool"] == "all" and tjob["train"]["transform"] == {"channels": 3, "normalize": "imagenet"}
    run_training(tjob, d / "arrays.npz", d / "samples.parquet", out / "partition.parquet", d / "run")
    rec = read_parquet(d / "run" / "records.parquet")
    assert "global_test" not in set(rec["view"])
    local = rec[rec["view"] == "global_on_local"]
    sizes = table[table["local_split"] == "test"].groupby("client_id").size()
    assert local.set_index("client_id")["n_samples"].sort_index().tolist() == sizes.sort_index().tolist()
    model = torch.load(d / "run" / "final_model.pt", weights_only=False)
    first = next(v for v in model["global"].values() if v.dim() == 4)
    assert first.shape[1] == 3  # the model was built for 3 input channels
    data = load_processed(d / "arrays.npz", d / "samples.parquet")
    assert data.images.shape[1] == 1  # the stored images stay 1-channel


@pytest.mark.slow
def test_snakemake_data_stage_with_the_fhbench_partition(tmp_path):
    """``snakemake data_all`` (download, preprocess, partition, heat map; about 10 s) on the tiny
    synthetic study with a partition of the FHBench kind: pool all, data_fraction, dirichlet_pairs
    and the 4:3:3 ratios rule."""
    from helpers import job_stats, make_env, snakemake, tiny_params, write_params, write_synthetic

    from medpfl.io import read_parquet

    params = tiny_params(write_synthetic(tmp_path / "synth.npz"))
    params["partitions"] = {"fh": {"scheme": "dirichlet_pairs", "num_clients": 4, "alpha": 0.5, "pool": "all",
                                   "data_fraction": 0.5, "seed": 2025,
                                   "local_test": {"rule": "ratios", "ratios": [0.4, 0.3, 0.3]}}}
    write_params(tmp_path, params)
    proc = snakemake(tmp_path, "data_all", env=make_env(tmp_path))
    assert job_stats(proc.stdout) == {"download": 1, "preprocess": 1, "partition": 1, "partition_figure": 1,
                                      "data_all": 1}
    out = tmp_path / "data" / "partitions" / "synth" / "fh"
    table = read_parquet(out / "partition.parquet")
    samples = read_parquet(tmp_path / "data" / "processed" / "synth.samples.parquet")
    assert set(table["local_split"]) == {"train", "test", "val"}
    assert len(table) == 4 * int(int(0.5 * len(samples)) / 4)  # equal blocks of int(N/K)
    assert set(samples.set_index("sample_id").loc[table["sample_id"], "split"]) == {"train", "val", "test"}
    stats = json.loads((out / "client_stats.json").read_text())
    assert all(set(c) == {"train", "test", "val"} for c in stats["clients"].values())
    assert (tmp_path / "data" / "figures" / "synth" / "fh" / "heatmap.png").stat().st_size > 0


@pytest.mark.parametrize("transform,norm", [(None, None), (None, (0.1307, 0.3081)),
                                            (TransformConfig(channels=3), None),
                                            (TransformConfig(channels=3, normalize="imagenet"), None)])
def test_precomputed_float_images_equal_batch_time_normalisation(monkeypatch, transform, norm):
    """Below FLOAT_CACHE_MAX_BYTES the normalised images are computed once; above it, per batch.
    Both give the same float32 values bit for bit, for every transform and index shape."""
    import medpfl.fl.data as fdmod

    cached = _gray(transform, norm)
    monkeypatch.setattr(fdmod, "FLOAT_CACHE_MAX_BYTES", 0)
    per_batch = _gray(transform, norm)
    assert cached._float is not None and per_batch._float is None
    for ids in (torch.tensor([1, 0, 1]), torch.tensor([[0, 1], [1, 1]]), torch.tensor(1)):
        a, b = cached.x(ids), per_batch.x(ids)
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b)
    # a batch is a new tensor: writing to it leaves the stored copy alone
    x = cached.x(torch.tensor([0]))
    x.zero_()
    assert torch.equal(cached.x(torch.tensor([0])), per_batch.x(torch.tensor([0])))
