"""Synthetic(alpha, beta): the FedProx federated data set as the pFedKD-WCL code generates it.

Spec A.3.2 (HengruiH/pFedKD ``utils/synthetic.py``, after Li et al. 2020, FedProx). For K
clients, d features and C classes, all draws from one ``numpy.random.RandomState(seed)``
(the legacy generator, in the order of the official code, which calls the global
``np.random.*`` unseeded):

1. ``n_k = (int(lognormal(mean=4, sigma=2)) + 50) * 5`` (one draw of K; the ``* 5`` is
   pFedKD-specific, FedProx has none);
2. ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``: **alpha and beta are standard deviations**
   (``normal(0, alpha)``), not variances; the bias mean is ``u_k`` too;
3. ``v_k ~ N(B_k, 1)^d`` for every client (all K first);
4. per client in order: ``W_k ~ N(u_k, 1)^{d x C}``, ``b_k ~ N(u_k, 1)^C``, then
   ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``, j = 1..d, ``n_k`` samples, and
   ``y = argmax(softmax(x W_k + b_k)) = argmax(x W_k + b_k)``;
5. per client in order: a random permutation of its samples; the first
   ``int(train_fraction * n_k)`` are local train, the rest local test (the code uses
   ``torch.randperm``; here the same RandomState continues).

``x`` is drawn as ``v_k + z * sqrt(diag(Sigma))`` from ``standard_normal((n_k, d))``: the same
normals ``RandomState.multivariate_normal`` draws, which for a diagonal Sigma with descending
entries equals it up to the sign of each column of the SVD basis (LAPACK-dependent); the explicit
form is portable and exact. Features are not normalised.

The file (``write_fedprox_synthetic``) is an uncompressed ``.npz`` with ``features`` float32
``[N, d]`` (computed in float64, stored float32 as the processed data set is), ``labels``
int64 ``[N]``, ``client_id`` int64 ``[N]`` and ``local_split`` uint8 ``[N]`` (0 train, 1 test),
rows grouped by client in the order of step 5 (its train samples, then its test samples), plus
``params`` (a JSON string of the generator's arguments). Same arguments, same bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from medpfl.io import md5sum, write_npz

KEYS = ("features", "labels", "client_id", "local_split", "params")


@dataclass(frozen=True)
class FedProxSynthetic:
    """One generated data set in memory: per client, its samples and its local split."""

    features: np.ndarray  # float64 [N, d]
    labels: np.ndarray  # int64 [N]
    client_id: np.ndarray  # int64 [N]
    local_split: np.ndarray  # uint8 [N], 0 = local train, 1 = local test
    sizes: np.ndarray  # int64 [K], n_k
    u: np.ndarray  # float64 [K], the means of W_k and b_k
    b_mean: np.ndarray  # float64 [K], B_k


def client_sizes(rng: np.random.RandomState, num_clients: int) -> np.ndarray:
    """``(int(lognormal(4, 2)) + 50) * 5`` for each client (the first draws of the stream)."""
    return (rng.lognormal(4, 2, num_clients).astype(int) + 50) * 5


def generate(alpha: float, beta: float, num_clients: int = 100, dimension: int = 60, num_classes: int = 10,
             seed: int = 0, train_fraction: float = 0.75) -> FedProxSynthetic:
    """Draw Synthetic(alpha, beta); see the module docstring for the exact order of draws.

    Raises ValueError for a negative alpha/beta, or non-positive sizes, or a train fraction
    outside (0, 1).
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta are standard deviations and must be >= 0, got alpha={alpha}, beta={beta}")
    if num_clients < 1 or dimension < 1 or num_classes < 2:
        raise ValueError(f"need num_clients >= 1, dimension >= 1, num_classes >= 2; got {num_clients}, {dimension}, "
                         f"{num_classes}")
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    rng = np.random.RandomState(seed)
    sizes = client_sizes(rng, num_clients)
    u = rng.normal(0, alpha, num_clients)
    b_mean = rng.normal(0, beta, num_clients)
    sd = np.sqrt(np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2))
    v = np.stack([rng.normal(b_mean[i], 1, dimension) for i in range(num_clients)])
    xs, ys = [], []
    for i in range(num_clients):
        w = rng.normal(u[i], 1, (dimension, num_classes))
        b = rng.normal(u[i], 1, num_classes)
        x = v[i] + rng.standard_normal((int(sizes[i]), dimension)) * sd
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1).astype(np.int64))
    feats, labels, cids, splits = [], [], [], []
    for i in range(num_clients):
        n = int(sizes[i])
        perm = rng.permutation(n)
        n_train = int(train_fraction * n)
        feats.append(xs[i][perm])
        labels.append(ys[i][perm])
        cids.append(np.full(n, i, dtype=np.int64))
        splits.append((np.arange(n) >= n_train).astype(np.uint8))
    return FedProxSynthetic(np.concatenate(feats), np.concatenate(labels), np.concatenate(cids),
                            np.concatenate(splits), sizes.astype(np.int64), u, b_mean)


@dataclass(frozen=True)
class SyntheticArgs:
    alpha: float
    beta: float
    num_clients: int = 100
    dimension: int = 60
    num_classes: int = 10
    seed: int = 0
    train_fraction: float = 0.75


def write_fedprox_synthetic(out: str | Path, args: SyntheticArgs) -> str:
    """Generate and write the file atomically (layout in the module docstring); return its MD5."""
    g = generate(**asdict(args))
    write_npz(out, {"features": g.features.astype(np.float32), "labels": g.labels, "client_id": g.client_id,
                    "local_split": g.local_split, "params": np.array(json.dumps(asdict(args), sort_keys=True))})
    return md5sum(out)
