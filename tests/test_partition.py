"""Tests of medpfl.data.partition: the three partition schemes, the local train/test rules, and the
FedKPer BloodMNIST partition against the sizes an independent re-implementation of the authors'
code gave (../shared/docs/fedkper-protocol.md section 2; not checked against the authors' own
index files)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from medpfl.compose import validate_params
from medpfl.config import LocalTestConfig, ParamsError, PartitionConfig, partition_config
from medpfl.data.partition import (
    DirichletPartitioner,
    IIDPartitioner,
    PartitionError,
    PathologicalPartitioner,
    build_partition,
    client_class_counts,
    split_local,
    stratified_test_count,
)
from medpfl.data.schemas import PartitionTable, TableError, validate

BLOOD = Path("/work/shared/data/medmnist/bloodmnist.npz")
NUM_CLASSES = 8
CLASS_SIZES = [400, 300, 300, 250, 250, 200, 200, 100]  # N = 2000, imbalanced like real medical sets


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """Labels of a synthetic train pool, grouped by class then shuffled."""
    y = np.repeat(np.arange(NUM_CLASSES), CLASS_SIZES).astype(np.int64)
    return np.random.default_rng(123).permutation(y)


@pytest.fixture(scope="module")
def pool_ids(labels) -> np.ndarray:
    """Sample ids that are NOT positions (offset and shuffled), so id/position confusion shows."""
    return (np.random.default_rng(7).permutation(len(labels)) + 5000).astype(np.int64)


SCHEME_CFGS = {
    "dirichlet": dict(scheme="dirichlet", num_clients=10, alpha=0.3, min_samples=20, seed=3),
    "dirichlet_nobal": dict(scheme="dirichlet", num_clients=10, alpha=0.3, self_balancing=False, min_samples=5, seed=3),
    "iid": dict(scheme="iid", num_clients=7, seed=3),
    "pathological": dict(scheme="pathological", num_clients=10, classes_per_client=2, seed=3),
}
RULES = ["stratified", "random", "fedkper"]


def _cfg(scheme: str, rule: str = "stratified", **kw) -> PartitionConfig:
    d = dict(SCHEME_CFGS[scheme])
    d.update(kw)
    return partition_config(**d, local_test={"rule": rule})


# ----------------------------------------------------------------------------- whole partition


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("scheme", list(SCHEME_CFGS))
def test_every_sample_assigned_exactly_once(scheme, rule, labels, pool_ids):
    cfg = _cfg(scheme, rule)
    table = build_partition(pool_ids, labels, cfg, name="p")
    assert list(table.columns) == ["sample_id", "client_id", "local_split", "label"]
    # exactly once: one row per pool id, no duplicates, no strangers
    assert len(table) == len(pool_ids)
    assert table["sample_id"].is_unique
    assert set(table["sample_id"]) == set(pool_ids.tolist())
    # the label column is the label of that sample id (ids are not positions)
    id_to_label = dict(zip(pool_ids.tolist(), labels.tolist()))
    assert table["label"].tolist() == [id_to_label[s] for s in table["sample_id"]]
    # every client exists with both a train and a test part
    assert sorted(table["client_id"].unique()) == list(range(cfg.num_clients))
    per = table.groupby(["client_id", "local_split"]).size().unstack(fill_value=0)
    assert (per["train"] > 0).all() and (per["test"] > 0).all()
    assert set(table["local_split"]) == {"train", "test"}
    # the table passes its own schema
    validate(PartitionTable, table, "t")


@pytest.mark.parametrize("scheme", list(SCHEME_CFGS))
def test_same_seed_same_table_different_seed_different_table(scheme, labels, pool_ids):
    a = build_partition(pool_ids, labels, _cfg(scheme))
    b = build_partition(pool_ids, labels, _cfg(scheme))
    pd.testing.assert_frame_equal(a, b)
    c = build_partition(pool_ids, labels, _cfg(scheme, seed=4))
    key = ["sample_id", "client_id", "local_split"]
    assert not a[key].reset_index(drop=True).equals(c[key].reset_index(drop=True))
    # and the assignment itself differs, not just the row order
    ma = a.set_index("sample_id")["client_id"].sort_index()
    mc = c.set_index("sample_id")["client_id"].sort_index()
    assert (ma != mc).any()


def _skew(parts: list[np.ndarray], labels: np.ndarray) -> tuple[float, float]:
    """(mean max-class share, mean normalised label entropy) over clients."""
    shares, ents = [], []
    for p in parts:
        q = np.bincount(labels[p], minlength=NUM_CLASSES) / len(p)
        shares.append(q.max())
        nz = q[q > 0]
        ents.append(float(-(nz * np.log(nz)).sum() / np.log(NUM_CLASSES)))
    return float(np.mean(shares)), float(np.mean(ents))


def test_smaller_alpha_gives_more_label_skew(labels):
    stats = {}
    for alpha in (0.05, 1.0, 100.0):
        per_seed = [_skew(DirichletPartitioner(10, alpha, min_samples=10).partition(labels, np.random.RandomState(s)),
                          labels) for s in range(5)]
        stats[alpha] = np.mean(per_seed, axis=0)
    share = {a: s[0] for a, s in stats.items()}
    ent = {a: s[1] for a, s in stats.items()}
    assert share[0.05] > share[1.0] > share[100.0]
    assert ent[0.05] < ent[1.0] < ent[100.0]
    # alpha 0.05: clients are dominated by one class; alpha 100: close to the pool's proportions
    assert share[0.05] > 0.7
    assert ent[100.0] > 0.9
    assert share[100.0] == pytest.approx(max(CLASS_SIZES) / sum(CLASS_SIZES), abs=0.05)


@pytest.mark.parametrize("make", [lambda: DirichletPartitioner(10, 1.0), lambda: PathologicalPartitioner(10, 3)])
def test_client_index_lists_are_shuffled(labels, make):
    # samples are dealt class by class; each client's list is shuffled at the end, so its
    # labels are not grouped in class order
    sl = np.sort(labels)
    parts = make().partition(sl, np.random.RandomState(0))
    multi = [p for p in parts if len(np.unique(sl[p])) > 1]
    assert multi
    for p in multi:
        assert np.any(np.diff(sl[p]) < 0)


def test_iid_has_no_label_skew_and_equal_sizes(labels):
    parts = IIDPartitioner(7).partition(labels, np.random.RandomState(0))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(labels)
    share, ent = _skew(parts, labels)
    assert ent > 0.9


@pytest.mark.parametrize("alpha,min_samples", [(0.1, 1), (0.1, 60), (1.0, 150)])
def test_dirichlet_min_samples_respected(labels, alpha, min_samples):
    for seed in range(3):
        parts = DirichletPartitioner(10, alpha, min_samples=min_samples).partition(labels, np.random.RandomState(seed))
        assert min(len(p) for p in parts) >= min_samples
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))


def test_dirichlet_gives_up_after_max_draws_with_clear_message(labels):
    p = DirichletPartitioner(10, 0.01, min_samples=190, max_draws=3, key="partitions.tight")
    with pytest.raises(PartitionError, match=r"partitions\.tight") as e:
        p.partition(labels, np.random.RandomState(0))
    assert "min_samples=190" in str(e.value) and "3 tries" in str(e.value)


@pytest.mark.parametrize("scheme", ["iid", "pathological"])
def test_other_schemes_min_samples_respected(labels, scheme):
    ms = {"iid": 100, "pathological": 30}[scheme]
    cfg = _cfg(scheme, min_samples=ms)
    table = build_partition(np.arange(len(labels)), labels, cfg)
    assert table.groupby("client_id").size().min() >= ms
    # pathological raises when a client would fall below it
    if scheme == "pathological":
        with pytest.raises(PartitionError, match="min_samples=150"):
            PathologicalPartitioner(10, 2, min_samples=150, key="partitions.x").partition(labels, np.random.RandomState(3))


def _cap_violations(parts, labels, n, k):
    """(client, class, count) where the client already held >= N/K samples before that class
    (classes are dealt in sorted order) yet received samples of it."""
    out = []
    for j, p in enumerate(parts):
        counts = np.bincount(labels[p], minlength=NUM_CLASSES)
        before = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for c in np.nonzero((before >= n / k) & (counts > 0))[0]:
            out.append((j, int(c), int(counts[c])))
    return out


def test_self_balancing_stops_filling_a_client_at_n_over_k(labels):
    n, k = len(labels), 10
    nobal = []
    for seed in range(10):
        parts = DirichletPartitioner(k, 0.1, min_samples=1, self_balancing=True).partition(labels, np.random.RandomState(seed))
        # Once a client holds >= N/K it receives no further class. The only leak is the
        # authors' cut arithmetic: int(cumsum(p)[-2] * n_c) can round 1 - eps down, handing the
        # last client (index K-1) a single sample of a class its zeroed weight should exclude.
        for client, _c, count in _cap_violations(parts, labels, n, k):
            assert client == k - 1 and count == 1
        # hence no client exceeds N/K by more than one class's worth (plus those single leaks)
        assert max(len(p) for p in parts) < n / k + max(CLASS_SIZES) + NUM_CLASSES
        parts = DirichletPartitioner(k, 0.1, min_samples=1, self_balancing=False).partition(labels, np.random.RandomState(seed))
        nobal += _cap_violations(parts, labels, n, k)
    # without the cap, clients past N/K keep receiving whole chunks of later classes
    assert any(count > 1 for _, _, count in nobal)


def test_tiny_alpha_draws_stay_finite():
    y = np.repeat(np.arange(8), 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts = DirichletPartitioner(10, 1e-3, min_samples=1).partition(y, np.random.RandomState(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(y)))


def test_pathological_clients_hold_classes_per_client_classes(labels):
    parts = PathologicalPartitioner(10, 3).partition(labels, np.random.RandomState(0))
    for p in parts:
        assert len(np.unique(labels[p])) == 3
    holders = [sum(int(c in set(labels[p].tolist())) for p in parts) for c in range(NUM_CLASSES)]
    # 30 class slots dealt round-robin over 8 classes: every class held by 3 or 4 clients
    assert sorted(set(holders)) <= [3, 4] and sum(holders) == 30


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan")])
def test_dirichlet_rejects_nonpositive_alpha(labels, alpha):
    with pytest.raises(PartitionError, match=r"partitions\.dir0\.1\.alpha must be > 0"):
        DirichletPartitioner(10, alpha, key="partitions.dir0.1").partition(labels, np.random.RandomState(0))


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_config_rejects_nonpositive_alpha(alpha):
    with pytest.raises(ValidationError, match=r"alpha\n.*must be > 0"):
        partition_config(alpha=alpha)
    with pytest.raises(ParamsError) as e:
        validate_params({"partitions": {"dirx": {"alpha": alpha}}}, "p.yaml")
    msg = str(e.value)
    assert "p.yaml" in msg and "partitions.dirx" in msg and "alpha" in msg


@pytest.mark.parametrize("make", [
    lambda: DirichletPartitioner(50, 1.0, min_samples=1, key="partitions.k"),
    lambda: IIDPartitioner(50, key="partitions.k"),
    lambda: PathologicalPartitioner(50, 1, key="partitions.k"),
])
def test_more_clients_than_samples(make):
    y = np.arange(20) % 4
    with pytest.raises(PartitionError, match=r"partitions\.k\.num_clients=50 exceeds the 20 samples"):
        make().partition(y, np.random.RandomState(0))


@pytest.mark.parametrize("make", [
    lambda: DirichletPartitioner(10, 1.0, min_samples=30, key="partitions.k"),
    lambda: IIDPartitioner(10, min_samples=30, key="partitions.k"),
    lambda: PathologicalPartitioner(10, 2, min_samples=30, key="partitions.k"),
])
def test_clients_times_min_samples_exceeds_n(make):
    y = np.arange(200) % 4
    with pytest.raises(PartitionError, match=r"10 clients x min_samples=30 needs 300 samples.*has 200") as e:
        make().partition(y, np.random.RandomState(0))
    assert "partitions.k.min_samples" in str(e.value)


def test_classes_per_client_exceeds_classes(labels):
    with pytest.raises(PartitionError, match=r"partitions\.path\.classes_per_client=9 exceeds the 8 classes"):
        PathologicalPartitioner(4, 9, key="partitions.path").partition(labels, np.random.RandomState(0))


def test_pathological_config_requires_classes_per_client():
    with pytest.raises(ValidationError, match=r"classes_per_client\n.*is required"):
        partition_config(scheme="pathological")


def test_pathological_with_too_few_slots_raises_partition_error(labels):
    # 3 clients x 2 classes cover only 6 of the 8 classes: some samples cannot be assigned.
    cfg = partition_config(scheme="pathological", num_clients=3, classes_per_client=2, min_samples=1)
    with pytest.raises(PartitionError):
        build_partition(np.arange(len(labels)), labels, cfg, name="path")


def test_pathological_with_too_few_slots_names_the_keys(labels):
    cfg = partition_config(scheme="pathological", num_clients=3, classes_per_client=2, min_samples=1)
    with pytest.raises(PartitionError, match="classes_per_client") as e:
        build_partition(np.arange(len(labels)), labels, cfg, name="path")
    assert "internal error" not in str(e.value)


# ----------------------------------------------------------------------------- local split rules


def _client(counts: dict[int, int], start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A hand-made client: positions start.. into a label vector with the given class counts."""
    y = np.concatenate([np.full(n, c) for c, n in counts.items()]).astype(np.int64)
    y = np.random.default_rng(start).permutation(y)
    # positions in a scrambled order (as partitioners return them), labels laid out to match
    idx = np.random.default_rng(start + 1).permutation(np.arange(start, start + len(y))).astype(np.int64)
    lab = np.empty(len(y), dtype=np.int64)
    lab[idx - start] = y
    return idx, lab


