"""``benchmarks/gpu_campaign.py collect``: the merged results as Markdown, and part 4's runs
turned into the study's report (medpfl's own report stage, run here on the returned runs)."""

from __future__ import annotations

import tarfile
from pathlib import Path


def _f(x, nd=2, unit=""):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}{unit}"
    return f"{x}{unit}"


def _spread(s: dict | None, nd=3) -> str:
    if not s or not s.get("n"):
        return "—"
    return f"{s['median']:.{nd}f} [{s['p25']:.{nd}f}–{s['p75']:.{nd}f}] (n={s['n']})"


def _mem(m: dict | None) -> str:
    if not m:
        return "—"
    if "gpu_max_allocated_gib" in m:
        return f"{m['gpu_max_allocated_gib']:.2f} GiB alloc / {m['gpu_max_reserved_gib']:.2f} reserved"
    return f"RSS {m['cpu_maxrss_gib']:.2f} GiB (CPU)"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def markdown(merged: dict) -> str:
    m = merged["machine"]
    gpu = m.get("gpu") or {}
    v = m.get("versions", {})
    L = [f"# GPU campaign: {merged['machine_name']} ({merged['date']})", ""]
    if merged.get("dry_run"):
        L += ["**Dry run** (`--dry-run`, tiny sizes): proves that every part starts and writes its file. "
              "Its timings are not measurements.", ""]
    L += [f"- machine: {gpu.get('name') or 'no GPU'}"
          + (f", {gpu.get('memory_gib', 0):.0f} GiB, {gpu.get('multiprocessors')} SMs, capability "
             f"{gpu.get('capability')}, nvidia-smi: {gpu.get('nvidia_smi')}" if gpu else "")
          + f"; CPU {m.get('cpu_model')} x{m.get('cpu_count')}",
          f"- Python {m.get('python')}, torch {v.get('torch')} (CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}), numpy "
          f"{v.get('numpy')}, pandas {v.get('pandas')}, transformers {v.get('transformers')}, peft {v.get('peft')}",
          f"- precision flags: {m.get('flags')}",
          f"- prepared from commit {(m.get('prepared') or {}).get('commit')}; parts: {', '.join(sorted(merged['parts']))}",
          ""]
    for key, part in sorted(merged["parts"].items()):
        r = part.get("result") or {}
        L += [f"## {key}: {part.get('status')} in {_f(part.get('wall_s'), 1)} s", ""]
        if part.get("error"):
            L += ["```", part["error"][-1500:], "```", ""]
        for n in part.get("notes") or []:
            L.append(f"- note: {n}")
        if part.get("notes"):
            L.append("")
        fn = {1: _p1, 2: _p2, 3: _p3, 4: _p4, 5: _p5}.get(part.get("part"))
        if fn and r:
            L += fn(r)
    if merged.get("table1_report"):
        L += ["## FedKPer Table 1 report (built here from the returned runs)", "", f"{merged['table1_report']}", ""]
    return "\n".join(L) + "\n"


def _p1(r):
    L = [f"`{r.get('command')}`: {(r.get('summary') or {}).get('counts')}", ""]
    for f, t in (r.get("tolerance") or {}).items():
        L.append(f"- tolerance, {f}: {t}")
    L.append("")
    rows = []
    for t in r.get("tests") or []:
        p = t.get("properties") or {}
        rows.append([t["name"], t["outcome"], _f(t["time_s"], 1), p.get("max_abs_d_correct", "—"),
                     p.get("max_abs_d_loss", "—"), p.get("mean_abs_d_accuracy", "—"), p.get("max_abs_d_server", "—"),
                     (t.get("message") or "")[:80]])
    return L + _table(["test", "outcome", "s", "max |d correct|", "max |d loss|", "mean |d acc|", "max |d server|",
                       "message"], rows)


