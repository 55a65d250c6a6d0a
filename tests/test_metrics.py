"""Tests of medpfl.metrics on hand-computed values: BwT (FedKPer eq. 10 as the authors' code
computes it, protocol Section 4.1), consistency / IPFR (eq. 7-9, protocol Section 4.2),
balance, balanced accuracy, and the run summary built from EvalRecords / RoundLog tables."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from medpfl.data.schemas import EvalRecords, RoundLog, validate
from medpfl.metrics import (
    backward_transfer,
    balance,
    balanced_accuracy,
    consistency,
    inter_peak_forgetting_rates,
    summarize_run,
    worst_client,
)

approx = pytest.approx

# ----------------------------------------------------------------------------- backward transfer


def test_backward_transfer_hand_computed():
    acc = np.array([
        [0.50, 0.60, 0.70],
        [0.40, 0.80, 0.60],
        [0.30, 0.90, 0.65],
        [0.45, 0.50, 0.20],
    ])
    sampled = np.array([
        [1, 0, 0],
        [0, 1, 0],
        [1, 0, 0],
        [0, 0, 0],
    ], dtype=bool)
    # r0: 0 by definition.                          stored: c0 = 0.50
    # r1: c0: 0.40 - 0.50 = -0.10                   stored: c1 = 0.80
    # r2: c0 (sampled now, compared with its previous visit first): 0.30 - 0.50 = -0.20;
    #     c1: 0.90 - 0.80 = +0.10 -> mean -0.05     stored: c0 = 0.30
    # r3: c0: 0.45 - 0.30 = 0.15; c1: 0.50 - 0.80 = -0.30 -> mean -0.075
    # c2 is never sampled and never counts.
    out = backward_transfer(acc, sampled)
    assert out.shape == (4,)
    assert out == approx([0.0, -0.10, -0.05, -0.075])
    acc2 = acc.copy()
    acc2[:, 2] = [0.0, 1.0, 0.0, 1.0]
    assert backward_transfer(acc2, sampled) == approx(out)


def test_backward_transfer_round_zero_is_zero_and_no_history_is_zero():
    acc = np.array([[0.9, 0.1], [0.2, 0.3], [0.5, 0.5]])
    # sampled in round 0 but round 0 itself is 0; nothing sampled before round 2 -> 0 there too
    out = backward_transfer(acc, np.array([[0, 0], [0, 0], [1, 1]], dtype=bool))
    assert out.tolist() == [0.0, 0.0, 0.0]
    out = backward_transfer(acc, np.array([[1, 1], [0, 0], [0, 0]], dtype=bool))
    assert out == approx([0.0, ((0.2 - 0.9) + (0.3 - 0.1)) / 2, ((0.5 - 0.9) + (0.5 - 0.1)) / 2])


def test_backward_transfer_shape_errors():
    with pytest.raises(ValueError, match="rounds, clients"):
        backward_transfer(np.zeros((3, 2)), np.zeros((3, 3), dtype=bool))
    with pytest.raises(ValueError):
        backward_transfer(np.zeros(3), np.zeros(3, dtype=bool))


# ----------------------------------------------------------------------------- consistency


TRAJ = [0.5, 0.4, 0.3, 0.6, 0.7, 0.65, 0.7, 0.2, 0.1]
# peak 0 (0.5) recovers at 3 (0.6 >= 0.5): (0 + .1 + .2 + .1) / .5 / 3
R1 = (0.0 + 0.1 + 0.2 + 0.1) / 0.5 / 3
# peak 3 (0.6) -> 4 (0.7): j = i + 1, skipped
# peak 4 (0.7) -> 6 (0.7, equal counts as recovered): (0 + .05 + 0) / .7 / 2
R2 = (0.0 + 0.05 + 0.0) / 0.7 / 2
# peak 6 (0.7) never recovers: ignored, or with the flag (0 + .5 + .6) / .7 / 2
R3 = (0.0 + 0.5 + 0.6) / 0.7 / 2


def test_ipfr_hand_computed():
    assert inter_peak_forgetting_rates(TRAJ) == approx([R1, R2])
    assert consistency(TRAJ) == approx(1 - (R1 + R2) / 2)
    assert inter_peak_forgetting_rates(TRAJ, include_unrecovered_tail=True) == approx([R1, R2, R3])
    assert consistency(TRAJ, include_unrecovered_tail=True) == approx(1 - (R1 + R2 + R3) / 3)


def test_ipfr_includes_the_overshoot_at_the_recovery_round():
    # |0.5 - 0.9| at j counts: (0 + 0.1 + 0.4) / 0.5 / 2 = 0.5
    assert inter_peak_forgetting_rates([0.5, 0.4, 0.9]) == approx([0.5])
    assert consistency([0.5, 0.4, 0.9]) == approx(0.5)


def test_ipfr_divides_by_interval_length_not_point_count():
    # interval 0..4, 5 points, divided by j - i = 4
    a = [0.8, 0.4, 0.4, 0.4, 0.8]
    assert inter_peak_forgetting_rates(a) == approx([(0 + 0.5 + 0.5 + 0.5 + 0) / 4])


@pytest.mark.parametrize("traj", [
    [0.7],                        # a single round
    [0.1, 0.2, 0.2, 0.3, 0.9],    # monotone (ties recover at once)
    [0.9, 0.8, 0.7, 0.1],         # only drops: no recovery interval
    [0.0, 0.0, 0.0],              # all zero
    [],                           # empty
])
def test_consistency_is_one_without_recovery_interval(traj):
    assert inter_peak_forgetting_rates(traj) == []
    assert consistency(traj) == 1.0


def test_only_drops_with_tail_flag():
    # tail interval 0..3 of peak 0.9
    expected = (0 + 0.1 + 0.2 + 0.8) / 0.9 / 3
    assert inter_peak_forgetting_rates([0.9, 0.8, 0.7, 0.1], include_unrecovered_tail=True) == approx([expected])
    # a tail of one round has no intermediate round: still skipped
    assert inter_peak_forgetting_rates([0.5, 0.9, 0.3], include_unrecovered_tail=True) == []


def test_zero_peak_does_not_divide_by_zero():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # 0 -> 0 -> 0.3 recover at once; peak 0.3 at 2 recovers at 4: (0 + .2 + 0) / .3 / 2
        assert inter_peak_forgetting_rates([0.0, 0.0, 0.3, 0.1, 0.3]) == approx([0.2 / 0.3 / 2])
        assert consistency([0.0, 0.0], include_unrecovered_tail=True) == 1.0
        assert consistency([0.0, 0.5, 0.0, 0.0], include_unrecovered_tail=True) == approx(1 - (0.5 + 0.5) / 0.5 / 2)


def test_ipfr_input_errors():
    with pytest.raises(ValueError, match="NaN"):
        consistency([0.5, float("nan"), 0.6])
    with pytest.raises(ValueError, match="1-D"):
        consistency(np.zeros((2, 2)))


def test_balance_and_balanced_accuracy():
    assert balance(0.6, 0.8) == approx(0.7)
    assert balance(0.409, 0.775) == approx(0.592)
    # class 2 absent: mean over classes 0 and 1 only (3/4 and 1/2), not 4/6 plain and not /3
    assert balanced_accuracy(np.array([3, 1, 0]), np.array([4, 2, 0])) == approx(0.625)
    assert balanced_accuracy(np.array([5, 0]), np.array([5, 5])) == approx(0.5)
    assert np.isnan(balanced_accuracy(np.zeros(3), np.zeros(3)))


# ----------------------------------------------------------------------------- summarize_run


def _rounds(sampled: list[str], bytes_up=None, bytes_down=None) -> pd.DataFrame:
    n = len(sampled)
    df = pd.DataFrame({
        "round": np.arange(n),
        "lr": [0.01 * 0.99 ** r for r in range(n)],
        "sampled_clients": sampled,
        "num_sampled": [len(s.split()) for s in sampled],
        "bytes_up": bytes_up if bytes_up is not None else [1_000_000 * (r + 1) for r in range(n)],
        "bytes_down": bytes_down if bytes_down is not None else [500_000] * n,
        "train_seconds": [1.0] * n,
        "eval_seconds": [0.5] * n,
        "round_seconds": [2.0 + r for r in range(n)],
    })
    return validate(RoundLog, df, "rounds")


def _rec(rnd, view, cid, acc, bal=None, n=100):
    return {"round": rnd, "view": view, "client_id": cid, "n_samples": n, "correct": int(round(acc * n)),
            "accuracy": acc, "balanced_accuracy": acc if bal is None else bal, "loss": 1.0}


GLOBAL_TEST = [0.6, 0.5, 0.7]
GLOBAL_ON_LOCAL = [[0.5, 0.6, 0.2], [0.4, 0.7, 0.3], [0.6, 0.5, 0.9]]
SAMPLED = ["0 1", "2 0", "1"]
# (round, client, plain acc, balanced acc) of the model right after local training
LOCAL = [(0, 0, 0.90, 0.8), (0, 1, 0.80, 0.6), (1, 2, 0.70, 0.5), (1, 0, 0.95, 0.9), (2, 1, 0.85, 0.1)]
PERSONALIZED = [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.8, 0.3, 0.7]]


def _records(global_model=True, personalized=False) -> pd.DataFrame:
    rows = []
    for r in range(3):
        if global_model:
            rows.append(_rec(r, "global_test", -1, GLOBAL_TEST[r], bal=GLOBAL_TEST[r] - 0.1))
            for c in range(3):
                rows.append(_rec(r, "global_on_local", c, GLOBAL_ON_LOCAL[r][c]))
        if personalized:
            for c in range(3):
                rows.append(_rec(r, "personalized_on_local", c, PERSONALIZED[r][c]))
    for r, c, a, b in LOCAL:
        rows.append(_rec(r, "local_after_training", c, a, bal=b))
    if not global_model:
        for c in range(3):
            rows.append(_rec(2, "local_on_global_test", c, [0.3, 0.4, 0.5][c]))
    return validate(EvalRecords, pd.DataFrame(rows), "records")


def test_summarize_run_global_method():
    per, s = summarize_run(_records(), _rounds(SAMPLED), num_clients=3, has_global_model=True, personalized=False)
    assert per["round"].tolist() == [0, 1, 2]
    # global accuracy: mean over rounds, std over rounds, last round
    assert s["avg_global_acc"] == approx(0.6)
    assert s["avg_global_acc_std_rounds"] == approx(np.std(GLOBAL_TEST))
    assert s["avg_global_acc_std_rounds"] == approx(np.sqrt(0.02 / 3))
    assert s["final_global_acc"] == approx(0.7)
    assert s["final_global_bal_acc"] == approx(0.6)
    # consistency of [0.6, 0.5, 0.7]: (0 + 0.1 + 0.1) / 0.6 / 2
    assert s["global_consistency"] == approx(1 - 0.2 / 0.6 / 2)
    # BwT: r0 0; r1 c0 0.4-0.5, c1 0.7-0.6 -> 0; r2 c0 0.6-0.4, c1 0.5-0.6, c2 0.9-0.3 -> 0.7/3
    assert per["bwt"].tolist() == approx([0.0, 0.0, 0.7 / 3])
    assert s["avg_global_bwt"] == approx(0.7 / 9)
    assert s["avg_global_bwt_std_rounds"] == approx(np.std([0.0, 0.0, 0.7 / 3]))
    # local accuracy: BALANCED accuracy of local_after_training, mean over sampled, then rounds
    assert per["local_bal_acc_mean"].tolist() == approx([0.7, 0.7, 0.1])
    assert s["avg_local_acc"] == approx(0.5)
    assert s["avg_local_acc_std_rounds"] == approx(np.std([0.7, 0.7, 0.1]))
    assert s["avg_local_acc_plain"] == approx(np.mean([0.85, 0.825, 0.85]))
    # worst client: per-round min over the sampled clients (0.6, 0.5, 0.1), averaged over rounds
    assert per["local_bal_acc_worst"].tolist() == approx([0.6, 0.5, 0.1])
    assert s["avg_worst_client_acc"] == approx(0.4)
    assert s["avg_worst_client_acc_plain"] == approx(np.mean([0.8, 0.7, 0.85]))
    # [0.7, 0.7, 0.1]: the tie recovers at once, then an unrecovered tail
    assert s["local_consistency"] == 1.0
    assert s["balance"] == approx((0.6 + 0.5) / 2)
    # deployed model of a non-personalized method: the global model on every client's local split,
    # at the last round, over ALL clients (not only the sampled ones)
    assert s["final_client_acc_worst"] == approx(0.5)
    assert s["final_client_acc_mean"] == approx(2.0 / 3)
    assert per["global_on_local_worst"].tolist() == approx([0.2, 0.3, 0.5])
    # communication and time
    assert s["mb_per_round"] == approx(((1 + 2 + 3) + 3 * 0.5) / 3)
    assert s["bytes_up_total"] == 6_000_000 and s["bytes_down_total"] == 1_500_000
    assert s["seconds_per_round"] == approx(3.0) and s["wall_seconds"] == approx(9.0)
    assert per["cum_seconds"].tolist() == approx([2.0, 5.0, 9.0])
    assert s["rounds"] == 3 and s["num_clients"] == 3 and s["last_round"] == 2
    assert s["final_local_models_on_global_test"] is None
    json.dumps(s)  # JSON-ready (None for missing values, plain Python numbers)


def test_summarize_run_personalized_method_deploys_personalized_model():
    _, s = summarize_run(_records(personalized=True), _rounds(SAMPLED), 3, has_global_model=True, personalized=True)
    # last round of personalized_on_local, not the global model's 0.5 and not an earlier round's 0.1/0.2
    assert s["final_client_acc_worst"] == approx(0.3)
    # named: client 1 (0.3 in the last round), with its local test size
    assert (s["final_client_acc_worst_client"], s["final_client_acc_worst_ties"]) == (1, 1)
    assert s["final_client_acc_worst_test_size"] == 100
    assert s["final_client_acc_mean"] == approx(0.6)
    assert s["avg_global_acc"] == approx(0.6)


def test_final_pooled_client_accuracy_weights_clients_by_test_size():
    """Total correct / total tested over all clients at the final round (PFPS-LWC spec B.4):
    clients of 100, 300 and 600 test samples at 0.9, 0.5, 0.2 give (90 + 150 + 120) / 1000."""
    rows = [_rec(0, "global_test", -1, 0.5)]
    for c, (acc, n) in enumerate([(0.9, 100), (0.5, 300), (0.2, 600)]):
        rows += [_rec(0, "global_on_local", c, 0.5, n=n), _rec(0, "personalized_on_local", c, acc, n=n)]
    rows.append(_rec(0, "local_after_training", 0, 0.5))
    rec = validate(EvalRecords, pd.DataFrame(rows), "records")
    _, s = summarize_run(rec, _rounds(["0"]), 3, has_global_model=True, personalized=True)
    assert s["final_client_acc_pooled"] == approx(0.36)
    assert s["final_client_acc_mean"] == approx(1.6 / 3)
    assert (s["final_client_acc_worst_client"], s["final_client_acc_worst_test_size"]) == (2, 600)


def test_worst_client_ties_and_no_values():
    f = pd.DataFrame({"client_id": [4, 2, 7], "accuracy": [0.0, 0.0, 0.5], "n_samples": [9, 34, 5]})
    assert worst_client(f) == {"final_client_acc_worst_client": 2, "final_client_acc_worst_test_size": 34,
                               "final_client_acc_worst_ties": 2}
    assert all(np.isnan(v) for v in worst_client(f.iloc[:0]).values())


def test_deployed_accuracy_per_round_and_over_the_last_rounds():
    """The pFedKD-WCL paper's "average test accuracy": per round, the unweighted mean over ALL
    clients of the deployed model's local test accuracy; summarised at the final round and over
    the last 10 evaluated rounds (here all 3)."""
    per, s = summarize_run(_records(personalized=True), _rounds(SAMPLED), 3, has_global_model=True, personalized=True)
    assert per["deployed_acc_mean"].tolist() == approx([0.1, 0.2, 0.6])  # personalized models
    assert s["final10_client_acc_mean"] == approx(0.3)
    per, s = summarize_run(_records(), _rounds(SAMPLED), 3, has_global_model=True, personalized=False)
    assert per["deployed_acc_mean"].tolist() == approx([1.3 / 3, 1.4 / 3, 2.0 / 3])  # the global model
    assert s["final10_client_acc_mean"] == approx(4.7 / 9)
    # evaluated every other round: only the evaluated rounds count, the last 10 of 12
    records = pd.concat([_rec_frame(r, 0.04 * r) for r in range(0, 24, 2)], ignore_index=True)
    sampled = ["0"] * 24
    per, s = summarize_run(validate(EvalRecords, records, "records"), _rounds(sampled), 3, has_global_model=True,
                           personalized=True)
    assert s["final10_client_acc_mean"] == approx(np.mean([0.04 * r for r in range(4, 24, 2)]))
    assert s["final_client_acc_mean"] == approx(0.04 * 22)


def _rec_frame(rnd: int, acc: float) -> pd.DataFrame:
    rows = [_rec(rnd, "global_test", -1, 0.5)] + [_rec(rnd, "global_on_local", c, 0.5) for c in range(3)]
    rows += [_rec(rnd, "personalized_on_local", c, acc) for c in range(3)]
    return pd.DataFrame(rows)


def test_summarize_run_without_global_model():
    per, s = summarize_run(_records(global_model=False, personalized=True), _rounds(SAMPLED), 3,
                           has_global_model=False, personalized=True)
    for k in ("avg_global_acc", "avg_global_acc_std_rounds", "final_global_acc", "final_global_bal_acc",
              "avg_global_bwt", "avg_global_bwt_std_rounds", "global_consistency", "balance"):
        assert s[k] is None, k
    assert per["global_test_acc"].isna().all() and per["bwt"].isna().all()
    assert s["avg_local_acc"] == approx(0.5)
    assert s["avg_worst_client_acc"] == approx(0.4)
    assert s["final_client_acc_worst"] == approx(0.3)
    assert s["final_local_models_on_global_test"] == approx(0.4)
    json.dumps(s)


def test_summarize_run_has_global_model_false_ignores_global_records():
    # a method declared without a global model gets None even if such records exist
    _, s = summarize_run(_records(), _rounds(SAMPLED), 3, has_global_model=False, personalized=False)
    assert s["avg_global_acc"] is None and s["balance"] is None


def test_summarize_run_evaluated_every_other_round():
    # the global model is evaluated in rounds 0 and 2 only; client 1 sampled in the unevaluated
    # round 1 counts as "sampled since the previous evaluation" at round 2
    rows = [
        _rec(0, "global_test", -1, 0.5), _rec(2, "global_test", -1, 0.7),
        *[_rec(0, "global_on_local", c, a) for c, a in enumerate([0.5, 0.6, 0.7])],
        *[_rec(2, "global_on_local", c, a) for c, a in enumerate([0.4, 0.8, 0.2])],
        _rec(0, "local_after_training", 0, 0.9), _rec(1, "local_after_training", 1, 0.8),
        _rec(2, "local_after_training", 2, 0.7),
    ]
    records = validate(EvalRecords, pd.DataFrame(rows), "records")
    per, s = summarize_run(records, _rounds(["0", "1", "2"]), 3, has_global_model=True, personalized=False)
    # eval round 0: 0 (stores c0 = 0.5); eval round 2: only c0 was seen before: 0.4 - 0.5
    assert per["bwt"].iloc[0] == 0.0 and np.isnan(per["bwt"].iloc[1]) and per["bwt"].iloc[2] == approx(-0.1)
    assert s["avg_global_bwt"] == approx(-0.05)
    assert s["avg_global_acc"] == approx(0.6)  # mean over the evaluated rounds only
    assert s["final_global_acc"] == approx(0.7)
    assert np.isnan(per["global_test_acc"].iloc[1])
    assert s["avg_local_acc"] == approx(0.8)
    assert s["final_client_acc_worst"] == approx(0.2)