def _split(clients_counts: list[dict[int, int]], rule: str, fraction: float = 0.2, seed: int = 0):
    idxs, ys, start = [], [], 0
    for counts in clients_counts:
        idx, lab = _client(counts, start)
        idxs.append(idx)
        ys.append(lab)
        start += len(idx)
    labels = np.concatenate(ys)  # labels[position]
    out = split_local(idxs, labels, LocalTestConfig(fraction=fraction, rule=rule), np.random.RandomState(seed),
                      key="partitions.h.local_test")
    for idx, (train, test) in zip(idxs, out):
        assert len(np.intersect1d(train, test)) == 0
        assert sorted(np.concatenate([train, test]).tolist()) == sorted(idx.tolist())
        # local train keeps the client's (shuffled) order
        in_test = set(test.tolist())
        assert train.tolist() == [i for i in idx.tolist() if i not in in_test]
    return labels, out


def test_stratified_rule_takes_fraction_of_each_class():
    clients = [{0: 50, 1: 20, 2: 3}, {3: 120, 5: 41}, {4: 2}, {6: 1, 7: 1}, {2: 7}]
    labels, out = _split(clients, "stratified")
    for counts, (train, test) in zip(clients, out):
        assert len(test) >= 1 and len(train) >= 1
        tc = np.bincount(labels[test], minlength=NUM_CLASSES)
        for c, n in counts.items():
            if stratified_test_count(0.2, n) >= 1:
                assert tc[c] == stratified_test_count(0.2, n)
                assert abs(tc[c] - 0.2 * n) <= 0.5
    # hand-checked: 10 + 4 + 1; 24 + 8
    assert [len(t) for _, t in out[:2]] == [15, 32]
    # {4: 2} rounds to 0 test samples: one sample of its largest class goes to test
    assert len(out[2][1]) == 1 and len(out[2][0]) == 1
    # {6: 1, 7: 1} also rounds to 0 per class: still exactly one test sample
    assert len(out[3][1]) == 1
    # {2: 7}: 1.4 rounds to 1
    assert len(out[4][1]) == 1


