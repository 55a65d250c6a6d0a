"""The FHBench protocol's engine and metric parts: the cosine learning-rate schedule (stepped once
per round), the validation views on evaluation rounds, and the test accuracy at each client's
best-validation round (``best_val_client_acc``)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.compose import validate_params
from medpfl.config import OptimizerConfig, ParamsError, TrainConfig
from medpfl.metrics import best_val_summary


def test_cosine_schedule_equals_pytorch_stepped_once_per_round():
    opt = OptimizerConfig(lr=1e-3, schedule="cosine", min_lr=1e-6)
    w = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([w], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=200, eta_min=1e-6)
    for r in range(200):
        assert opt.round_lr(r, 200) == pytest.approx(sgd.param_groups[0]["lr"], rel=1e-9, abs=1e-15)
        sgd.step()
        sched.step()
    assert opt.round_lr(0, 200) == 1e-3 and opt.round_lr(100, 200) == pytest.approx((1e-3 + 1e-6) / 2)
    # t_max overrides the number of rounds
    assert OptimizerConfig(lr=1.0, schedule="cosine", min_lr=0.0, t_max=4).round_lr(2, 200) == pytest.approx(0.5)
    # the default stays the exponential decay, and its job description does not gain the new keys
    assert OptimizerConfig(lr=0.1, lr_decay=0.5).round_lr(3, 10) == pytest.approx(0.1 * 0.5**3)
    assert "schedule" not in TrainConfig().model_dump()["optimizer"]
    assert TrainConfig(optimizer={"schedule": "cosine"}).model_dump()["optimizer"]["schedule"] == "cosine"
    with pytest.raises(ParamsError, match=r"train\.optimizer\.schedule"):
        validate_params({"train": {"optimizer": {"schedule": "cosin"}}})


def _rec(round_, view, client, acc, n=10):
    return {"round": round_, "view": view, "client_id": client, "n_samples": n, "correct": int(round(acc * n)),
            "accuracy": acc, "balanced_accuracy": acc, "loss": 0.1}


def test_best_val_client_acc_takes_the_test_accuracy_at_the_first_best_validation_round():
    rows = []
    # client 0: val 0.5, 0.8, 0.8 -> first best at round 9 -> test 0.6
    for r, v, t in ((4, 0.5, 0.9), (9, 0.8, 0.6), (14, 0.8, 0.7)):
        rows += [_rec(r, "local_after_training_val", 0, v), _rec(r, "local_after_training", 0, t)]
    # client 1: best val at round 4 -> test 0.3; its other rounds' test records do not matter
    for r, v, t in ((4, 0.9, 0.3), (9, 0.1, 1.0), (14, 0.2, 1.0)):
        rows += [_rec(r, "local_after_training_val", 1, v), _rec(r, "local_after_training", 1, t)]
    # non-evaluation rounds have test records only; they are never selected
    rows += [_rec(5, "local_after_training", 0, 1.0), _rec(5, "local_after_training", 1, 1.0)]
    s = best_val_summary(pd.DataFrame(rows))
    assert s["best_val_client_acc"] == pytest.approx((0.6 + 0.3) / 2)
    assert s["best_val_client_acc_worst"] == pytest.approx(0.3)
    none = best_val_summary(pd.DataFrame([_rec(0, "local_after_training", 0, 0.5)]))
    assert all(math.isnan(v) for v in none.values())


def _with_val(fed_data):
    """fed_data with each client's local test split cut in two: the first half its validation split."""
    from dataclasses import replace

    halves = [(t[: len(t) // 2], t[len(t) // 2:]) for t in fed_data.client_test]
    return replace(fed_data, client_val=[v for v, _ in halves], client_test=[t for _, t in halves])


@pytest.mark.parametrize("method", ["fedavg", "local"])
def test_validation_views_are_recorded_on_evaluation_rounds_only(fed_data, method):
    from medpfl.config import EvalConfig
    from medpfl.fl.engine import Engine
    from medpfl.metrics import summarize_run
    from tests.conftest import make_algo

    data = _with_val(fed_data)
    train = TrainConfig(rounds=3, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0)
    res = Engine(make_algo(method), data, train, EvalConfig(every=2), seed=1, fingerprint="val").run()
    rec = res.records
    lat, latv = rec[rec["view"] == "local_after_training"], rec[rec["view"] == "local_after_training_val"]
    assert sorted(lat["round"].unique()) == [0, 1, 2] and sorted(latv["round"].unique()) == [1, 2]
    # the same clients' same models: one val record per test record of an evaluation round
    assert set(zip(latv["round"], latv["client_id"])) == set(zip(lat["round"], lat["client_id"])) - {
        (0, c) for c in lat.loc[lat["round"] == 0, "client_id"]}
    sizes = {c: len(v) for c, v in enumerate(data.client_val)}
    assert all(row.n_samples == sizes[row.client_id] for row in latv.itertuples())
    other = "global_on_val" if method == "fedavg" else "personalized_on_val"
    assert sorted(rec.loc[rec["view"] == other, "round"].unique()) == [1, 2]
    _, s = summarize_run(rec, res.rounds, data.num_clients, method == "fedavg", method == "local")
    assert s["best_val_client_acc"] is not None and 0 <= s["best_val_client_acc"] <= 1
    # without validation splits nothing of this is recorded
    plain = Engine(make_algo(method), fed_data, train, EvalConfig(every=2), seed=1, fingerprint="val").run()
    assert not plain.records["view"].str.endswith("_val").any()
