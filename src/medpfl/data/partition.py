"""Partitioners: split a data set's official train split over K clients, then each client's
share into local train and local test.

One class per scheme (``DirichletPartitioner``, ``IIDPartitioner``,
``PathologicalPartitioner``), each seeded, each returning a list of K index arrays into the
label vector it was given. All draws come from one ``numpy.random.RandomState(seed)`` that
continues into the local train/test split, which reproduces the FedKPer authors' partition
exactly (``docs/fedkper.md``; client sizes 335, 161, 797, ... on BloodMNIST, K=20, alpha 0.1,
seed 1).

Errors: :class:`PartitionError` (a ``ValueError``) whose message names the params key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from medpfl.config import LocalTestConfig, PartitionConfig
from medpfl.data.schemas import PartitionTable, validate


class PartitionError(ValueError):
    """The partition cannot be built with these parameters; the message names the key."""


@dataclass
class DirichletPartitioner:
    """Label-skew partition: for each class c (in sorted order), shuffle its samples and draw
    proportions ``p ~ Dir(alpha * 1_K)`` over clients, then cut the class at
    ``cumsum(p) * n_c`` (Hsu et al. 2019, "Measuring the effects of non-identical data
    distribution"; NIID-Bench/MOON "hetero-dir").

    self_balancing: zero ``p_j`` for any client already holding ``>= N/K`` samples before
    renormalising (the FedKPer/MOON code; flwr-datasets calls it ``self_balancing``).
    The whole draw is repeated until every client holds at least ``min_samples`` samples,
    at most ``max_draws`` times. Each client's index list is shuffled at the end.
    """

    num_clients: int
    alpha: float
    min_samples: int = 10
    self_balancing: bool = True
    max_draws: int = 1000
    key: str = "partitions.<name>"

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """labels: int [N] class of each pool sample. Returns K arrays of positions into ``labels``."""
        if not self.alpha > 0:
            raise PartitionError(f"{self.key}.alpha must be > 0, got {self.alpha}")
        n, k = len(labels), self.num_clients
        _check_size(n, k, self.min_samples, self.key)
        classes = np.unique(labels)
        for _ in range(self.max_draws):
            batches: list[list[int]] = [[] for _ in range(k)]
            degenerate = False
            for c in classes:
                idx_c = np.where(labels == c)[0]
                rng.shuffle(idx_c)
                p = rng.dirichlet(np.repeat(self.alpha, k))
                if self.self_balancing:
                    p = np.array([pj * (len(b) < n / k) for pj, b in zip(p, batches)])
                total = p.sum()
                if not np.isfinite(total) or total <= 0:
                    # a tiny alpha can underflow to NaN, or put all mass on capped clients:
                    # count the draw as failed instead of handing the class to the last client
                    degenerate = True
                    break
                p = p / total
                cuts = (np.cumsum(p) * len(idx_c)).astype(int)[:-1]
                batches = [b + part.tolist() for b, part in zip(batches, np.split(idx_c, cuts))]
            if not degenerate and min(len(b) for b in batches) >= self.min_samples:
                break
        else:
            raise PartitionError(
                f"{self.key}: no Dirichlet draw gave every one of {k} clients at least min_samples={self.min_samples} "
                f"samples in {self.max_draws} tries (N={n}, alpha={self.alpha}); raise {self.key}.alpha, lower "
                f"{self.key}.min_samples or {self.key}.num_clients"
            )
        out = []
        for b in batches:
            arr = np.array(b, dtype=np.int64)
            rng.shuffle(arr)
            out.append(arr)
        return out


@dataclass
class IIDPartitioner:
    """Uniform random split into K parts whose sizes differ by at most one."""

    num_clients: int
    min_samples: int = 1
    key: str = "partitions.<name>"

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        _check_size(len(labels), self.num_clients, self.min_samples, self.key)
        perm = rng.permutation(len(labels)).astype(np.int64)
        return [np.asarray(p) for p in np.array_split(perm, self.num_clients)]


@dataclass
class PathologicalPartitioner:
    """Each client holds ``classes_per_client`` classes (McMahan et al. 2017, "pathological
    non-IID"). Classes are dealt round-robin over a shuffled class order, so every class is
    held by about ``K * k / C`` clients; each class's shuffled samples are split evenly among
    its holders."""

    num_clients: int
    classes_per_client: int
    min_samples: int = 1
    key: str = "partitions.<name>"

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        classes = np.unique(labels)
        k, cpc = self.num_clients, self.classes_per_client
        if cpc > len(classes):
            raise PartitionError(f"{self.key}.classes_per_client={cpc} exceeds the {len(classes)} classes in the data")
        if k * cpc < len(classes):
            raise PartitionError(f"{self.key}: num_clients x classes_per_client = {k * cpc} client slots cannot hold all "
                                 f"{len(classes)} classes; raise {self.key}.num_clients or {self.key}.classes_per_client")
        _check_size(len(labels), k, self.min_samples, self.key)
        order = rng.permutation(classes)
        holders: dict[int, list[int]] = {int(c): [] for c in classes}
        for client in range(k):
            for j in range(cpc):
                holders[int(order[(client * cpc + j) % len(order)])].append(client)
        parts: list[list[int]] = [[] for _ in range(k)]
        for c in classes:
            idx_c = np.where(labels == c)[0]
            rng.shuffle(idx_c)
            owners = holders[int(c)]
            for owner, chunk in zip(owners, np.array_split(idx_c, len(owners))):
                parts[owner].extend(chunk.tolist())
        out = [np.array(p, dtype=np.int64) for p in parts]
        small = [i for i, p in enumerate(out) if len(p) < self.min_samples]
        if small:
            raise PartitionError(f"{self.key}: clients {small} hold fewer than min_samples={self.min_samples} samples; "
                                 f"lower {self.key}.num_clients")
        for p in out:
            rng.shuffle(p)
        return out


def _check_size(n: int, k: int, min_samples: int, key: str) -> None:
    if k > n:
        raise PartitionError(f"{key}.num_clients={k} exceeds the {n} samples of the train split")
    if k * min_samples > n:
        raise PartitionError(f"{key}: {k} clients x min_samples={min_samples} needs {k * min_samples} samples, "
                             f"the train split has {n}; lower {key}.num_clients or {key}.min_samples")


def make_partitioner(cfg: PartitionConfig, key: str):
    if cfg.scheme == "dirichlet":
        return DirichletPartitioner(cfg.num_clients, cfg.alpha, cfg.min_samples, cfg.self_balancing, cfg.max_draws, key)
    if cfg.scheme == "iid":
        return IIDPartitioner(cfg.num_clients, cfg.min_samples, key)
    return PathologicalPartitioner(cfg.num_clients, cfg.classes_per_client, cfg.min_samples, key)


def split_local(clients: list[np.ndarray], labels: np.ndarray, cfg: LocalTestConfig, rng: np.random.RandomState,
                key: str = "partitions.<name>.local_test") -> list[tuple[np.ndarray, np.ndarray]]:
    """Split each client's positions into ``(local train, local test)``.

    Rules (``cfg.rule``):
      stratified: per class, ``round(fraction * n_kc)`` to test; if that gives no test sample,
        one sample of the client's largest class goes to test.
      random: ``max(1, int(fraction * n_k))`` uniformly random samples to test.
      fedkper: the authors' ``create_local``: ``m = int(fraction * n_k)``; per present class
        (sorted) draw ``int(m / |classes|)`` without replacement, or ``int(fraction * n_kc)``
        when the class is smaller than that; if nothing was drawn, a random ``int(fraction*n_k)``.
        The local train set keeps the client's order.

    Raises PartitionError naming ``key`` when a client would have no test or no train sample.
    """
    out = []
    for cid, idx in enumerate(clients):
        y = labels[idx]
        if cfg.rule == "fedkper":
            test = _fedkper_test(idx, y, cfg.fraction, rng)
        elif cfg.rule == "random":
            m = max(1, int(cfg.fraction * len(idx)))
            test = rng.choice(idx, size=m, replace=False) if len(idx) > 1 else idx[:0]
        else:
            picks = []
            for c in np.unique(y):
                members = idx[y == c]
                m = int(round(cfg.fraction * len(members)))
                if m:
                    picks.append(rng.choice(members, size=m, replace=False))
            test = np.concatenate(picks) if picks else idx[:0]
            if len(test) == 0 and len(idx) > 1:
                counts = np.bincount(y)
                members = idx[y == np.argmax(counts)]
                test = rng.choice(members, size=1, replace=False)
        test = np.asarray(test, dtype=np.int64)
        train = idx[~np.isin(idx, test)]
        if len(test) == 0:
            raise PartitionError(f"{key}: client {cid} ({len(idx)} samples) gets no local test sample with "
                                 f"rule={cfg.rule!r}, fraction={cfg.fraction}; raise the partition's min_samples or the fraction")
        if len(train) == 0:
            raise PartitionError(f"{key}: client {cid} ({len(idx)} samples) gets no local train sample; lower the fraction")
        out.append((train, test))
    return out


def _fedkper_test(idx: np.ndarray, y: np.ndarray, fraction: float, rng: np.random.RandomState) -> np.ndarray:
    m = int(len(idx) * fraction)
    present = np.unique(y)
    per_class = int(m / len(present))
    picks = []
    for c in present:
        members = idx[np.where(y == c)]
        try:
            picks.append(rng.choice(members, size=per_class, replace=False))
        except ValueError:  # class smaller than per_class: take fraction of it instead
            picks.append(rng.choice(members, size=int(fraction * len(members)), replace=False))
    test = np.concatenate(picks) if picks else np.array([], dtype=np.int64)
    if len(test) == 0:
        test = rng.choice(idx, size=int(fraction * len(idx)), replace=False)
    return test.astype(np.int64)


def build_partition(pool_ids: np.ndarray, pool_labels: np.ndarray, cfg: PartitionConfig, name: str = "<name>") -> pd.DataFrame:
    """Partition the official train pool and split each client; return the validated table.

    pool_ids: int64 [N] sample ids of the official train split; pool_labels: int64 [N].
    Returns a :class:`PartitionTable` frame (sample_id, client_id, local_split, label),
    one row per pool sample, sorted by client then split.
    """
    key = f"partitions.{name}"
    rng = np.random.RandomState(cfg.seed)
    clients = make_partitioner(cfg, key).partition(pool_labels, rng)
    splits = split_local(clients, pool_labels, cfg.local_test, rng, key=f"{key}.local_test")
    rows = []
    for cid, (train, test) in enumerate(splits):
        for part, pos in (("train", train), ("test", test)):
            rows.append(pd.DataFrame({"sample_id": pool_ids[pos], "client_id": cid, "local_split": part,
                                      "label": pool_labels[pos]}))
    table = pd.concat(rows, ignore_index=True)
    table = validate(PartitionTable, table, f"partition {name}")
    if len(table) != len(pool_ids):
        raise PartitionError(f"{key}: {len(table)} of {len(pool_ids)} train samples were assigned (internal error)")
    return table


def client_class_counts(table: pd.DataFrame, num_classes: int) -> dict:
    """Per-client class counts of local train and local test: ``{client: {"train": [C], "test": [C]}}``."""
    out = {}
    for cid, grp in table.groupby("client_id", sort=True):
        out[int(cid)] = {
            split: np.bincount(grp.loc[grp["local_split"] == split, "label"], minlength=num_classes).tolist()
            for split in ("train", "test")
        }
    return out