@pytest.mark.parametrize("fraction, n, expected", [
    (0.25, 2, 1),    # 0.5 -> 1 (Python's round: 0)
    (0.25, 6, 2),    # 1.5 -> 2
    (0.25, 10, 3),   # 2.5 -> 3 (Python's round: 2)
    (0.25, 14, 4),   # 3.5 -> 4
    (0.5, 1, 1),     # 0.5 -> 1
    (0.5, 5, 3),     # 2.5 -> 3
    (0.1, 5, 1),     # 0.5 -> 1
    (0.1, 15, 2),    # 1.5 -> 2
    (0.29, 50, 15),  # 14.5 exactly on the decimal value (the float product is 14.4999...)
    (0.3, 5, 2),     # 1.5
    (0.2, 7, 1), (0.2, 8, 2), (0.25, 1, 0), (0.25, 3, 1), (0.2, 0, 0),  # not halves: nearest
])
def test_stratified_rule_rounds_half_up(fraction, n, expected):
    assert stratified_test_count(fraction, n) == expected


def test_stratified_split_half_cases():
    """Classes whose fraction * n is exactly a half get the larger count, in split_local itself."""
    clients = [{0: 2, 1: 6, 2: 10, 3: 14}, {4: 2}, {5: 1, 6: 3}]
    labels, out = _split(clients, "stratified", fraction=0.25)
    tc = [dict(enumerate(np.bincount(labels[test], minlength=NUM_CLASSES).tolist())) for _, test in out]
    assert {c: tc[0][c] for c in (0, 1, 2, 3)} == {0: 1, 1: 2, 2: 3, 3: 4}
    assert len(out[1][1]) == 1 and len(out[1][0]) == 1  # a class of 2 at 0.25: one test sample
    assert {c: tc[2][c] for c in (5, 6)} == {5: 0, 6: 1}  # 0.25 -> 0, 0.75 -> 1