def _p2(r):
    L = [f"CUDA init {_f(r.get('cuda_init_s'), 3)} s. " + (r.get("protocol") or {}).get("fedkper_round", ""), ""]
    rows = [[x["participation"], x["executor"], x["m"], _spread(x["train_s_per_round"]),
             _spread(x["eval_s_per_round"]), _f(x["samples_per_s"], 0), _spread(x["ms_per_client_step"], 2),
             _mem(x["peak_memory"]), _f(x.get("gpu_util_pct"), 0), _f(x["warmup"]["wall_s"], 2)]
            for x in r.get("fedkper_round") or []]
    L += _table(["participation", "executor", "m", "train s/round median [IQR]", "eval s/round", "samples/s",
                 "ms per client-step", "peak memory", "GPU util %", "warm-up run s"], rows)
    for k, x in (r.get("ratios") or {}).items():
        L.append(f"- {k}: stacked / sequential samples/s = {_f(x['stacked_over_sequential_samples_per_s'])}x; "
                 f"paired per-round speed-up {_spread(x['paired_round_speedup'], 2)}")
    sw = r.get("m_sweep") or {}
    if sw:
        L += ["", f"m-sweep: K = {sw.get('k')}, {sw.get('epochs')} local epoch; warm-up runs {sw.get('warmup_s')}", ""]
        L += _table(["m", "executor", "status", "train s/round", "ms per client-step", "samples/s", "peak memory"],
                    [[x["m"], x["executor"], x["status"], _spread(x.get("train_s_per_round")),
                      _spread(x.get("ms_per_client_step"), 2), _f(x.get("samples_per_s"), 0), _mem(x.get("peak_memory"))]
                     for x in sw.get("rows") or []])
        for ex, fit in (sw.get("fit") or {}).items():
            f = fit["train_s_per_round_vs_m"]
            L.append(f"- fit {ex}: train s/round = {_f(f['intercept'], 4)} + {_f(f['slope'], 5)} x m "
                     f"(R² {_f(f['r2'], 3)}, {f['points']} points)")
        L.append("")
    L += _table(["mode", "status", "train s/round median", "capture s"],
                [[g.get("mode"), g.get("status"), _f(g.get("train_s_per_round_median"), 3), _f(g.get("capture_s"), 3)]
                 for g in r.get("graphs") or []])
    return L


def _p3(r):
    if not r.get("present") or r.get("reason"):
        return [f"PFLlib: {r.get('reason')}", ""]
    L = [f"Setting: {r.get('setting')}", ""]
    L += _table(["run", "library", "train s/round", "eval s/round", "round s", "samples/s", "final acc (client "
                 "splits)", "final acc (official test)", "rc"],
                [[x["tag"], x.get("library", "—"), _f(x.get("train_s_per_round"), 3), _f(x.get("eval_s_per_round"), 3),
                  _f(x.get("round_s"), 3), _f(x.get("samples_per_s"), 0), _f(x.get("final_acc_union_client_splits"), 4),
                  _f(x.get("final_acc_official"), 4), x["rc"]] for x in r.get("runs") or []])
    for k, x in (r.get("ratios") or {}).items():
        L.append(f"- {k}: " + ", ".join(f"{kk} {vv:.3f}" for kk, vv in x.items()))
    return L + [""]


def _p4(r):
    L = [f"{(r.get('study') or {}).get('study')}; shard {r.get('shard')}; {r.get('parallel')} jobs at a time, "
         f"{r.get('threads_per_job')} threads each; {r.get('path')}",
         f"Wall time of this shard: {_f(r.get('wall_s'), 1)} s; sum of the jobs' wall times "
         f"{_f(r.get('sum_job_wall_s'), 1)} s; runs tarball {r.get('runs_tarball')}", ""]
    L += _table(["method", "seed", "rc", "rounds", "job wall s", "s/round", "executor", "avg global acc",
                 "avg local acc", "final global acc"],
                [[x["method"], x["seed"], x["rc"], x.get("rounds", "—"), _f(x.get("wall_s"), 1),
                  _f(x.get("s_per_round"), 3), x.get("executor", "—"), _f(x.get("avg_global_acc"), 4),
                  _f(x.get("avg_local_acc"), 4), _f(x.get("final_global_acc"), 4)]
                 for x in sorted(r.get("runs") or [], key=lambda x: (x["seed"], x["method"]))])
    return L


def _p5(r):
    return _table(["model", "executor", "px", "weights", "clients/round", "train s/round (after the 1st)",
                   "1st round train s", "eval s/round", "images/s", "peak memory", "status"],
                  [[x["model"], x["executor"], x.get("image_size"), x.get("weights", "—"), x.get("m", "—"),
                    _spread(x.get("train_s_per_round")), _f(x.get("first_round_train_s"), 2),
                    _spread(x.get("eval_s_per_round")), _f(x.get("train_images_per_s"), 1), _mem(x.get("peak_memory")),
                    x["status"]] for x in r.get("runs") or []])


def table1_report(tars: list[Path], study_dir: Path, title: str) -> str:
    """Unpack part 4's run tarballs into ``study_dir/runs`` and build medpfl's report of the
    finished runs into ``study_dir/report`` (with the paper's Table 1 side by side). Returns the
    report's ``table.md`` path, or why there is none."""
    from medpfl.evaluate import evaluate_run
    from medpfl.report import build_report

    runs = study_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for t in tars:
        with tarfile.open(t) as tar:
            tar.extractall(runs, filter="data")
    dirs = sorted(p.parent for p in runs.rglob("records.parquet"))
    done = []
    for d in dirs:
        if not (d / "metrics.json").is_file():
            evaluate_run(d)
        done.append(d)
    if not done:
        return "no finished runs in the tarballs"
    root = Path(__file__).resolve().parents[1]
    paths = build_report(done, study_dir / "report", [], title=title,
                         paper_table=root / "config" / "papers" / "fedkper-table1.yaml", reference="fedavg")
    return str(paths.get("table_md") or paths)
