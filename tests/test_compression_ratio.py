"""The per-round compression ratio of the uploads (``bytes_up / bytes_up_dense``) for every method:
the dense size of a payload counted by hand, a FedMIC run's ratio from the factors it actually
sent, FedAvg's exactly 1, Local's not applicable, and runs recorded before the column existed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.data.schemas import RoundLog, validate
from medpfl.fl.payload import LowRank, payload_dense_nbytes, payload_nbytes, payload_nbytes_parts, svd_encode
from medpfl.fl.tree import tree_stack
from medpfl.metrics import summarize_run
from medpfl.train import round_scalars
from tests.test_contract import run


def test_dense_bytes_of_a_known_payload_by_hand():
    # two clients; a 6 x 10 matrix of rank 2 and a conv kernel 4 x 2 x 3 x 3 (seen as 4 x 18) of rank 1,
    # a bias of 6 and the sample count
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(6, 2, generator=gen) @ torch.randn(2, 10, generator=gen)
    k = torch.outer(torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.linspace(-1, 1, 18)).reshape(4, 2, 3, 3)
    one = {"w": svd_encode(m, 0.98), "k": svd_encode(k, 0.98), "b": torch.ones(6)}
    assert int(one["w"].rank) == 2 and int(one["k"].rank) == 1
    up = {"update": tree_stack([one, one]), "num_samples": torch.tensor([20.0, 30.0])}
    # per client: w 2 (6 + 10 + 1) floats + its rank (8), k 1 (4 + 18 + 1) floats + 8, b 6 floats; n 1 float
    sent = 2 * ((34 * 4 + 8) + (23 * 4 + 8) + 6 * 4) + 2 * 4
    dense = 2 * (60 * 4 + 72 * 4 + 6 * 4) + 2 * 4  # the full tensors; the bias and n as they are
    assert (sent, dense) == (544, 1112)
    assert payload_nbytes(up) == sent and payload_dense_nbytes(up) == dense
    # the same count in two parts, as the engine takes it: the shapes' bytes on the host, the
    # factors' bytes (which depend on the ranks) as a tensor read with the round's records
    known, ranked = payload_nbytes_parts(up)
    assert known == 2 * (8 + 8 + 6 * 4) + 2 * 4 and ranked.dtype == torch.int64 and ranked.dim() == 0
    assert known + int(ranked) == sent
    assert payload_nbytes_parts({"b": torch.zeros(2, 6)}) == (48, None)  # no LowRank leaf: no tensor part
    # uncompressed leaves count as they are: a payload without LowRank leaves is its own dense size
    plain = {"model": {"w": torch.zeros(2, 6, 10), "b": torch.zeros(2, 6)}, "num_samples": torch.zeros(2)}
    assert payload_dense_nbytes(plain) == payload_nbytes(plain) == (120 + 12 + 2) * 4
    # a matrix sent dense inside a LowRank leaf (factors not smaller): P Q numbers + its rank vs P Q
    full = svd_encode(torch.randn(3, 3, generator=gen), 0.98)
    assert isinstance(full, LowRank) and int(full.rank) == 3
    assert payload_nbytes(full) == 9 * 4 + 8 and payload_dense_nbytes(full) == 9 * 4


def _by_hand(stacked: dict) -> tuple[int, int]:
    """(bytes sent, bytes dense) of one round's stacked FedMIC uploads, counted from the ranks."""
    sent = dense = 0
    for v in stacked["update"].values():
        if isinstance(v, LowRank):
            p, q = v.u.shape[-2], v.vh.shape[-1]
            for r in v.rank.tolist():
                sent += min(r * (p + q + 1), p * q) * 4 + 8
                dense += p * q * 4
        else:
            sent += v.numel() * 4
            dense += v.numel() * 4
    n = stacked["num_samples"]
    return sent + n.numel() * n.element_size(), dense + n.numel() * n.element_size()


