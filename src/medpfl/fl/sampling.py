"""Seeded schedules shared by every method: which clients train in which round, and the
order of each client's mini-batches.

Separate random streams: the partition (``partitions.<name>.seed``), the client schedule
(this module, ``train.sampling``), the weight initialisation (``torch.manual_seed(seed)``)
and each client's batch order (:func:`medpfl.fl.program.phase_plan`, keyed by seed, round and
client, so a resumed run and both executors draw identical batches without carrying generator
state).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


def clients_per_round(num_clients: int, participation: float) -> int:
    """``max(int(K * participation), 1)``, as the FedKPer/FedNTD ``_client_sampling``."""
    return max(int(num_clients * participation), 1)


def client_schedule(num_clients: int, participation: float, rounds: int, scheme: str = "round_seeded",
                    seed: int = 0) -> np.ndarray:
    """The sampled clients of every round: int64 ``[rounds, m]``.

    round_seeded: round r uses ``RandomState(r).choice(K, m, replace=False)``, the FedKPer
    code's ``np.random.seed(round_idx); np.random.choice(...)``: identical for every seed and
    method. seed_round: round r uses ``default_rng(derive_seed("client-schedule", seed,
    r)).choice(K, m, replace=False)``: a different schedule for every seed, the same for every
    method with that seed (so comparisons paired by seed stay paired), and round r's clients do
    not depend on the number of rounds. stream: one ``default_rng(seed)`` stream,
    ``rng.choice(K, m, replace=False)`` per round. Order within a round is the draw order (the
    order clients train in).
    """
    m = clients_per_round(num_clients, participation)
    out = np.empty((rounds, m), dtype=np.int64)
    if scheme == "round_seeded":
        for r in range(rounds):
            out[r] = np.random.RandomState(r).choice(num_clients, m, replace=False)
    elif scheme == "seed_round":
        for r in range(rounds):
            out[r] = np.random.default_rng(derive_seed("client-schedule", seed, r)).choice(num_clients, m, replace=False)
    elif scheme == "stream":
        rng = np.random.default_rng(seed)
        for r in range(rounds):
            out[r] = rng.choice(num_clients, m, replace=False)
    else:
        raise ValueError(f"train.sampling.scheme: unknown scheme {scheme!r}; known: round_seeded, seed_round, stream")
    return out


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from a tuple, stable across processes and Python versions."""
    h = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


@contextmanager
def seeded_cpu_rng(*parts: int | str) -> Iterator[None]:
    """Run a block with PyTorch's CPU generator seeded from ``derive_seed(*parts)``, and restore
    the generator's state afterwards (the CUDA generators are not touched). The engine builds
    each client's initial state inside ``seeded_cpu_rng("client_state", seed, client)`` for a
    method with ``seeded_client_init``: a method that draws it at random (on the CPU) gets the
    same draw in both executors, whatever the number or order of clients, and independent of
    the global model's initialisation."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(*parts))
        yield
