"""Federated-learning metrics: accuracy views, backward transfer, consistency, balance.

Definitions follow Fowler & AlRegib, "FedKPer" (ICIP 2026), Section 3.3 and 4.1, computed as
the authors' code does (``../shared/docs/fedkper-protocol.md`` Section 4 and ``docs/metrics.md``).
All functions are pure (numpy in, numpy or float out); :func:`summarize_run` turns a training
job's per-client evaluation records into per-round metrics and one summary per run.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def balanced_accuracy(correct_per_class: np.ndarray, count_per_class: np.ndarray) -> float:
    """Mean over the classes present (count > 0) of per-class accuracy.

    This is the FedKPer code's ``local on local classwise`` column, which Table 1 reports as
    "local accuracy" (protocol Section 4.2). Shapes ``[C]``; returns nan if no class is present.
    """
    present = count_per_class > 0
    if not present.any():
        return float("nan")
    return float(np.mean(correct_per_class[present] / count_per_class[present]))


def backward_transfer(acc: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """Per-round backward transfer on previously sampled clients (FedKPer eq. 10).

    acc: float [R, K], the global model's accuracy at the end of round r on client k's local
    test split. sampled: bool [R, K], client k was sampled in round r (or, with evaluation
    every few rounds, since the previous evaluated round).

    For each round r > 0 and client k that was sampled in an earlier round, the term is
    ``acc[r, k] - acc[t, k]`` where t < r is the most recent round in which k was sampled;
    the round's value is the mean of the terms, 0 if there are none (round 0). Clients
    sampled in round r are compared with their previous visit, then their stored accuracy
    is updated (the authors' ``BaseServer._update_and_evaluate``). Returns float [R].
    """
    acc = np.asarray(acc, dtype=np.float64)
    sampled = np.asarray(sampled, dtype=bool)
    if acc.shape != sampled.shape or acc.ndim != 2:
        raise ValueError(f"acc {acc.shape} and sampled {sampled.shape} must both be [rounds, clients]")
    rounds, k = acc.shape
    last = np.full(k, np.nan)
    out = np.zeros(rounds)
    for r in range(rounds):
        if r > 0:
            seen = ~np.isnan(last)
            if seen.any():
                out[r] = float(np.mean(acc[r, seen] - last[seen]))
        last[sampled[r]] = acc[r, sampled[r]]
    return out


def inter_peak_forgetting_rates(traj: np.ndarray, include_unrecovered_tail: bool = False) -> list[float]:
    """IPFR of every recovery interval of an accuracy trajectory (FedKPer eq. 7).

    Starting at peak i = 0, the interval ends at the first j > i with ``A_j >= A_i``; if
    ``j - i > 1`` its rate is ``(1/(j-i)) * sum_{t=i..j} |A_i - A_t| / A_i`` (both endpoints
    included, so an overshoot at j counts), and j becomes the next peak. Intervals without an
    intermediate round are skipped. A trailing interval that never recovers is ignored unless
    ``include_unrecovered_tail`` (then it ends at the last round). traj: float [T].
    """
    a = np.asarray(traj, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"trajectory must be 1-D, got shape {a.shape}")
    if np.isnan(a).any():
        raise ValueError("trajectory contains NaN")
    rates: list[float] = []
    i, n = 0, len(a)
    while i < n - 1:
        later = np.nonzero(a[i + 1:] >= a[i])[0]
        if len(later) == 0:
            if include_unrecovered_tail and n - 1 - i > 1 and a[i] > 0:
                j = n - 1
                rates.append(float(np.sum(np.abs(a[i] - a[i:j + 1]) / a[i]) / (j - i)))
            break
        j = i + 1 + int(later[0])
        if j - i > 1:  # a_i > 0 here: a_i = 0 is always recovered at i + 1
            rates.append(float(np.sum(np.abs(a[i] - a[i:j + 1]) / a[i]) / (j - i)))
        i = j
    return rates


def consistency(traj: np.ndarray, include_unrecovered_tail: bool = False) -> float:
    """``C = 1 - AIPFR`` (FedKPer eq. 8-9): 1 when accuracy never drops below a past peak.

    With no recovery interval (monotone, a single round, or only unrecovered drops) the
    value is 1 (protocol Section 4.2: assumption).
    """
    rates = inter_peak_forgetting_rates(traj, include_unrecovered_tail)
    return 1.0 if not rates else 1.0 - float(np.mean(rates))


def balance(avg_global_acc: float, avg_local_acc: float) -> float:
    """Global-local balance ``(A_g + A_k) / 2`` (FedKPer Section 4.1)."""
    return (avg_global_acc + avg_local_acc) / 2.0


def _nanstat(fn, x) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(fn(x)) if len(x) else float("nan")


def _dense_up(rounds: pd.DataFrame) -> np.ndarray:
    """The round log's ``bytes_up_dense`` as float (NaN where not recorded: runs made before it was)."""
    if "bytes_up_dense" not in rounds:
        return np.full(len(rounds), np.nan)
    return pd.to_numeric(rounds["bytes_up_dense"], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def best_val_summary(records: pd.DataFrame) -> dict[str, float]:
    """The FHBench protocol (spec B.2.4, B.7): per client, the test accuracy of the model it had
    right after local training at the evaluation round where that model's validation accuracy
    was highest (the first such round: the code's strict ``>``), then the unweighted mean over
    clients (``best_val_client_acc``) and the worst client (``best_val_client_acc_worst``).

    Uses the ``local_after_training`` records of the rounds that also have
    ``local_after_training_val`` records (the evaluation rounds); NaN when the partition has no
    validation splits. An optimistic, max-over-time selection: reported beside, never instead
    of, the final-round metrics.
    """
    val = records[records["view"] == "local_after_training_val"]
    if not len(val):
        return {"best_val_client_acc": float("nan"), "best_val_client_acc_worst": float("nan")}
    test = records[records["view"] == "local_after_training"].set_index(["client_id", "round"])["accuracy"]
    best = val.sort_values(["client_id", "round"]).loc[lambda d: d.groupby("client_id")["accuracy"].idxmax()]
    accs = test.reindex(list(zip(best["client_id"], best["round"]))).to_numpy(dtype=float)
    return {"best_val_client_acc": _nanstat(np.mean, accs), "best_val_client_acc_worst": _nanstat(np.min, accs)}


def worst_client(final: pd.DataFrame) -> dict[str, float]:
    """Who the worst client of the deployed models is, from one round's per-client records
    (``client_id``, ``accuracy``, ``n_samples``): ``final_client_acc_worst_client`` (its id; the
    lowest id among ties), ``final_client_acc_worst_test_size`` (its local test samples) and
    ``final_client_acc_worst_ties`` (how many clients share the lowest accuracy); NaN for each
    without a finite accuracy."""
    keys = ("final_client_acc_worst_client", "final_client_acc_worst_test_size", "final_client_acc_worst_ties")
    f = final[np.isfinite(final["accuracy"].to_numpy(dtype=float))] if len(final) else final
    if not len(f):
        return dict.fromkeys(keys, float("nan"))
    low = f[f["accuracy"] == f["accuracy"].min()].sort_values("client_id")
    first = low.iloc[0]
    return dict(zip(keys, (int(first["client_id"]), int(first["n_samples"]), int(len(low)))))


def summarize_run(records: pd.DataFrame, rounds: pd.DataFrame, num_clients: int, has_global_model: bool,
                  personalized: bool) -> tuple[pd.DataFrame, dict]:
    """Per-round metrics and the run summary from a training job's tables.

    records: :class:`medpfl.data.schemas.EvalRecords`; rounds: :class:`RoundLog`.
    Returns ``(per_round, summary)``. The paper-convention summaries (protocol Section 4.2)
    average over rounds with the std over rounds; the plain ones a user expects (final
    round, worst over all clients) are reported beside them under their own names; the worst
    client of the final round is named (:func:`worst_client`).
    """
    rounds = rounds.sort_values("round").reset_index(drop=True)
    r_all = rounds["round"].to_numpy()
    per = pd.DataFrame({"round": r_all})

    def view(name: str) -> pd.DataFrame:
        return records[records["view"] == name]

    # Global model on the global test set.
    g = view("global_test").set_index("round")
    per["global_test_acc"] = g["accuracy"].reindex(r_all).to_numpy(dtype=float)
    per["global_test_bal_acc"] = g["balanced_accuracy"].reindex(r_all).to_numpy(dtype=float)
    per["global_test_loss"] = g["loss"].reindex(r_all).to_numpy(dtype=float)

    # Global model on every client's local test split; BwT over evaluated rounds.
    gl = view("global_on_local")
    bwt = np.full(len(r_all), np.nan)
    if len(gl):
        mat = gl.pivot(index="round", columns="client_id", values="accuracy").reindex(columns=range(num_clients))
        eval_rounds = mat.index.to_numpy()
        sampled_since = np.zeros((len(eval_rounds), num_clients), dtype=bool)
        sampled = {int(r): [int(c) for c in str(s).split()] for r, s in zip(rounds["round"], rounds["sampled_clients"])}
        prev = -1
        for i, r in enumerate(eval_rounds):
            for rr in range(prev + 1, r + 1):
                sampled_since[i, sampled.get(rr, [])] = True
            prev = r
        b = backward_transfer(mat.to_numpy(), sampled_since)
        bwt = pd.Series(b, index=eval_rounds).reindex(r_all).to_numpy()
        per["global_on_local_mean"] = mat.mean(axis=1).reindex(r_all).to_numpy()
        per["global_on_local_worst"] = mat.min(axis=1).reindex(r_all).to_numpy()
    else:
        per["global_on_local_mean"] = np.nan
        per["global_on_local_worst"] = np.nan
    per["bwt"] = bwt

    # Each sampled client's model right after local training, on its local test split.
    la = view("local_after_training").groupby("round")
    per["local_bal_acc_mean"] = la["balanced_accuracy"].mean().reindex(r_all).to_numpy()
    per["local_bal_acc_worst"] = la["balanced_accuracy"].min().reindex(r_all).to_numpy()
    per["local_acc_mean"] = la["accuracy"].mean().reindex(r_all).to_numpy()
    per["local_acc_worst"] = la["accuracy"].min().reindex(r_all).to_numpy()

    # Each client's personalized model on its local test split (personalized methods).
    pv = view("personalized_on_local").groupby("round")
    per["personalized_acc_mean"] = pv["accuracy"].mean().reindex(r_all).to_numpy()
    per["personalized_acc_worst"] = pv["accuracy"].min().reindex(r_all).to_numpy()

    # The model each client deploys, on its own local test split, unweighted mean over all
    # clients (the pFedKD-WCL paper's "average test accuracy", spec A.3.4).
    per["deployed_acc_mean"] = per["personalized_acc_mean" if personalized else "global_on_local_mean"]

    for col in ("bytes_up", "bytes_down", "train_seconds", "eval_seconds", "round_seconds"):
        per[col] = rounds[col].to_numpy()
    # Compression ratio of the round's uploads: bytes sent / the same uploads sent dense (1 for a
    # method that sends its tensors as they are; NaN where nothing is sent or the dense size was
    # not recorded).
    per["bytes_up_dense"] = _dense_up(rounds)
    with np.errstate(divide="ignore", invalid="ignore"):
        per["compression_ratio"] = np.where(per["bytes_up_dense"] > 0,
                                            per["bytes_up"] / per["bytes_up_dense"], np.nan)
    per["cum_seconds"] = per["round_seconds"].cumsum()
    if "epsilon" in rounds:  # DP-FedAvg (train.dp): ε at δ after each round; absent otherwise
        per["epsilon"] = pd.to_numeric(rounds["epsilon"], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)

    s: dict[str, float] = {"rounds": int(len(r_all)), "num_clients": int(num_clients)}
    gacc = per["global_test_acc"].to_numpy()
    if has_global_model and not np.all(np.isnan(gacc)):
        ge = gacc[~np.isnan(gacc)]
        s["avg_global_acc"] = float(np.mean(ge))
        s["avg_global_acc_std_rounds"] = float(np.std(ge))
        s["final_global_acc"] = float(ge[-1])
        s["final_global_bal_acc"] = _nanstat(lambda x: x[-1], per["global_test_bal_acc"])
        be = bwt[~np.isnan(bwt)]
        s["avg_global_bwt"] = float(np.mean(be)) if len(be) else float("nan")
        s["avg_global_bwt_std_rounds"] = float(np.std(be)) if len(be) else float("nan")
        s["global_consistency"] = consistency(ge)
        s["global_consistency_incl_tail"] = consistency(ge, include_unrecovered_tail=True)
    else:
        for k in ("avg_global_acc", "avg_global_acc_std_rounds", "final_global_acc", "final_global_bal_acc",
                  "avg_global_bwt", "avg_global_bwt_std_rounds", "global_consistency", "global_consistency_incl_tail"):
            s[k] = float("nan")

    lb = per["local_bal_acc_mean"].to_numpy()
    lbe = lb[~np.isnan(lb)]
    s["avg_local_acc"] = float(np.mean(lbe)) if len(lbe) else float("nan")
    s["avg_local_acc_std_rounds"] = float(np.std(lbe)) if len(lbe) else float("nan")
    s["avg_local_acc_plain"] = _nanstat(np.mean, per["local_acc_mean"])
    s["avg_worst_client_acc"] = _nanstat(np.mean, per["local_bal_acc_worst"])
    s["avg_worst_client_acc_plain"] = _nanstat(np.mean, per["local_acc_worst"])
    s["local_consistency"] = consistency(lbe) if len(lbe) else float("nan")
    # The paper ignores a final drop that never recovers (protocol 4.2); on short runs whose
    # best round comes early that leaves C = 1, so the variant that counts it is reported too.
    s["local_consistency_incl_tail"] = consistency(lbe, include_unrecovered_tail=True) if len(lbe) else float("nan")
    s["balance"] = balance(s["avg_global_acc"], s["avg_local_acc"]) if has_global_model else float("nan")

    # Plain view: the model each client would deploy at the end, over all clients.
    last_r = int(r_all[-1])
    deploy = view("personalized_on_local" if personalized else "global_on_local")
    final = deploy[deploy["round"] == deploy["round"].max()] if len(deploy) else deploy
    s["final_client_acc_mean"] = _nanstat(np.mean, final["accuracy"]) if len(final) else float("nan")
    s["final_client_acc_worst"] = _nanstat(np.min, final["accuracy"]) if len(final) else float("nan")
    s.update(worst_client(final))
    s["final_client_bal_acc_mean"] = _nanstat(np.mean, final["balanced_accuracy"]) if len(final) else float("nan")
    # Pooled over clients: total correct / total tested (the PFPS-LWC paper's "top-1 accuracy",
    # spec B.4), which weights clients by their test-split size.
    s["final_client_acc_pooled"] = (float(final["correct"].sum() / final["n_samples"].sum())
                                    if len(final) and final["n_samples"].sum() > 0 else float("nan"))
    # The same over the last 10 evaluated rounds: a check that the final round is not an outlier
    # (pFedKD-WCL spec A.1.6 item 7).
    dep = per["deployed_acc_mean"].dropna().to_numpy()
    s["final10_client_acc_mean"] = float(np.mean(dep[-10:])) if len(dep) else float("nan")
    # Clients that no round trained (never sampled; pFedMe-style methods train every client):
    # their personalized score is whatever the method gives a client it never trained
    # (docs/methods.md, "Never-trained clients").
    trained = view("local_after_training")["client_id"].unique()
    s["clients_never_trained"] = int(num_clients - len(set(int(c) for c in trained)))
    lg = view("local_on_global_test")
    s["final_local_models_on_global_test"] = _nanstat(np.mean, lg["accuracy"]) if len(lg) else float("nan")

    s["bytes_up_total"] = int(rounds["bytes_up"].sum())
    s["bytes_down_total"] = int(rounds["bytes_down"].sum())
    s["mb_per_round"] = float((rounds["bytes_up"] + rounds["bytes_down"]).mean() / 1e6)
    s["mb_up_per_round"] = float(rounds["bytes_up"].mean() / 1e6)
    s["mb_down_per_round"] = float(rounds["bytes_down"].mean() / 1e6)
    s["compression_ratio"] = _nanstat(np.mean, per["compression_ratio"])
    s["peak_memory_mb"] = (float(rounds["peak_memory_bytes"].max() / 1e6) if "peak_memory_bytes" in rounds
                           and rounds["peak_memory_bytes"].notna().any() else float("nan"))
    s.update(best_val_summary(records))
    s["seconds_per_round"] = float(rounds["round_seconds"].mean())
    s["train_seconds_per_round"] = float(rounds["train_seconds"].mean())
    s["eval_seconds_per_round"] = float(rounds["eval_seconds"].mean())
    s["wall_seconds"] = float(rounds["round_seconds"].sum())
    s["last_round"] = last_r
    s = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
    return per, s


def privacy_summary(job: dict, last_epsilon: float | None) -> tuple[dict, str] | None:
    """What a run's ``metrics.json`` says about privacy (``medpfl.fl.privacy``; ``docs/methods.md``,
    "Differential privacy"), from its job description and the ε of
    its last round (``rounds.parquet``'s ``epsilon``, None where absent): ``({"epsilon", "dp_delta"},
    statement)``, or None for a run without DP, upload noise or FedMIC's noise (its summary is then
    unchanged). ε is null where the noise fits no mechanism with a bounded sensitivity."""
    train = job.get("train") or {}
    dp = train.get("dp")
    upload = [t.get("name") for t in (train.get("upload") or [])]
    if dp:
        rounds = train.get("rounds")
        eps = None if last_epsilon is None or not math.isfinite(last_epsilon) else float(last_epsilon)
        return ({"epsilon": eps, "dp_delta": float(dp["delta"])},
                f"DP-FedAvg (McMahan et al., ICLR 2018): client-level (ε, δ) = ({eps if eps is None else f'{eps:.4g}'}, "
                f"{dp['delta']:g}) after {rounds} rounds; clip S = {dp['clip_norm']:g}, noise multiplier z = "
                f"{dp['noise_multiplier']:g}, opacus {dp.get('accountant', 'rdp').upper()} accountant with q = m/K and "
                "one step per round; it assumes Poisson sampling of clients (here: m without replacement), a trusted "
                "server and a secret client sample (docs/methods.md, Differential privacy)")
    fedmic_tau = (job.get("method_params") or {}).get("dp_noise_std") if job.get("algorithm") == "fedmic" else None
    if fedmic_tau:
        return ({"epsilon": None, "dp_delta": None},
                f"no (ε, δ): FedMIC's noise τ = {fedmic_tau:g} (dp_noise_std, spec A.7) is added to unclipped updates, "
                "whose sensitivity is unbounded, so it fits no Gaussian mechanism and no ε can be stated")
    if "gaussian" in upload:
        clipped = "clip" in upload[:upload.index("gaussian")]
        why = ("the updates are clipped first, but the server sees every noisy upload and no local-DP accounting is "
               "done here" if clipped else
               "it is added to unclipped updates, whose sensitivity is unbounded, so no ε can be stated")
        return ({"epsilon": None, "dp_delta": None},
                f"no (ε, δ): client-side Gaussian noise on the uploads (train.upload): {why}")
    return None
