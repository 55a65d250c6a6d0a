"""Partitioners: split a data set's official train split over K clients, then each client's
share into local train and local test.

One class per scheme on the common base :class:`Partitioner` (``DirichletPartitioner``,
``IIDPartitioner``, ``PathologicalPartitioner``, ``ShardsPartitioner``,
``PerClientDirichletPartitioner``, ``PairwiseDirichletPartitioner``, ``NaturalPartitioner``,
``SubjectPartitioner``),
registered by scheme name in :data:`PARTITIONERS` and built from the scheme's config class
(:mod:`medpfl.config`, ``PARTITION_CONFIGS``) by :meth:`Partitioner.from_config`; each drawing
partitioner is seeded and returns a list of K index arrays into the label vector it was given
(:meth:`Partitioner.partition`). :func:`build_partition` holds what every scheme shares: the
server data, the pool's ``data_fraction`` draw, the local split (:meth:`Partitioner.client_splits`)
and the table checks. The pool is the official train split, or with ``pool: all``
every split (:func:`partition_pool`); ``data_fraction`` draws a seeded subset of it first. All draws
come from one ``numpy.random.RandomState(seed)`` that continues into the local train/test
split, in the order of the FedKPer authors' code as read in
``../shared/docs/fedkper-protocol.md`` §2 (the ``dirichlet`` scheme and the ``fedkper`` local
rule; see also ``docs/methods.md``). With BloodMNIST, K=20, alpha 0.1, seed 1 it gives the
client sizes 335, 161, 797, ... that an independent re-implementation of that code gave
(``tests/test_partition.py``); it has not been compared with index files written by the
authors' own code. The ``natural`` scheme draws nothing: it takes the clients and local splits
a generated federated data set carries.

The schemes ``dirichlet``, ``iid``, ``pathological``, ``shards`` and ``dirichlet_pairs`` are
disjoint (every pool sample goes to at most one client, and to exactly one except the fewer
than K that ``dirichlet_pairs``' equal blocks leave out; the table is checked against
:class:`PartitionTable`).
``per_client_dirichlet`` samples each client from the whole pool, so a sample may belong to
several clients (never twice to one); its table is checked against
:class:`SharedPartitionTable`. The local rule ``official_test`` (:func:`split_official_test`)
draws each client's local test split from the official test split instead of its own share,
so its table also holds official-test sample ids. The local rule ``ratios``
(:func:`split_ratios`) adds a third local split, ``val``.

Errors: :class:`PartitionError` (a ``ValueError``) whose message names the params key.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import numpy as np
import pandas as pd

from medpfl.config import (DirichletPairsPartitionConfig, DirichletPartitionConfig, IIDPartitionConfig, LocalTestConfig,
                           NaturalPartitionConfig, PartitionConfigBase, PathologicalPartitionConfig,
                           PerClientDirichletPartitionConfig, ServerDataConfig, ShardsPartitionConfig,
                           SubjectPartitionConfig)
from medpfl.data.schemas import SERVER_CLIENT, PartitionTable, SharedPartitionTable, validate
from medpfl.errors import PartitionError  # noqa: F401  (defined in medpfl.errors; importable here as before)


class Partitioner(ABC):
    """Base class of the partitioners, one subclass per ``partitions.<name>.scheme`` (in the
    manner of flwr-datasets' partitioners: one small class per scheme, one base class).

    A subclass is a dataclass of its scheme's knobs (positional, in the order its tests and
    callers use) and ``key``, the params key its errors name (``partitions.<name>``). It
    implements :meth:`from_config` (its config class to itself) and :meth:`partition` (the
    draw); :meth:`client_splits` (the partition, then each client's local split) is shared.

    Class attributes:
      ``scheme``: the scheme name (the key of :data:`PARTITIONERS`).
      ``shares_samples``: clients may share pool samples (the table is then checked against
      :class:`SharedPartitionTable`, else against :class:`PartitionTable`).
      ``leaves_out``: some pool samples may go to no client (else :func:`build_partition`
      checks that every pool sample was assigned).
      ``draws``: the scheme draws from the partition's seeded ``RandomState`` (all but
      ``natural``); only then is ``data_fraction`` applied.
      ``needs_subjects``: the scheme reads each pool sample's subject (``subject``):
      :func:`build_partition` then needs ``subjects``.
    """

    scheme: ClassVar[str]
    shares_samples: ClassVar[bool] = False
    leaves_out: ClassVar[bool] = False
    draws: ClassVar[bool] = True
    needs_subjects: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: PartitionConfigBase, key: str) -> "Partitioner":
        """The partitioner of ``cfg`` (its scheme's config class); ``key`` is the params key its
        errors name (``partitions.<name>``)."""

    @abstractmethod
    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """labels: int [N], the class of each pool sample. Returns the K clients' positions into
        ``labels`` (int64 arrays, each in the client's final order), drawn from ``rng``. Raises
        PartitionError naming ``key`` when the partition cannot be built."""

    def client_splits(self, labels: np.ndarray, rng: np.random.RandomState | None,
                      local_test: LocalTestConfig | None, *, test_labels: np.ndarray | None = None,
                      natural: tuple[np.ndarray, np.ndarray] | None = None,
                      subjects: np.ndarray | None = None) -> list[tuple[np.ndarray, ...]]:
        """Each client's local splits: :meth:`partition`, then the rule of ``local_test``, from
        the same ``rng`` (after the partition's draws): :func:`split_official_test` (test
        positions into ``test_labels``, int64 [M], the official test split's labels) or
        :func:`split_local` (``(train, test)`` positions into ``labels``, or ``(train, test,
        val)`` with the ``ratios`` rule). ``natural`` is for :class:`NaturalPartitioner` only,
        ``subjects`` (int64 [N], each pool sample's subject) for :class:`SubjectPartitioner`.
        Raises PartitionError naming ``<key>.local_test``."""
        clients = self.partition_subjects(labels, subjects, rng) if self.needs_subjects else self.partition(labels, rng)
        if local_test.rule == "official_test":
            return split_official_test(clients, labels, test_labels, rng, key=f"{self.key}.local_test")
        return split_local(clients, labels, local_test, rng, key=f"{self.key}.local_test")


@dataclass
class DirichletPartitioner(Partitioner):
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

    scheme: ClassVar[str] = "dirichlet"

    @classmethod
    def from_config(cls, cfg: DirichletPartitionConfig, key: str) -> "DirichletPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.DirichletPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.alpha, cfg.min_samples, cfg.self_balancing, cfg.max_draws, key)

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
class IIDPartitioner(Partitioner):
    """Uniform random split into K parts whose sizes differ by at most one."""

    num_clients: int
    min_samples: int = 1
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "iid"

    @classmethod
    def from_config(cls, cfg: IIDPartitionConfig, key: str) -> "IIDPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.IIDPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.min_samples, key)

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        _check_size(len(labels), self.num_clients, self.min_samples, self.key)
        perm = rng.permutation(len(labels)).astype(np.int64)
        return [np.asarray(p) for p in np.array_split(perm, self.num_clients)]


@dataclass
class PathologicalPartitioner(Partitioner):
    """Each client holds ``classes_per_client`` classes (McMahan et al. 2017, "pathological
    non-IID"). Classes are dealt round-robin over a shuffled class order, so every class is
    held by about ``K * k / C`` clients; each class's shuffled samples are split evenly among
    its holders."""

    num_clients: int
    classes_per_client: int
    min_samples: int = 1
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "pathological"

    @classmethod
    def from_config(cls, cfg: PathologicalPartitionConfig, key: str) -> "PathologicalPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.PathologicalPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.classes_per_client, cfg.min_samples, key)

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


@dataclass
class ShardsPartitioner(Partitioner):
    """McMahan et al. 2017's shards ("pathological non-IID"; the PFPS-LWC spec's READING of its
    pathological partition, ``../shared/docs/methods-fedmic-pfpslwc.md`` B.4): sort the pool by
    label, cut it into ``S = num_clients * shards_per_client`` shards, give each client
    ``shards_per_client`` random shards. A client then holds at most ``shards_per_client``
    classes.

    Draws, in order: each class's samples are shuffled (classes in sorted order), so the pool
    is sorted by label with a random order inside each class; then one permutation of the S
    shards, of which client i takes entries ``i*k .. i*k+k-1``; then each client's index list is
    shuffled. Shards never straddle two classes (a straddling shard would give its client an
    extra class): class c is cut into ``s_c`` shards whose sizes differ by at most one, with
    ``s_c >= 1`` and the ``s_c`` chosen as equal in shard size as possible (:meth:`shard_counts`).
    When every class size is a multiple of ``N / S`` (CIFAR-10 with 10 clients x 5 shards: 50
    shards of 1,000) this is exactly cutting the sorted pool into S equal shards; CIFAR-100 with
    10 x 30 gives 3 shards of 167/167/166 per class.

    Raises PartitionError naming the key when ``S`` exceeds the pool size, when ``S`` is
    smaller than the number of classes (a class would get no shard), or when a client holds
    fewer than ``min_samples`` samples.
    """

    num_clients: int
    shards_per_client: int
    min_samples: int = 1
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "shards"

    @classmethod
    def from_config(cls, cfg: ShardsPartitionConfig, key: str) -> "ShardsPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.ShardsPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.shards_per_client, cfg.min_samples, key)

    def shard_counts(self, class_sizes: np.ndarray) -> np.ndarray:
        """Shards per class (int [C], summing to S): one each, then every further shard to the
        class whose shards are currently largest (``n_c / s_c``, exact; ties to the lower class
        index), which makes the shards as equal in size as class boundaries allow."""
        total = self.num_clients * self.shards_per_client
        counts = np.ones(len(class_sizes), dtype=np.int64)
        heap = [(-Fraction(int(n), 1), c) for c, n in enumerate(class_sizes)]
        heapq.heapify(heap)
        for _ in range(total - len(class_sizes)):
            _, c = heapq.heappop(heap)
            counts[c] += 1
            heapq.heappush(heap, (-Fraction(int(class_sizes[c]), int(counts[c])), c))
        return counts

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """labels: int [N] class of each pool sample. Returns K arrays of positions into ``labels``."""
        k, spc = self.num_clients, self.shards_per_client
        n, total = len(labels), self.num_clients * self.shards_per_client
        classes = np.unique(labels)
        if total > n:
            raise PartitionError(f"{self.key}: num_clients x shards_per_client = {k} x {spc} = {total} shards exceed "
                                 f"the {n} samples of the train pool; lower {self.key}.shards_per_client or "
                                 f"{self.key}.num_clients")
        if total < len(classes):
            raise PartitionError(f"{self.key}: num_clients x shards_per_client = {total} shards cannot cover the "
                                 f"{len(classes)} classes of the train pool (every class needs a shard); raise "
                                 f"{self.key}.shards_per_client or {self.key}.num_clients")
        _check_size(n, k, self.min_samples, self.key)
        by_class = []
        for c in classes:
            idx_c = np.where(labels == c)[0]
            rng.shuffle(idx_c)
            by_class.append(idx_c)
        counts = self.shard_counts(np.array([len(b) for b in by_class]))
        shards = [chunk for idx_c, s_c in zip(by_class, counts) for chunk in np.array_split(idx_c, s_c)]
        order = rng.permutation(total)
        out = [np.concatenate([shards[j] for j in order[i * spc:(i + 1) * spc]]).astype(np.int64) for i in range(k)]
        small = [i for i, p in enumerate(out) if len(p) < self.min_samples]
        if small:
            raise PartitionError(f"{self.key}: clients {small} hold fewer than min_samples={self.min_samples} samples; "
                                 f"lower {self.key}.num_clients or {self.key}.min_samples, or raise "
                                 f"{self.key}.shards_per_client")
        for p in out:
            rng.shuffle(p)
        return out


@dataclass
class PerClientDirichletPartitioner(Partitioner):
    """The pFedKD-WCL partition (HengruiH/pFedKD ``utils/MNIST_dirichlet.py``; spec A.3.1).

    Client sizes ``n = linspace(size_start, size_stop, K, dtype=int)`` (deterministic,
    increasing). For each client k in order, independently:

    1. ``q_k ~ Dir(alpha * 1_C)`` over the C classes present in the pool (sorted);
    2. with ``top_k``: keep the ``top_k`` largest entries of ``q_k`` (``argsort(q)[-top_k:]``),
       zero the rest, renormalise;
    3. ``counts = floor(q_k * n_k)``; the rounding remainder ``n_k - sum(counts)`` is added to
       the LAST class (index C-1), even when that class was cut by ``top_k`` (the code's quirk:
       a client may then hold a few samples of one class more than ``top_k``);
    4. for each class c with ``counts[c] > 0`` (in order), ``counts[c]`` samples of class c
       drawn without replacement from ALL pool samples of that class (``permutation[:m]``), so
       clients may share samples;
    5. the client's samples are shuffled (the local split then takes the first 75 %).

    ``clustered`` (``utils/MNIST.py`` ``load_mnist_clustered``): the K clients form
    ``n_clusters`` consecutive groups; each group draws one random pair of classes
    (``permutation(C)[:2]``) and each of its clients takes ``n_k`` samples drawn without
    replacement from the pool samples of those two classes (already in random order; no
    Dirichlet draw, no further shuffle).

    Raises PartitionError naming the key when a client asks for more samples of a class (or
    of a class pair) than the pool holds, or has fewer than 2 samples.
    """

    num_clients: int
    alpha: float
    size_start: int = 1165
    size_stop: int = 3834
    top_k: int | None = None
    clustered: bool = False
    n_clusters: int | None = None
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "per_client_dirichlet"
    shares_samples: ClassVar[bool] = True

    @classmethod
    def from_config(cls, cfg: PerClientDirichletPartitionConfig, key: str) -> "PerClientDirichletPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.PerClientDirichletPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.alpha, cfg.size_start, cfg.size_stop, cfg.top_k, cfg.clustered, cfg.n_clusters,
                   key)

    def sizes(self) -> np.ndarray:
        """Per-client sample counts: ``np.linspace(size_start, size_stop, K, dtype=int)``."""
        return np.linspace(self.size_start, self.size_stop, self.num_clients, dtype=int)

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """labels: int [N]. Returns K arrays of positions into ``labels`` (unique within a
        client, possibly shared between clients), each in the client's final order."""
        if not self.alpha > 0:
            raise PartitionError(f"{self.key}.alpha must be > 0, got {self.alpha}")
        if self.size_start < 1 or self.size_stop < self.size_start:
            raise PartitionError(f"{self.key}: client sizes linspace(size_start={self.size_start}, "
                                 f"size_stop={self.size_stop}) need 1 <= size_start <= size_stop")
        sizes = self.sizes()
        if sizes.min() < 2:
            raise PartitionError(f"{self.key}.size_start={self.size_start}: every client needs at least 2 samples "
                                 "(one local train, one local test)")
        classes = np.unique(labels)
        by_class = [np.where(labels == c)[0] for c in classes]
        if self.clustered:
            return self._clustered(labels, classes, sizes, rng)
        c_n = len(classes)
        if self.top_k is not None and self.top_k > c_n:
            raise PartitionError(f"{self.key}.top_k={self.top_k} exceeds the {c_n} classes in the train pool")
        out = []
        for k, n_k in enumerate(sizes):
            q = rng.dirichlet(np.repeat(self.alpha, c_n))
            if not np.all(np.isfinite(q)) or q.sum() <= 0:
                raise PartitionError(f"{self.key}.alpha={self.alpha}: the Dirichlet draw of client {k} underflowed "
                                     f"(NaN proportions); raise {self.key}.alpha")
            if self.top_k is not None:
                top = np.argsort(q)[-self.top_k:]
                cut = np.zeros(c_n)
                cut[top] = q[top] / q[top].sum()
                q = cut
            counts = np.floor(q * n_k).astype(int)
            counts[-1] += n_k - counts.sum()
            picks = []
            for ci, m in enumerate(counts):
                if m == 0:
                    continue
                pool = by_class[ci]
                if m > len(pool):
                    raise PartitionError(
                        f"{self.key}: client {k} needs {m} samples of class {classes[ci]}, the train pool holds "
                        f"{len(pool)}; lower {self.key}.size_stop or raise {self.key}.alpha")
                picks.append(pool[rng.permutation(len(pool))[:m]])
            idx = np.concatenate(picks).astype(np.int64)
            out.append(idx[rng.permutation(len(idx))])
        return out

    def _clustered(self, labels, classes, sizes, rng) -> list[np.ndarray]:
        if self.n_clusters is None or self.num_clients % self.n_clusters:
            raise PartitionError(f"{self.key}: clustered needs n_clusters dividing num_clients={self.num_clients}, "
                                 f"got n_clusters={self.n_clusters}")
        if len(classes) < 2:
            raise PartitionError(f"{self.key}.clustered: the train pool has {len(classes)} class; a pair is needed")
        per = self.num_clients // self.n_clusters
        out = []
        for _ in range(self.n_clusters):
            pair = classes[rng.permutation(len(classes))[:2]]
            pool = np.where(np.isin(labels, pair))[0]
            for _ in range(per):
                k = len(out)
                n_k = int(sizes[k])
                if n_k > len(pool):
                    raise PartitionError(f"{self.key}.clustered: client {k} needs {n_k} samples of classes "
                                         f"{pair.tolist()}, the train pool holds {len(pool)}; lower "
                                         f"{self.key}.size_stop")
                out.append(pool[rng.permutation(len(pool))[:n_k]].astype(np.int64))
        return out


@dataclass
class PairwiseDirichletPartitioner(Partitioner):
    """FHBench's Dirichlet partition (``build_non_iid_by_dirichlet``, from
    epfml/quasi-global-momentum, as used in microsoft/PersonalizedFL and wph6/FHBench
    ``datautil/datasplit.py``; ``../shared/docs/methods-pfedkdwcl-epfl.md`` B.4 and C.14),
    re-implemented from its description. Clients come in pairs (``n_auxi_workers = 2``) and
    the label skew is between the two clients of a pair.

    Draws, in order (all from ``rng``):

    1. one permutation of the pool's positions (the code shuffles its (index, label) rows);
    2. the shuffled pool is cut into ``ceil(K/2)`` contiguous chunks: chunk j (j < last) holds
       positions ``[j*c, (j+1)*c)`` with ``c = int(2/K * N)`` (floating point, as the code),
       the last chunk runs to N; chunk j's workers are clients 2j and 2j+1, except with an odd
       K, where the last chunk has one worker (client K-1);
    3. per chunk in order, with ``n_w`` workers and ``S`` samples, repeat until the smallest
       worker holds at least ``int(0.5 * S / n_w)``: start from empty lists; for every class c
       of the pool (sorted), take the chunk's class-c positions in shuffled order, draw ``p ~
       Dir(alpha * 1_{n_w})``, zero ``p_j`` of each worker already holding ``>= S / n_w``,
       renormalise, and cut the class at ``(cumsum(p) * n_c).astype(int)[:-1]`` (worker lists
       grow class by class, so each is grouped by class). A draw whose proportions are not
       finite (alpha so small that the Dirichlet draw underflows) counts as failed; after
       ``max_draws`` failed draws of one chunk the partition stops naming the key (the code
       loops forever);
    4. ``equal_sizes`` (``pair_sizes: equal``, the code's ``DataPartitioner`` with
       ``partition_sizes = [1/K] * K``): the K worker lists are concatenated in client order
       and cut into K blocks of ``int(1/K * N)`` samples; block i is client i, and the last
       ``N - K * int(N/K)`` samples are left out. Otherwise (``pair_sizes: drawn``) worker
       list i is client i;
    5. each client's positions are sorted ascending (pool order): the code re-enumerates a
       client's samples in data-set order before its per-class train/test/val split
       (``DataPartitioner(..., "evenly")``), so the ``ratios`` rule then sees them in that order.

    Clients are disjoint. Raises PartitionError naming the key when K < 2, K > N, a client
    would be empty, or a chunk finds no valid draw in ``max_draws`` tries.
    """

    num_clients: int
    alpha: float
    equal_sizes: bool = True
    max_draws: int = 1000
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "dirichlet_pairs"
    leaves_out: ClassVar[bool] = True  # pair_sizes: equal leaves fewer than K samples to no client

    @classmethod
    def from_config(cls, cfg: DirichletPairsPartitionConfig, key: str) -> "PairwiseDirichletPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.DirichletPairsPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.alpha, cfg.pair_sizes == "equal", cfg.max_draws, key)

    def chunks(self, n: int) -> list[tuple[int, int, int]]:
        """``(start, stop, workers)`` of each chunk of a pool of ``n``, in order."""
        k, aux = self.num_clients, 2
        num_splits = math.ceil(k / aux)
        size = int(aux / k * n)
        out = []
        for j in range(num_splits):
            workers = aux if j < num_splits - 1 else k - aux * (num_splits - 1)
            out.append((j * size, n if j == num_splits - 1 else (j + 1) * size, workers))
        return out

    def draw_chunk(self, pos: np.ndarray, labels: np.ndarray, classes: np.ndarray, workers: int,
                   rng: np.random.RandomState, chunk: int) -> list[np.ndarray]:
        """One chunk's worker lists (positions, each grouped by class in ``classes`` order)."""
        size = len(pos)
        y = labels[pos]
        for _ in range(self.max_draws):
            batches: list[list[int]] = [[] for _ in range(workers)]
            failed = False
            for c in classes:
                members = pos[y == c]
                p = rng.dirichlet(np.repeat(self.alpha, workers))
                p = np.array([pj * (len(b) < size / workers) for pj, b in zip(p, batches)])
                if len(members) == 0:
                    continue  # the draw is made (as in the code) but there is nothing to cut
                total = p.sum()
                if not np.isfinite(total) or total <= 0:
                    failed = True
                    break
                cuts = (np.cumsum(p / total) * len(members)).astype(int)[:-1]
                batches = [b + part.tolist() for b, part in zip(batches, np.split(members, cuts))]
            if not failed and min(len(b) for b in batches) >= int(0.50 * size / workers):
                return [np.array(b, dtype=np.int64) for b in batches]
        raise PartitionError(
            f"{self.key}: no Dirichlet draw of chunk {chunk} ({size} samples, {workers} clients) gave every client "
            f"at least int(0.5 * {size} / {workers}) samples in {self.max_draws} tries (alpha={self.alpha}); raise "
            f"{self.key}.alpha or {self.key}.max_draws")

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """labels: int [N]. Returns K disjoint arrays of positions into ``labels``, each ascending."""
        if not self.alpha > 0:
            raise PartitionError(f"{self.key}.alpha must be > 0, got {self.alpha}")
        n, k = len(labels), self.num_clients
        if k < 2:
            raise PartitionError(f"{self.key}.num_clients={k}: dirichlet_pairs needs at least 2 clients")
        _check_size(n, k, 1, self.key)
        order = rng.permutation(n).astype(np.int64)
        classes = np.unique(labels)
        lists: list[np.ndarray] = []
        for j, (start, stop, workers) in enumerate(self.chunks(n)):
            lists += self.draw_chunk(order[start:stop], labels, classes, workers, rng, j)
        if self.equal_sizes:
            q = int(1.0 / k * n)
            flat = np.concatenate(lists)
            lists = [flat[i * q:(i + 1) * q] for i in range(k)]
        empty = [i for i, b in enumerate(lists) if len(b) == 0]
        if empty:
            raise PartitionError(f"{self.key}: clients {empty} get no sample from dirichlet_pairs (N={n}); lower "
                                 f"{self.key}.num_clients")
        return [np.sort(b).astype(np.int64) for b in lists]


@dataclass
class NaturalPartitioner(Partitioner):
    """``scheme: natural``: the clients and local splits a generated federated data set carries
    (the sample table's ``natural_client`` / ``natural_split``, e.g. ``synthetic_0.5_0.5``);
    nothing is drawn and ``local_test`` does not apply, so it overrides
    :meth:`client_splits` and has no :meth:`partition` of its own."""

    num_clients: int
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "natural"
    draws: ClassVar[bool] = False

    @classmethod
    def from_config(cls, cfg: NaturalPartitionConfig, key: str) -> "NaturalPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.NaturalPartitionConfig`)."""
        return cls(cfg.num_clients, key)

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """Not defined: the clients come with the data (:meth:`client_splits`). Raises PartitionError."""
        raise PartitionError(f"{self.key}: the natural scheme draws nothing; its clients come with the data set "
                             "(client_splits with natural=...) (internal error)")

    def client_splits(self, labels: np.ndarray, rng: np.random.RandomState | None,
                      local_test: LocalTestConfig | None, *, test_labels: np.ndarray | None = None,
                      natural: tuple[np.ndarray, np.ndarray] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """natural: ``(client id int [N], local split str [N] in {"train", "test"})`` of each
        pool sample, in pool order. Returns per client ``(train, test)`` positions into
        ``labels`` (ascending). ``rng``, ``local_test`` and ``test_labels`` are not used. Raises
        PartitionError naming ``key`` when the data set has no natural clients, their number is
        not ``num_clients`` or a client lacks a train or test sample."""
        return _natural_splits(labels, self.num_clients, natural, self.key)


@dataclass
class SubjectPartitioner(Partitioner):
    """``scheme: subject`` (:class:`medpfl.config.SubjectPartitionConfig`): whole subjects to
    clients, FHBench's "natural" by-patient split of ADFTD, PTB-XL, ICBHI and SPRSound; the
    local split follows as in every drawn scheme.

    The subjects present in the pool (sorted ids) are put in the order ``rng.permutation``, then
    ``balanced``: each, in that order, goes to the client holding the fewest samples so far (ties:
    the lowest client id); ``round_robin``: subject i of the order goes to client i mod K. A
    client's samples (all of its subjects') are listed in pool order, and the local rule
    (``local_test``) then splits them by sample, so one subject's samples may sit in both the
    client's local train and local test splits (within one client only)."""

    num_clients: int
    assign: str = "balanced"
    min_samples: int = 10
    key: str = "partitions.<name>"

    scheme: ClassVar[str] = "subject"
    needs_subjects: ClassVar[bool] = True

    @classmethod
    def from_config(cls, cfg: SubjectPartitionConfig, key: str) -> "SubjectPartitioner":
        """The partitioner of ``cfg`` (:class:`medpfl.config.SubjectPartitionConfig`)."""
        return cls(cfg.num_clients, cfg.assign, cfg.min_samples, key)

    def partition(self, labels: np.ndarray, rng: np.random.RandomState) -> list[np.ndarray]:
        """Not defined without subjects (:meth:`partition_subjects`). Raises PartitionError."""
        raise PartitionError(f"{self.key}.scheme=subject: needs each sample's subject (internal error)")

    def partition_subjects(self, labels: np.ndarray, subjects: np.ndarray | None,
                           rng: np.random.RandomState) -> list[np.ndarray]:
        """labels, subjects: int [N] of the pool. Returns K int64 arrays of positions (ascending:
        pool order). Raises PartitionError naming the key when there are no subjects, fewer
        subjects than clients, or a client below ``min_samples``."""
        if subjects is None:
            raise PartitionError(f"{self.key}.scheme=subject: the data set has no subject_id column in its sample "
                                 "table (only folder data sets with subjects: ptbxl, adftd, icbhi, sprsound); choose "
                                 "another scheme")
        subjects = np.asarray(subjects)
        if len(subjects) != len(labels):
            raise PartitionError(f"{self.key}: {len(subjects)} subject ids for {len(labels)} pool samples "
                                 "(internal error)")
        k = self.num_clients
        ids, inverse, counts = np.unique(subjects, return_inverse=True, return_counts=True)
        if len(ids) < k:
            raise PartitionError(f"{self.key}.num_clients={k} exceeds the {len(ids)} subjects of the pool; lower "
                                 f"{self.key}.num_clients")
        order = rng.permutation(len(ids))
        owner = np.empty(len(ids), dtype=np.int64)
        if self.assign == "round_robin":
            owner[order] = np.arange(len(ids)) % k
        elif self.assign == "balanced":
            heap = [(0, c) for c in range(k)]  # (samples held, client id): the least loaded, lowest id first
            for s_ in order:
                held, c = heapq.heappop(heap)
                owner[s_] = c
                heapq.heappush(heap, (held + int(counts[s_]), c))
        else:
            raise PartitionError(f"{self.key}.assign: unknown rule {self.assign!r} (balanced, round_robin)")
        client_of = owner[inverse]
        out = [np.flatnonzero(client_of == c).astype(np.int64) for c in range(k)]
        small = [(c, len(b)) for c, b in enumerate(out) if len(b) < self.min_samples]
        if small:
            raise PartitionError(f"{self.key}: clients {[c for c, _ in small]} hold {[m for _, m in small]} samples "
                                 f"(whole subjects), fewer than min_samples={self.min_samples}; lower "
                                 f"{self.key}.num_clients or {self.key}.min_samples")
        return out


def _check_size(n: int, k: int, min_samples: int, key: str) -> None:
    if k > n:
        raise PartitionError(f"{key}.num_clients={k} exceeds the {n} samples of the train split")
    if k * min_samples > n:
        raise PartitionError(f"{key}: {k} clients x min_samples={min_samples} needs {k * min_samples} samples, "
                             f"the train split has {n}; lower {key}.num_clients or {key}.min_samples")


#: The partitioner class of each scheme, by scheme name (the same names as
#: :data:`medpfl.config.PARTITION_CONFIGS`).
PARTITIONERS: dict[str, type[Partitioner]] = {
    cls.scheme: cls
    for cls in (DirichletPartitioner, IIDPartitioner, PathologicalPartitioner, ShardsPartitioner,
                PerClientDirichletPartitioner, NaturalPartitioner, PairwiseDirichletPartitioner, SubjectPartitioner)
}


def make_partitioner(cfg: PartitionConfigBase, key: str) -> Partitioner:
    """The partitioner of ``cfg``'s scheme (:data:`PARTITIONERS`), built by its
    :meth:`Partitioner.from_config`; ``key`` is the params key its errors name. Raises
    PartitionError for a scheme without a partitioner (an internal error: every config class
    has one)."""
    try:
        cls = PARTITIONERS[cfg.scheme]
    except KeyError:
        raise PartitionError(f"{key}.scheme: no partitioner for scheme {cfg.scheme!r} (internal error)") from None
    return cls.from_config(cfg, key)


def split_local(clients: list[np.ndarray], labels: np.ndarray, cfg: LocalTestConfig, rng: np.random.RandomState,
                key: str = "partitions.<name>.local_test") -> list[tuple[np.ndarray, np.ndarray]]:
    """Split each client's positions into ``(local train, local test)``.

    Rules (``cfg.rule``):
      stratified: per class, :func:`stratified_test_count` = ``floor(fraction * n_kc + 1/2)``
        (round half up, on the decimal value of ``fraction``) to test; if that gives no test
        sample, one sample of the client's largest class goes to test.
      random: ``max(1, int(fraction * n_k))`` uniformly random samples to test.
      fedkper: the authors' ``create_local``: ``m = int(fraction * n_k)``; per present class
        (sorted) draw ``int(m / |classes|)`` without replacement, or ``int(fraction * n_kc)``
        when the class is smaller than that; if nothing was drawn, a random ``int(fraction*n_k)``.
        The local train set keeps the client's order.

      ratios: a three-way split, :func:`split_ratios`; returns ``(train, test, val)`` triples.

    Raises PartitionError naming ``key`` when a client would have no test or no train sample.
    """
    if cfg.rule == "ratios":
        return split_ratios(clients, labels, cfg, key)
    out = []
    for cid, idx in enumerate(clients):
        y = labels[idx]
        if cfg.rule == "ordered":
            n_train = int((1 - cfg.fraction) * len(idx))
            train, test = idx[:n_train], idx[n_train:]
            if len(test) == 0 or len(train) == 0:
                raise PartitionError(f"{key}: client {cid} ({len(idx)} samples) gets an empty local "
                                     f"{'test' if len(test) == 0 else 'train'} split with rule='ordered', "
                                     f"fraction={cfg.fraction}")
            out.append((np.asarray(train, dtype=np.int64), np.asarray(test, dtype=np.int64)))
            continue
        if cfg.rule == "fedkper":
            test = _fedkper_test(idx, y, cfg.fraction, rng)
        elif cfg.rule == "random":
            m = max(1, int(cfg.fraction * len(idx)))
            test = rng.choice(idx, size=m, replace=False) if len(idx) > 1 else idx[:0]
        else:
            picks = []
            for c in np.unique(y):
                members = idx[y == c]
                m = stratified_test_count(cfg.fraction, len(members))
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


def ratio_counts(ratios, n: int, rounding: str = "floor") -> tuple[int, int, int]:
    """How many of a class's ``n`` samples go to local train, test and val under ``ratios =
    [r_train, r_test, r_val]``.

    floor (the FHBench code's ``define_val_dataset``): ``floor(r_train * n)``,
    ``floor(r_test * n)`` and the remainder, the products exact on the decimal value of each
    ratio (4:3:3 of 10 is 4/3/3, of 7 is 2/2/3). nearest: :func:`largest_remainder` of ``n``
    over the three ratios (exact; ties to the earlier part), e.g. 7:2:1 of 4 is 3/1/0.
    """
    exact = [Fraction(repr(float(r))) for r in ratios]
    if rounding == "nearest":
        den = math.lcm(*(f.denominator for f in exact))
        tr, te, va = (int(v) for v in largest_remainder(n, np.array([int(f * den) for f in exact])))
        return tr, te, va
    tr, te = int(math.floor(exact[0] * n)), int(math.floor(exact[1] * n))
    return tr, te, n - tr - te


def split_ratios(clients: list[np.ndarray], labels: np.ndarray, cfg: LocalTestConfig,
                 key: str = "partitions.<name>.local_test") -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ``ratios`` local rule: split each client's positions into ``(local train, local test,
    local val)`` per class (FHBench's 4:3:3, FedMIC's 7:2:1).

    For each class c of the client, its positions **in the client's order** (no draw: the
    partitioners hand over shuffled clients; ``dirichlet_pairs`` hands them over in pool order,
    as the FHBench code) are cut into the first ``n_train``, the next ``n_test`` and the rest,
    with ``(n_train, n_test, n_val) =`` :func:`ratio_counts` ``(cfg.ratios, n_kc,
    cfg.rounding)``. Each part keeps the client's order. Raises PartitionError naming ``key``
    when a client gets no train or no test sample; an empty val is allowed.
    """
    out = []
    for cid, idx in enumerate(clients):
        idx = np.asarray(idx, dtype=np.int64)
        y = labels[idx]
        part = np.full(len(idx), 2, dtype=np.int8)  # 0 train, 1 test, 2 val
        for c in np.unique(y):
            where = np.flatnonzero(y == c)
            tr, te, _ = ratio_counts(cfg.ratios, len(where), cfg.rounding)
            part[where[:tr]] = 0
            part[where[tr:tr + te]] = 1
        train, test, val = (idx[part == i] for i in range(3))
        for name, arr in (("train", train), ("test", test)):
            if len(arr) == 0:
                held = {int(c): int(m) for c, m in zip(*np.unique(y, return_counts=True))}
                raise PartitionError(f"{key}: client {cid} ({len(idx)} samples, per class {held}) gets no local {name} "
                                     f"sample with rule='ratios', ratios={cfg.ratios}, rounding={cfg.rounding!r}; "
                                     f"lower {key.rsplit('.', 1)[0]}.num_clients, raise {key}.ratios' {name} share "
                                     f"or set {key}.rounding: nearest")
        out.append((train, test, val))
    return out


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Split the integer ``total`` in proportion to non-negative integer ``weights`` (int [K],
    positive sum) by the largest-remainder (Hamilton) method, exactly in integers: each share
    is ``floor(total * w_k / W)``, and the ``total - sum`` units left go one each to the largest
    remainders ``total * w_k mod W`` (ties to the lower index). The shares sum to ``total``; a
    zero weight gets 0. Returns int64 [K]."""
    w = [int(v) for v in weights]
    big_w = sum(w)
    if big_w <= 0 or min(w) < 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {w}")
    shares = [total * v // big_w for v in w]
    rest = [total * v % big_w for v in w]
    for i in sorted(range(len(w)), key=lambda i: (-rest[i], i))[:total - sum(shares)]:
        shares[i] += 1
    return np.array(shares, dtype=np.int64)


def split_official_test(clients: list[np.ndarray], pool_labels: np.ndarray, test_labels: np.ndarray,
                        rng: np.random.RandomState, key: str = "partitions.<name>.local_test"
                        ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``official_test`` local rule (the PFPS-LWC spec's READING of per-client test data,
    ``../shared/docs/methods-fedmic-pfpslwc.md`` B.4): each client's whole share is its local
    train split, and its local test split is drawn from the official test split so that its
    test class distribution follows its training class distribution.

    clients: K int arrays of positions into ``pool_labels`` (int [N], the train pool's labels);
    test_labels: int [M], the labels of the official test split.
    For each class c present in the test split (sorted): with ``t_kc`` client k's training
    samples of class c, the ``M_c`` test samples of class c are permuted (``rng.permutation``)
    and cut, in client order, into :func:`largest_remainder` ``(M_c, t_[:, c])`` shares, so the
    shares sum to ``M_c`` and a client without class-c training samples gets none. A class
    that no client trains on (absent from the train pool) gives nobody test samples. The
    local test sets are disjoint and, apart from such classes, cover the official test split.

    Returns K pairs ``(train positions into pool_labels, test positions into test_labels)``;
    the train positions keep the client's order, the test positions are grouped by class.
    Raises PartitionError naming ``key`` when the data set has no official test split or a
    client would get no local test sample.
    """
    test_labels = np.asarray(test_labels)
    if len(test_labels) == 0:
        raise PartitionError(f"{key}.rule='official_test' draws local test splits from the official test split, "
                             "and this data set has none; choose another rule")
    num_classes = int(max(pool_labels.max(), test_labels.max())) + 1
    train_counts = np.stack([np.bincount(pool_labels[idx], minlength=num_classes) for idx in clients])  # [K, C]
    tests: list[list[np.ndarray]] = [[] for _ in clients]
    for c in np.unique(test_labels):
        weights = train_counts[:, c]
        if weights.sum() == 0:
            continue
        members = np.flatnonzero(test_labels == c)
        shuffled = members[rng.permutation(len(members))]
        shares = largest_remainder(len(members), weights)
        for cid, chunk in enumerate(np.split(shuffled, np.cumsum(shares)[:-1])):
            if len(chunk):
                tests[cid].append(chunk)
    out = []
    for cid, (idx, parts) in enumerate(zip(clients, tests)):
        if not parts:
            held = {int(c): int(n) for c, n in enumerate(train_counts[cid]) if n}
            raise PartitionError(f"{key}: client {cid} gets no local test sample with rule='official_test': its "
                                 f"training samples per class {held} are too few a share of their classes to earn "
                                 f"one of the official test samples; lower {key.rsplit('.', 1)[0]}.num_clients or "
                                 f"choose another {key}.rule")
        out.append((np.asarray(idx, dtype=np.int64), np.concatenate(parts).astype(np.int64)))
    return out


def stratified_test_count(fraction: float, n: int) -> int:
    """How many of a class's ``n`` samples the ``stratified`` rule puts in local test:
    ``fraction * n`` rounded half up, ``floor(fraction * n + 1/2)``.

    The product is computed exactly on the decimal value of ``fraction`` as written in the params
    (``0.29 * 50`` is 14.5 and gives 15, although the binary float product is 14.4999...), so
    every half case rounds up: 0.25 of 2 gives 1, of 6 gives 2 (1.5), of 10 gives 3 (2.5).
    (Earlier versions used Python's ``round``, which rounds halves to even: 0.5 -> 0,
    1.5 -> 2, 2.5 -> 2.)
    """
    exact = Fraction(repr(float(fraction))) * n + Fraction(1, 2)
    return int(math.floor(exact))


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


def partition_pool(samples: pd.DataFrame, cfg: PartitionConfigBase) -> pd.DataFrame:
    """The rows of the sample table (:class:`SampleTable`) that ``cfg`` partitions, in pool order:
    ``pool: train``, the official train split; ``pool: all``, the official train, test and val
    splits, in that order (the FHBench code's concatenation), each in its own order. The
    ``data_fraction`` draw happens later, in :func:`build_partition`."""
    if cfg.pool == "all":
        return pd.concat([samples[samples["split"] == s] for s in ("train", "test", "val")])
    return samples[samples["split"] == "train"]


def fraction_size(fraction: float, n: int) -> int:
    """``floor(fraction * n)``, exact on the decimal value of ``fraction`` (FHBench's
    ``int(len(data) * datapercent)``; the same for 0.2, 0.3 and 0.5 at every n)."""
    return int(math.floor(Fraction(repr(float(fraction))) * n))


def draw_data_fraction(pool_ids: np.ndarray, pool_labels: np.ndarray, fraction: float, num_clients: int,
                       rng: np.random.RandomState, key: str = "partitions.<name>") -> tuple[np.ndarray, np.ndarray]:
    """The ``data_fraction`` subset of the pool (FHBench's ``datapercent``): ``m =``
    :func:`fraction_size` ``(fraction, N)`` positions drawn by ``rng.choice(N, m,
    replace=False)``, the partition's first draw, kept in the drawn order.

    pool_ids, pool_labels: [N] each. Returns the two arrays' ``[m]`` subsets. Raises
    PartitionError naming ``<key>.data_fraction`` when ``m`` is below ``num_clients``."""
    m = fraction_size(fraction, len(pool_ids))
    if m < num_clients:
        raise PartitionError(f"{key}.data_fraction={fraction} keeps {m} of the {len(pool_ids)} pool "
                             f"samples, fewer than num_clients={num_clients}; raise {key}.data_fraction")
    keep = rng.choice(len(pool_ids), m, replace=False)
    return pool_ids[keep], pool_labels[keep]


def draw_server_data(val_ids: np.ndarray, val_labels: np.ndarray, cfg: ServerDataConfig, seed: int,
                     key: str = "partitions.<name>.server_data") -> tuple[np.ndarray, np.ndarray]:
    """The server's unlabeled samples (``partitions.<name>.server_data``): ``m`` of the official
    val split's ``N_val`` samples, ``m = floor(fraction * N_val)`` (exact on the decimal value)
    or ``count``, drawn by ``RandomState([seed, 1]).choice(N_val, m, replace=False)`` (its own
    stream: the partition's draws are untouched) and kept in the drawn order.

    val_ids, val_labels: int64 [N_val], the val split in sample-table order. Returns ``(ids,
    labels)`` int64 [m]. Raises PartitionError naming ``key`` when the data set has no val split
    or ``m`` is 0 or more than N_val."""
    val_ids, val_labels = np.asarray(val_ids, dtype=np.int64), np.asarray(val_labels, dtype=np.int64)
    n = len(val_ids)
    if n == 0:
        raise PartitionError(f"{key}: source {cfg.source!r}, but this data set has no {cfg.source} split; remove "
                             f"{key}")
    m = fraction_size(cfg.fraction, n) if cfg.fraction is not None else int(cfg.count)
    if m < 1:
        raise PartitionError(f"{key}.fraction={cfg.fraction} keeps no sample of the {n} {cfg.source} samples; raise it")
    if m > n:
        raise PartitionError(f"{key}.count={m} exceeds the {n} samples of the {cfg.source} split; lower {key}.count")
    pick = np.random.RandomState([int(seed), 1]).choice(n, m, replace=False)
    return val_ids[pick], val_labels[pick]


def build_partition(pool_ids: np.ndarray, pool_labels: np.ndarray, cfg: PartitionConfigBase, name: str = "<name>",
                    natural: tuple[np.ndarray, np.ndarray] | None = None,
                    official_test: tuple[np.ndarray, np.ndarray] | None = None,
                    val: tuple[np.ndarray, np.ndarray] | None = None,
                    subjects: np.ndarray | None = None) -> pd.DataFrame:
    """Partition the pool and split each client; return the validated table.

    pool_ids: int64 [N] sample ids of the pool (the official train split, or with ``pool: all``
    every split: :func:`partition_pool`); pool_labels: int64 [N].
    natural: for ``scheme: natural``, the data set's own ``(client id int [N], local split str
    [N] in {"train", "test"})`` of each pool sample, in pool order (the sample table's
    ``natural_client`` / ``natural_split``).
    official_test: ``(sample ids int64 [M], labels int64 [M])`` of the official test split,
    used by ``local_test.rule: official_test`` only (:func:`split_official_test`); the local
    test rows then carry official-test sample ids (ids are unique across splits in the sample
    table, so the training stage finds them in the same arrays).
    val: ``(sample ids int64 [N_val], labels int64 [N_val])`` of the official val split, used by
    ``server_data`` only (:func:`draw_server_data`); with ``pool: all`` the server's samples are
    removed from the pool before anything else is drawn.
    subjects: int64 [N], each pool sample's subject (the sample table's ``subject_id``), read
    by ``scheme: subject`` only (every other scheme ignores it); None when the data set has none
    (``scheme: subject`` then stops naming the key).

    All draws come from one ``RandomState(cfg.seed)``: first, with ``data_fraction < 1``, the
    subset ``choice(N, floor(data_fraction * N), replace=False)`` of the pool (kept in the drawn
    order), then the partitioner's, then the local split's.

    Returns a :class:`PartitionTable` frame (sample_id, client_id, local_split, label),
    sorted by client then split (train, test, then val for the ``ratios`` rule); for the
    disjoint schemes one row per pool sample (after ``data_fraction``; ``dirichlet_pairs``
    with equal sizes leaves out fewer than K), plus, with ``official_test``, one per assigned
    official test sample; for ``per_client_dirichlet`` one row per (client, sample), a sample
    possibly in several clients (:class:`SharedPartitionTable`). With ``server_data``, the
    server's samples follow as rows with ``client_id = -1`` and ``local_split = "server"``;
    without it the table is exactly what it was before server data existed.
    Raises PartitionError naming the ``partitions.<name>`` key.
    """
    key = f"partitions.{name}"
    partitioner = make_partitioner(cfg, key)
    pool_ids, pool_labels = np.asarray(pool_ids), np.asarray(pool_labels)
    if subjects is not None:
        subjects = np.asarray(subjects)
        if len(subjects) != len(pool_ids):
            raise PartitionError(f"{key}: {len(subjects)} subject ids for {len(pool_ids)} pool samples (internal error)")
    test_ids = test_labels = None
    server = None
    if cfg.server_data is not None:
        server = draw_server_data(*(val if val is not None else ([], [])), cfg.server_data, cfg.seed,
                                  key=f"{key}.server_data")
        held = np.isin(pool_ids, server[0])
        if held.any() and cfg.pool != "all":
            raise PartitionError(f"{key}.server_data: {int(held.sum())} server samples are in the {cfg.pool} pool "
                                 "(internal error)")
        pool_ids, pool_labels = pool_ids[~held], pool_labels[~held]
        if subjects is not None:
            subjects = subjects[~held]
    rng = None
    if partitioner.draws:  # natural draws nothing (and takes no pool or data_fraction)
        rng = np.random.RandomState(cfg.seed)
        if cfg.data_fraction < 1.0:
            # the same draw as on the ids (choice over positions), so subjects follow their samples
            pos, pool_labels = draw_data_fraction(np.arange(len(pool_ids)), pool_labels, cfg.data_fraction,
                                                  cfg.num_clients, rng, key)
            pool_ids = pool_ids[pos]
            if subjects is not None:
                subjects = subjects[pos]
    if cfg.local_test is not None and cfg.local_test.rule == "official_test":
        test_ids, test_labels = (np.asarray(a) for a in (official_test or ([], [])))
        if len(test_ids) != len(test_labels):
            raise PartitionError(f"{key}: {len(test_ids)} official test ids for {len(test_labels)} labels "
                                 "(internal error)")
    splits = partitioner.client_splits(pool_labels, rng, cfg.local_test, natural=natural,
                                       test_labels=None if test_labels is None else test_labels.astype(np.int64),
                                       **({"subjects": subjects} if partitioner.needs_subjects else {}))
    rows = []
    for cid, (train, test, *rest) in enumerate(splits):
        rows.append(pd.DataFrame({"sample_id": pool_ids[train], "client_id": cid, "local_split": "train",
                                  "label": pool_labels[train]}))
        ids, labels = (pool_ids, pool_labels) if test_ids is None else (test_ids, test_labels)
        rows.append(pd.DataFrame({"sample_id": ids[test], "client_id": cid, "local_split": "test",
                                  "label": labels[test]}))
        if rest and len(rest[0]):  # the ratios rule's local val split
            val = rest[0]
            rows.append(pd.DataFrame({"sample_id": pool_ids[val], "client_id": cid, "local_split": "val",
                                      "label": pool_labels[val]}))
    if server is not None:
        rows.append(pd.DataFrame({"sample_id": server[0], "client_id": SERVER_CLIENT, "local_split": "server",
                                  "label": server[1]}))
    table = pd.concat(rows, ignore_index=True)
    n_server = 0 if server is None else len(server[0])
    if n_server:
        in_clients = table.loc[table["client_id"] != SERVER_CLIENT, "sample_id"]
        if np.isin(server[0], in_clients.to_numpy()).any():
            raise PartitionError(f"{key}.server_data: a server sample is also a client's (internal error)")
    if partitioner.shares_samples:
        return validate(SharedPartitionTable, table, f"partition {name}")
    table = validate(PartitionTable, table, f"partition {name}")
    from_pool = sum(len(s[0]) + (len(s[2]) if len(s) > 2 else 0) + (len(s[1]) if test_ids is None else 0)
                    for s in splits)
    if from_pool != len(pool_ids) and not partitioner.leaves_out:
        raise PartitionError(f"{key}: {from_pool} of {len(pool_ids)} pool samples assigned (internal error)")
    expected = from_pool + (0 if test_ids is None else sum(len(s[1]) for s in splits)) + n_server
    if len(table) != expected:
        raise PartitionError(f"{key}: {len(table)} rows for {from_pool} pool samples"
                             f"{'' if test_ids is None else ' and their official test shares'} (internal error)")
    return table


def _natural_splits(pool_labels: np.ndarray, num_clients: int, natural, key: str):
    if natural is None:
        raise PartitionError(f"{key}.scheme=natural: the data set has no natural clients (its sample table lacks "
                             "natural_client/natural_split; only generated federated sets such as "
                             "synthetic_<alpha>_<beta> have them); choose another scheme")
    client, split = (np.asarray(a) for a in natural)
    if len(client) != len(pool_labels) or len(split) != len(pool_labels):
        raise PartitionError(f"{key}: natural client/split arrays do not match the {len(pool_labels)} pool samples")
    k = int(client.max()) + 1
    if k != num_clients:
        raise PartitionError(f"{key}.num_clients={num_clients}, but the data set has {k} natural clients; "
                             f"set {key}.num_clients: {k}")
    out = []
    for cid in range(k):
        pos = np.flatnonzero(client == cid).astype(np.int64)
        train, test = pos[split[pos] == "train"], pos[split[pos] == "test"]
        if len(train) == 0 or len(test) == 0:
            raise PartitionError(f"{key}: natural client {cid} has {len(train)} local train and {len(test)} local "
                                 "test samples; both must be non-empty")
        out.append((train, test))
    return out


def client_class_counts(table: pd.DataFrame, num_classes: int) -> dict:
    """Per-client class counts of local train and local test: ``{client: {"train": [C], "test":
    [C]}}``, plus ``"val": [C]`` for every client when the table has local val rows (the
    ``ratios`` rule); without val rows the result is exactly as before val splits existed. The
    server's rows (``client_id = -1``) are not a client's: :func:`server_class_counts`."""
    splits = ("train", "test", "val") if (table["local_split"] == "val").any() else ("train", "test")
    out = {}
    for cid, grp in table[table["client_id"] != SERVER_CLIENT].groupby("client_id", sort=True):
        out[int(cid)] = {
            split: np.bincount(grp.loc[grp["local_split"] == split, "label"], minlength=num_classes).tolist()
            for split in splits
        }
    return out


def server_class_counts(table: pd.DataFrame, num_classes: int) -> list[int] | None:
    """Class counts of the server's unlabeled samples (``client_id = -1``; statistics of the
    partition only, never given to a method), or None when the table has none."""
    rows = table[table["client_id"] == SERVER_CLIENT]
    if rows.empty:
        return None
    return np.bincount(rows["label"], minlength=num_classes).tolist()