def test_random_rule_size_and_coverage():
    clients = [{0: 50, 1: 20, 2: 3}, {3: 9}, {1: 2}]
    _, out = _split(clients, "random")
    assert [len(t) for _, t in out] == [int(0.2 * 73), max(1, int(0.2 * 9)), 1]
    # it is not per-class: over seeds, the test split of client 0 varies in its class mix
    mixes = set()
    for seed in range(10):
        labels, o = _split(clients[:1], "random", seed=seed)
        mixes.add(tuple(np.bincount(labels[o[0][1]], minlength=3)))
    assert len(mixes) > 1


def test_fedkper_rule_follows_create_local():
    clients = [
        {0: 70, 1: 25, 2: 5},   # m = 20, per_class = int(20/3) = 6; class 2 (5 < 6) gives int(0.2*5) = 1
        {0: 90, 1: 10},         # m = 20, per_class = 10; class 1 has exactly 10: all of it goes to test
        {3: 31, 4: 4, 5: 12},   # m = int(9.4) = 9, per_class = 3; all classes have >= 3
        {1: 40, 6: 2, 7: 1},    # m = 8, per_class = int(8/3) = 2; class 7 (1 < 2): int(0.2*1) = 0
        {c: 1 for c in range(8)} | {0: 2},  # 9 samples: m = 1, per_class = int(1/8) = 0; nothing drawn -> random int(1.8) = 1
        {2: 20},                # one class: m = 4, per_class = 4
    ]
    labels, out = _split(clients, "fedkper")
    expected = [
        {0: 6, 1: 6, 2: 1},
        {0: 10, 1: 10},
        {3: 3, 4: 3, 5: 3},
        {1: 2, 6: 2, 7: 0},
        None,
        {2: 4},
    ]
    for counts, exp, (train, test) in zip(clients, expected, out):
        tc = np.bincount(labels[test], minlength=NUM_CLASSES)
        if exp is None:
            assert len(test) == 1
            continue
        assert {c: int(tc[c]) for c in counts} == exp
        assert len(test) == sum(exp.values())
    # class 1 of client 1 is entirely in test (faithful to the authors' rule)
    assert np.bincount(labels[out[1][0]], minlength=2)[1] == 0


