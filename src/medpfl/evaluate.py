"""The evaluate stage: per-round metrics and the run summary of one training run.

Reads ``records.parquet``, ``rounds.parquet`` and ``job.json`` from the run folder; writes
``round_metrics.csv``, ``client_accuracy.csv``, ``metrics.json`` (with the environment
fingerprint that training recorded in ``job.json``) and ``curves.png`` (atomically) and logs
them, the per-round backward transfer and the summary metrics to the run's MLflow child run.
Metric definitions: :mod:`medpfl.metrics`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from medpfl.data.schemas import EvalRecords, RoundLog, validate  # noqa: E402
from medpfl.io import atomic_path, read_json, read_parquet, write_json, write_text  # noqa: E402
from medpfl.metrics import privacy_summary, summarize_run  # noqa: E402


def client_table(records: pd.DataFrame, num_clients: int) -> pd.DataFrame:
    """Per client: local test size, times sampled, mean accuracy after local training, and
    the final-round accuracy of the global and personalized models on its local test split."""
    out = pd.DataFrame({"client_id": range(num_clients)}).set_index("client_id")
    la = records[records["view"] == "local_after_training"].groupby("client_id")
    out["times_sampled"] = la.size().reindex(out.index, fill_value=0)
    out["local_after_training_acc_mean"] = la["accuracy"].mean()
    out["local_after_training_bal_acc_mean"] = la["balanced_accuracy"].mean()
    for view, name in (("global_on_local", "final_global_model"), ("personalized_on_local", "final_personalized")):
        v = records[records["view"] == view]
        if len(v):
            last = v[v["round"] == v["round"].max()].set_index("client_id")
            out[f"{name}_acc"] = last["accuracy"]
            out[f"{name}_bal_acc"] = last["balanced_accuracy"]
            out["local_test_size"] = last["n_samples"]
    return out.reset_index()


def run_curves(per: pd.DataFrame, out: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for col, label in (("global_test_acc", "global model, global test"),
                       ("global_on_local_mean", "global model, local tests (mean)"),
                       ("local_bal_acc_mean", "after local training (balanced, sampled)"),
                       ("personalized_acc_mean", "personalized models (mean)")):
        s = per[["round", col]].dropna()
        if len(s):
            ax.plot(s["round"], s[col], label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def global_test_status(views: set[str]) -> str:
    """Why a run's global-test metrics are present or null, from the views it recorded:
    ``"evaluated"``; ``"not applicable: the data set has no global test set"`` (a global model
    scored on local splits only, e.g. Synthetic(alpha, beta)); ``"not applicable: the method has
    no single global model"``. Written to ``metrics.json`` and as the MLflow tag ``global_test``,
    so a null column reads as not applicable rather than as a failure."""
    if "global_test" in views:
        return "evaluated"
    if "global_on_local" in views:
        return "not applicable: the data set has no global test set"
    return "not applicable: the method has no single global model"


def evaluate_run(run_dir: Path) -> dict:
    """Compute and write the run's metrics; return the summary dict."""
    job = read_json(run_dir / "job.json")
    records = validate(EvalRecords, read_parquet(run_dir / "records.parquet"), str(run_dir / "records.parquet"))
    rounds = validate(RoundLog, read_parquet(run_dir / "rounds.parquet"), str(run_dir / "rounds.parquet"))
    views = set(records["view"])
    # what the method has is what it recorded (capabilities may depend on its config)
    per, summary = summarize_run(records, rounds, job["num_clients"], "global_test" in views,
                                 "personalized_on_local" in views)
    size = job.get("model_size") or {}  # written by training (absent in runs made before it was)
    summary["trainable_params"] = size.get("trainable")
    summary["frozen_params"] = size.get("frozen")
    # DP-FedAvg's ε at δ (last round), or why a noisy run has none; nothing for other runs
    eps = per["epsilon"].iloc[-1] if "epsilon" in per and len(per) else None
    private = privacy_summary(job, None if eps is None or pd.isna(eps) else float(eps))
    if private is not None:
        summary.update(private[0])
    clients = client_table(records, job["num_clients"])
    write_text(run_dir / "round_metrics.csv", per.to_csv(index=False))
    write_text(run_dir / "client_accuracy.csv", clients.to_csv(index=False))
    run_curves(per, run_dir / "curves.png", f"{job['method']} on {job['dataset']}/{job['partition']}, seed {job['seed']}")
    run_file = run_dir / "mlflow_run.json"
    run_id = read_json(run_file)["run_id"] if run_file.exists() else None
    meta = {k: job[k] for k in ("study", "dataset", "partition", "method", "algorithm", "seed")}
    global_test = global_test_status(views)
    env = {"environment": job.get("environment")}  # the training session's fingerprint (None: trained before)
    if job.get("earlier_environments"):
        env["earlier_environments"] = job["earlier_environments"]
    privacy = {"privacy": private[1]} if private is not None else {}
    write_json(run_dir / "metrics.json", {**meta, "mlflow_run_id": run_id, "global_test": global_test, **privacy,
                                          "summary": summary, **env})
    if run_id is not None:
        from medpfl.tracking import RunLogger, run_name

        lg = RunLogger.reopen(run_file)
        # method first (the UI cuts long names from the right); set here rather than at training, so
        # that the name's form stays out of the training stage's code hash
        lg.rename(run_name(job["method"], job["seed"], job["dataset"], job["partition"]))
        lg.set_tags({"global_test": global_test, **privacy})
        lg.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        for _, row in per.iterrows():
            lg.log_metrics({c: row[c] for c in ("bwt", "global_on_local_worst", "local_acc_worst") if pd.notna(row[c])},
                           step=int(row["round"]))
        for name in ("metrics.json", "round_metrics.csv", "client_accuracy.csv", "curves.png"):
            lg.log_artifact(run_dir / name, "evaluation")
        lg.finish("FINISHED")
    return summary