def test_fedmic_run_ratio_is_the_factors_over_the_dense_tensors(fed_data):
    crossed: list = []
    algo, res = run(fed_data, "fedmic", "sequential", model="cnn4", capture=crossed)
    rounds = res.rounds
    assert "bytes_up_dense" in rounds and len(crossed) == len(rounds)
    hand = [_by_hand(u) for u in crossed]
    assert rounds["bytes_up"].tolist() == [s for s, _ in hand]
    assert rounds["bytes_up_dense"].tolist() == [d for _, d in hand]
    # the dense size does not depend on the ranks: m x (every update tensor's numel) x 4 + m x 4 for n
    numel = sum(int(np.prod(s)) for s in algo.update_shapes().values())
    assert rounds["bytes_up_dense"].tolist() == [m * (numel * 4 + 4) for m in rounds["num_sampled"]]
    per, s = summarize_run(res.records, rounds, fed_data.num_clients, has_global_model=True, personalized=True)
    ratios = [a / b for a, b in hand]
    assert per["compression_ratio"].tolist() == pytest.approx(ratios, rel=1e-12)
    assert s["compression_ratio"] == pytest.approx(float(np.mean(ratios)), rel=1e-12)
    assert 0 < s["compression_ratio"] < 1  # GPD compresses (the paper: 11.49 % on ResNet101)


def test_fedavg_ratio_is_one_and_fedmic_c_close_to_one(fed_data):
    _, avg = run(fed_data, "fedavg", "sequential", model="cnn4")
    assert (avg.rounds["bytes_up"] == avg.rounds["bytes_up_dense"]).all()
    per, s = summarize_run(avg.records, avg.rounds, fed_data.num_clients, has_global_model=True, personalized=False)
    assert per["compression_ratio"].tolist() == [1.0] * len(per) and s["compression_ratio"] == 1.0
    _, c = run(fed_data, "fedmic", "sequential", model="cnn4", gpd=False)  # FedMIC-C: dense updates
    _, s = summarize_run(c.records, c.rounds, fed_data.num_clients, has_global_model=True, personalized=True)
    assert s["compression_ratio"] == 1.0


def test_local_sends_nothing_and_old_round_logs_have_no_ratio(fed_data):
    _, loc = run(fed_data, "local", "sequential", model="cnn4")
    assert (loc.rounds["bytes_up"] == 0).all() and (loc.rounds["bytes_up_dense"] == 0).all()
    per, s = summarize_run(loc.records, loc.rounds, fed_data.num_clients, has_global_model=False, personalized=True)
    assert per["compression_ratio"].isna().all() and s["compression_ratio"] is None
    # a round log written before bytes_up_dense existed, and one resumed from such a checkpoint
    base = {"lr": 0.01, "sampled_clients": "0", "num_sampled": 1, "bytes_up": 50, "bytes_down": 100,
            "train_seconds": 1.0, "eval_seconds": 0.0, "round_seconds": 1.0}
    old = validate(RoundLog, pd.DataFrame([{"round": r, **base} for r in range(2)]), "rounds")
    assert "bytes_up_dense" not in old
    rec = loc.records[loc.records["round"] < 2]
    per, s = summarize_run(rec, old, fed_data.num_clients, has_global_model=False, personalized=True)
    assert per["compression_ratio"].isna().all() and s["compression_ratio"] is None
    mixed = validate(RoundLog, pd.DataFrame([{"round": 0, **base}, {"round": 1, **base, "bytes_up_dense": 200}]),
                     "rounds")
    assert str(mixed["bytes_up_dense"].dtype) == "Int64"
    per, s = summarize_run(rec, mixed, fed_data.num_clients, has_global_model=False, personalized=True)
    assert np.isnan(per["compression_ratio"].iloc[0]) and per["compression_ratio"].iloc[1] == 0.25
    assert s["compression_ratio"] == 0.25


def test_live_round_scalars_carry_the_upload_ratio_only_where_there_is_one():
    """The live MLflow scalar ``upload_compression_ratio`` = bytes_up / bytes_up_dense; absent
    without the column, with a missing value, or when nothing was sent (0 dense bytes)."""
    row = {"round": 0, "lr": 0.01, "bytes_up": 544, "bytes_down": 100, "round_seconds": 1.0, "train_seconds": 0.5}
    recs = [{"view": "local_after_training", "accuracy": 0.5, "balanced_accuracy": 0.25, "loss": 1.0}]
    with_dense = round_scalars(recs, {**row, "bytes_up_dense": 1112})
    assert with_dense["upload_compression_ratio"] == 544 / 1112
    assert with_dense.pop("upload_compression_ratio") and with_dense == round_scalars(recs, row)
    for missing in ({}, {"bytes_up_dense": 0}, {"bytes_up_dense": None}, {"bytes_up_dense": pd.NA}):
        assert "upload_compression_ratio" not in round_scalars(recs, {**row, **missing}), missing
    assert "compression_ratio" not in round_scalars(recs, {**row, "bytes_up_dense": 1112})  # the summary's name