def test_split_local_errors_name_the_key():
    with pytest.raises(PartitionError, match=r"partitions\.h\.local_test: client 0 \(1 samples\) gets no local test"):
        _split([{0: 1}], "stratified")
    with pytest.raises(PartitionError, match=r"partitions\.h\.local_test: client 1 .*no local test"):
        _split([{0: 10}, {1: 4}], "fedkper")  # int(0.2*4) = 0 everywhere
    with pytest.raises(PartitionError, match=r"client 0 .*no local train sample"):
        _split([{0: 1, 1: 1}], "stratified", fraction=0.6)


def test_client_class_counts(labels, pool_ids):
    table = build_partition(pool_ids, labels, _cfg("dirichlet"))
    cc = client_class_counts(table, NUM_CLASSES)
    assert sorted(cc) == list(range(10))
    total = np.zeros(NUM_CLASSES, dtype=int)
    for cid, d in cc.items():
        sub = table[table.client_id == cid]
        assert sum(d["train"]) == (sub.local_split == "train").sum()
        assert sum(d["test"]) == (sub.local_split == "test").sum()
        total += np.array(d["train"]) + np.array(d["test"])
    assert total.tolist() == CLASS_SIZES


# ----------------------------------------------------------------------------- schema


def _good_table() -> pd.DataFrame:
    return pd.DataFrame({"sample_id": [0, 1, 2, 3], "client_id": [0, 0, 1, 1],
                         "local_split": ["train", "test", "train", "test"], "label": [1, 2, 1, 0]})


def test_partition_schema_accepts_good_and_rejects_bad_tables():
    validate(PartitionTable, _good_table(), "ok")
    dup = _good_table()
    dup.loc[3, "sample_id"] = 1
    with pytest.raises(TableError, match=r"(?s)part\.parquet.*sample_id.*uniqueness"):
        validate(PartitionTable, dup, "part.parquet")
    val = _good_table()
    val.loc[1, "local_split"] = "val"  # a local val split (the ratios rule) is a valid part
    validate(PartitionTable, val, "part.parquet")
    bad = _good_table()
    bad.loc[1, "local_split"] = "validation"
    with pytest.raises(TableError, match=r"(?s)local_split.*isin.*'train', 'test', 'val'.*validation"):
        validate(PartitionTable, bad, "part.parquet")
    extra = _good_table().assign(extra=1)
    with pytest.raises(TableError):
        validate(PartitionTable, extra, "part.parquet")


# ----------------------------------------------------------------------------- real BloodMNIST

# Client sizes (seed 1, K=20, alpha 0.1) from an independent re-implementation of the FedKPer
# authors' partition code (../shared/docs/fedkper-protocol.md section 2), not from their files.
AUTHORS_SIZES = [335, 161, 797, 1323, 1335, 857, 1312, 548, 642, 1189, 212, 329, 497, 171, 76, 20, 688, 1014, 378, 75]


@pytest.fixture(scope="module")
def blood_train_labels() -> np.ndarray:
    if not BLOOD.is_file():
        pytest.skip(f"{BLOOD} not present")
    with np.load(BLOOD) as z:
        return z["train_labels"][:, 0].astype(np.int64)


def test_matches_reimplemented_fedkper_bloodmnist_partition(blood_train_labels):
    y = blood_train_labels
    assert len(y) == 11959
    cfg = partition_config(num_clients=20, alpha=0.1, seed=1, local_test={"rule": "fedkper"})
    table = build_partition(np.arange(len(y), dtype=np.int64), y, cfg, name="dir0.1")
    assert table.groupby("client_id").size().tolist() == AUTHORS_SIZES
    tr = table[table.local_split == "train"].groupby("client_id").size()
    te = table[table.local_split == "test"].groupby("client_id").size()
    assert (tr.min(), tr.max()) == (18, 1210)
    assert (te.min(), te.max()) == (2, 266)
    assert te[15] == 2 and tr[15] == 18
    for cid in (2, 16):
        assert table.loc[table.client_id == cid, "label"].unique().tolist() == [1]
    # the same seed with the stratified rule keeps the client assignment (same partition draw)
    strat = build_partition(np.arange(len(y), dtype=np.int64), y, cfg.model_copy(update={"local_test": LocalTestConfig()}))
    assert strat.groupby("client_id").size().tolist() == AUTHORS_SIZES
