"""The five parts of ``benchmarks/gpu_campaign.py`` (imported by ``run`` after the carried
wheels and ``src`` are on the path). Each ``partN_<name>(ctx, checkpoint)`` returns its result
dict (``_status``: ``ok`` | ``partial`` | ``absent`` | ``failed``) and calls ``checkpoint(partial)`` after
each step, so a command stopped at its limit still leaves a results file."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from benchmarks.gpu_campaign import ROOT, log

# ----------------------------------------------------------------------------- shared helpers


def spread(values) -> dict:
    """Median and spread of a list of seconds (n, median, p25, p75, min, max, mean)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return {"n": 0}
    q = np.percentile(v, [25, 75])
    return {"n": len(v), "median": statistics.median(v), "p25": float(q[0]), "p75": float(q[1]), "min": min(v),
            "max": max(v), "mean": statistics.fmean(v)}


def linear_fit(x, y) -> dict:
    """Least-squares ``y = intercept + slope * x`` with R^2 (None with fewer than 2 points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"slope": None, "intercept": None, "r2": None, "points": int(len(x))}
    slope, intercept = np.polyfit(x, y, 1)
    pred = intercept + slope * x
    ss = float(((y - y.mean()) ** 2).sum())
    return {"slope": float(slope), "intercept": float(intercept),
            "r2": 1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None, "points": int(len(x))}


def oom_error():
    import torch

    return getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def reset_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> dict:
    import resource

    import torch

    out = {"cpu_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        out["gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def run_subprocess(cmd, ctx, log_path: Path, timeout: float, env: dict | None = None, cwd=None) -> dict:
    """Run ``cmd`` with its output in ``log_path``; kill its process group at ``timeout``."""
    t = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                                cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    tail = log_path.read_text(errors="replace").splitlines()[-40:]
    return {"rc": rc, "wall_s": time.perf_counter() - t, "log_tail": tail}


def load_blood(ctx):
    from medpfl.data.preprocess import load_processed

    return load_processed(ctx.data["arrays"], ctx.data["samples"])


# ----------------------------------------------------------------------------- part 1: the GPU tests
TOLERANCE = {
    "tests/test_gpu_methods.py": "every registered method, stacked vs sequential on the device (5 synthetic clients, "
                                 "3 per round, 1 epoch, 2 rounds): same records; per record |d correct| <= "
                                 "max(1, ceil(0.05 n)); |d loss| <= 2e-2 + 2e-2 |loss|; mean |d accuracy| <= 0.01; "
                                 "bytes up/down within 5 %; measured maxima in each test's properties",
    "tests/test_seed_stack.py": "train.stack_seeds on CUDA: 3 FedKPer seeds stacked vs their separate stacked runs: "
                                "counts equal, losses within 1e-4",
    "tests/test_device_plans.py": "train.sampling.plans: device: the plans drawn on CUDA equal the CPU's",
    "tests/test_gpu.py": "FedAvg and FedKPer, CUDA sequential and stacked vs the CPU sequential reference: "
                         "accuracies within 0.02; bf16 autocast computes in bfloat16, mean accuracy within 0.05",
}


def parse_junit(path: Path) -> list[dict]:
    tests = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome, message = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], \
                    (el.get("message") or "")[:500]
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        tests.append({"name": tc.get("name"), "file": tc.get("classname"), "outcome": outcome,
                      "time_s": float(tc.get("time") or 0), "message": message, "properties": props})
    return tests


def part1_tests(ctx, checkpoint) -> dict:
    junit = ctx.work / "part1-junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "tests/test_gpu_methods.py",
           "tests/test_seed_stack.py::test_stacked_seeds_on_cuda_equal_their_separate_runs",
           "tests/test_device_plans.py::test_cuda_draws_the_cpu_plans", "-q", "-rfEs",
           "-p", "no:cacheprovider", "-o", "junit_family=legacy", f"--junitxml={junit}"]
    k = ctx.tests_k
    if k:
        cmd += ["-k", k]
    elif ctx.dry_run:  # one stackable method and the one that is not (its check is the error path)
        k = "dry run: fedavg and fedala only"
        cmd[3:7] = ["tests/test_gpu.py", *[f"tests/test_gpu_methods.py::test_stacked_matches_sequential_on_the_device"
                                           f"[{m}]" for m in ("fedavg", "fedala")]]
    env = {**os.environ, "MEDPFL_GPU_TEST_DEVICE": ctx.device}
    log(" ".join(cmd[1:]))
    res = run_subprocess(cmd, ctx, ctx.work / "part1-pytest.log", ctx.remaining() - 15, env=env, cwd=ROOT)
    tests = parse_junit(junit) if junit.is_file() else []
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    status = "ok" if tests and res["rc"] == 0 else ("partial" if res["rc"] == "timeout" else "failed")
    if res["rc"] not in (0, "timeout") and tests and not counts.get("failed") and not counts.get("error"):
        status = "failed"
    return {"_status": status, "command": " ".join(map(str, cmd[1:])), "tolerance": TOLERANCE,
            "summary": {"rc": res["rc"], "wall_s": res["wall_s"], "counts": counts, "k": k},
            "tests": tests, "log_tail": res["log_tail"]}


# ----------------------------------------------------------------------------- part 2: executors
GRAPH_FIELD = "cuda_graphs"  # TrainConfig.cuda_graphs (issue 32): the stacked executor's steps captured as CUDA graphs


def _engine_run(data, executor: str, participation: float, rounds: int, epochs: int, eval_every: int,
                precision: str = "fp32", extra: dict | None = None) -> dict:
    """One Engine run of FedKPer on cnn4 (``benchmarks/executors.py``'s round): per-round rows,
    the run's wall time (construction included), its peak memory and mean GPU utilisation."""
    import torch

    from benchmarks.executors import GpuSampler
    from medpfl.algorithms import resolve_method
    from medpfl.config import EvalConfig, TrainConfig
    from medpfl.fl.engine import Engine
    from medpfl.fl.functional import make_forward
    from medpfl.models import build_model

    cls, cfg = resolve_method("fedkper", {})
    algo = cls(cfg, make_forward(build_model("cnn4", 3, 8, 28).to("meta")), 8)
    train = TrainConfig(rounds=rounds, participation=participation, local_epochs=epochs, batch_size=12,
                        executor=executor, precision=precision, checkpoint_every=0, **(extra or {}))
    dev = data.device
    reset_memory(dev)
    t = time.perf_counter()
    with GpuSampler(dev) as gpu:
        res = Engine(algo, data, train, EvalConfig(every=eval_every, batch_size=4096), seed=1,
                     executor_kind=executor).run()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t
    sizes = np.array([len(tr) for tr in data.client_train])
    rows = []
    for _, r in res.rounds.iterrows():
        ids = [int(c) for c in str(r["sampled_clients"]).split()]
        rows.append({"round": int(r["round"]), "m": int(r["num_sampled"]),
                     "samples": int(sizes[ids].sum() * epochs),
                     "client_steps": int(sum(math.ceil(sizes[i] / 12) for i in ids) * epochs),
                     "train_s": float(r["train_seconds"]), "eval_s": float(r["eval_seconds"])})
    g = res.records[res.records["view"] == "global_test"]
    return {"rows": rows, "wall_s": wall, "memory": peak_memory(dev), "gpu_util_pct": gpu.mean,
            "final_global_acc": float(g["accuracy"].iloc[-1]) if len(g) else None}


def _eval_by_memory(data, repeats: int) -> dict:
    """Every client's model (K copies of a cnn4, perturbed) on its local test split, stacked:
    ``eval.batch_size`` 4096 samples per forward against ``eval.memory_fraction`` 0.5 (the
    executor's ``evaluate_models``; median seconds of ``repeats`` calls after one warm-up, the
    chosen (models, samples per model) and budget, peak memory; the counts must agree)."""
    import torch
    from torch.utils._pytree import tree_map

    from medpfl.algorithms import resolve_method
    from medpfl.config import TrainConfig
    from medpfl.fl.functional import make_forward
    from medpfl.fl.stacked import StackedExecutor
    from medpfl.models import build_model

    dev = data.device
    cls, cfg = resolve_method("fedavg", {})
    algo = cls(cfg, make_forward(build_model("cnn4", 3, 8, 28).to("meta")), 8)
    torch.manual_seed(0)
    one = {k: v.detach().to(dev) for k, v in build_model("cnn4", 3, 8, 28).named_parameters()}
    k = data.num_clients
    models = tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape) + 0.01 * torch.randn(k, *t.shape, device=dev), one)
    out = {"clients": k, "test_samples": int(sum(len(g) for g in data.client_test)), "rows": []}
    counts = {}
    for label, frac in (("batch_size 4096", None), ("memory_fraction 0.5", 0.5)):
        ex = StackedExecutor(data, TrainConfig(), seed=1, eval_batch_size=4096, eval_memory_fraction=frac)
        got = ex.evaluate_models(algo, models, data.client_test)  # warm-up (and the probe)
        counts[label] = got[0].sum().item()
        times = []
        reset_memory(dev)
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            ex.evaluate_models(algo, models, data.client_test)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        last = ex.eval_sizer.last
        out["rows"].append({"mode": label, "eval_s": spread(times), "peak_memory": peak_memory(dev),
                            "models_per_forward": last[0] if last else None,
                            "samples_per_model_per_forward": last[1] if last else None,
                            "budget_bytes": last[2] if last else None})
    out["counts_equal"] = len(set(counts.values())) == 1
    fixed, mem = (r["eval_s"].get("median") for r in out["rows"])
    out["ratio_fixed_over_memory"] = fixed / mem if fixed and mem else None
    return out


def _summarise(ex: str, runs: list[dict], warm: dict) -> dict:
    rows = [r for run in runs for r in run["rows"]]
    train = [r["train_s"] for r in rows]
    mem = {}
    for run in runs:
        for k, v in run["memory"].items():
            mem[k] = max(mem.get(k, 0.0), v)
    utils = [run["gpu_util_pct"] for run in runs if run["gpu_util_pct"] is not None]
    return {"executor": ex, "m": rows[0]["m"] if rows else None, "rounds_measured": len(rows), "blocks": len(runs),
            "train_s_per_round": spread(train), "eval_s_per_round": spread([r["eval_s"] for r in rows]),
            "samples_per_s": sum(r["samples"] for r in rows) / sum(train) if train else None,
            "ms_per_client_step": spread([1e3 * r["train_s"] / r["client_steps"] for r in rows if r["client_steps"]]),
            "client_steps_per_round": spread([r["client_steps"] for r in rows]),
            "peak_memory": mem, "gpu_util_pct": statistics.fmean(utils) if utils else None,
            "warmup": {"wall_s": warm["wall_s"], "train_s": warm["rows"][0]["train_s"] if warm["rows"] else None,
                       "eval_s": warm["rows"][0]["eval_s"] if warm["rows"] else None},
            "per_round_train_s": train, "final_global_acc": runs[-1]["final_global_acc"] if runs else None}


def part2_executors(ctx, checkpoint) -> dict:
    import torch

    from medpfl.config import TrainConfig, partition_config
    from medpfl.data.partition import build_partition
    from medpfl.fl.data import FederatedData

    dev = torch.device(ctx.device)
    dry = ctx.dry_run
    rounds = ctx.rounds or 3  # rounds per measured block
    blocks = 1 if dry else 2  # alternating blocks per executor: >= 5 measured rounds at the default 3 (dry run: 1)
    epochs = 1 if dry else 5
    participations = [0.1] if dry else [0.1, 1.0]
    sweep_k = 50 if dry else 500
    sweep_ms = [2, 5] if dry else [2, 5, 10, 20, 50, 100, 200, 500]
    sweep_rounds = ctx.rounds or 3
    sweep_epochs = 1
    executors = ["sequential", "stacked"]
    protocol = {
        "method": "fedkper", "model": "cnn4", "batch_size": 12, "precision": "fp32",
        "fedkper_round": f"BloodMNIST, K=20 (Dirichlet 0.1, seed 1, fedkper local test: benchmarks/executors.py part 1), "
                         f"{epochs} local epochs, participation {participations}; per executor one untimed 1-round "
                         f"warm-up run, then {blocks} blocks of {rounds} rounds alternating sequential/stacked in "
                         "this process; spread over every measured round; evaluation every round (timed apart)",
        "m_sweep": f"K={sweep_k} (Dirichlet 0.5, min 5 samples, seed 1), m in {sweep_ms} clients per round, "
                   f"{sweep_epochs} local epoch, {sweep_rounds} rounds per (m, executor) after a 1-round warm-up per "
                   "executor; fit of the median train s/round on m; evaluation only after the last round",
        "ms_per_client_step": "train seconds of a round / sum over its clients of epochs x ceil(n_i / 12)",
        "deterministic": "engine defaults of benchmarks/executors.py (torch defaults: no deterministic algorithms)",
    }
    out: dict = {"protocol": protocol, "cuda_init_s": None, "fedkper_round": [], "ratios": {}, "m_sweep": {},
                 "graphs": [], "_status": "ok"}
    t = time.perf_counter()
    torch.zeros(1, device=dev).add_(1)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out["cuda_init_s"] = time.perf_counter() - t

    blood = load_blood(ctx)
    pool = blood.samples[blood.samples["split"] == "train"]
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                            partition_config(num_clients=20, alpha=0.1, seed=1, local_test={"rule": "fedkper"}),
                            "bench")
    data = data20 = FederatedData.build(blood, table, dev)
    for p in participations:
        if ctx.remaining() < 60:
            out["_status"] = "partial"
            ctx.notes.append(f"fedkper round at participation {p}: skipped, the command's budget ran out")
            break
        warm = {ex: _engine_run(data, ex, p, 1, epochs, 1) for ex in executors}
        runs: dict[str, list] = {ex: [] for ex in executors}
        for b in range(blocks):
            for ex in executors:
                runs[ex].append(_engine_run(data, ex, p, rounds, epochs, 1))
        rows = {ex: _summarise(ex, runs[ex], warm[ex]) for ex in executors}
        for ex in executors:
            out["fedkper_round"].append({"participation": p, "clients": 20, "epochs": epochs, **rows[ex]})
        s, q = rows["stacked"], rows["sequential"]
        paired = [a / b for a, b in zip(q["per_round_train_s"], s["per_round_train_s"]) if b > 0]
        out["ratios"][f"participation_{p}"] = {
            "stacked_over_sequential_samples_per_s": s["samples_per_s"] / q["samples_per_s"],
            "paired_round_speedup": spread(paired)}
        checkpoint(out)

    # the m-sweep
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                            partition_config(num_clients=sweep_k, alpha=0.5, seed=1, min_samples=5), "bench500")
    data = FederatedData.build(blood, table, dev)
    sweep = {"k": sweep_k, "epochs": sweep_epochs, "rows": [], "fit": {}}
    for ex in executors:
        sweep.setdefault("warmup_s", {})[ex] = _engine_run(data, ex, (2 + 0.25) / sweep_k, 1, sweep_epochs,
                                                           10**6)["wall_s"]
    for m in sweep_ms:
        for ex in executors:
            if ctx.remaining() < 45:
                out["_status"] = "partial"
                sweep["rows"].append({"m": m, "executor": ex, "status": "skipped: budget"})
                continue
            try:
                r = _engine_run(data, ex, min(1.0, (m + 0.25) / sweep_k), sweep_rounds, sweep_epochs, 10**6)
            except oom_error() as e:
                torch.cuda.empty_cache()
                sweep["rows"].append({"m": m, "executor": ex, "status": f"out of memory: {str(e)[:200]}"})
                continue
            tr = [x["train_s"] for x in r["rows"]]
            sweep["rows"].append({"m": r["rows"][0]["m"], "executor": ex, "status": "ok", "train_s_per_round": spread(tr),
                                  "ms_per_client_step": spread([1e3 * x["train_s"] / x["client_steps"]
                                                                for x in r["rows"]]),
                                  "samples_per_s": sum(x["samples"] for x in r["rows"]) / sum(tr),
                                  "peak_memory": r["memory"], "gpu_util_pct": r["gpu_util_pct"]})
        out["m_sweep"] = sweep
        checkpoint(out)
    for ex in executors:
        ok = [r for r in sweep["rows"] if r["executor"] == ex and r["status"] == "ok"]
        sweep["fit"][ex] = {"train_s_per_round_vs_m": linear_fit([r["m"] for r in ok],
                                                                 [r["train_s_per_round"]["median"] for r in ok]),
                            "unit": "seconds; slope: s per extra client per round, intercept: s per round at m=0"}
    out["m_sweep"] = sweep

    # evaluation of every client's model: a fixed batch against batching by memory (eval.memory_fraction)
    if ctx.remaining() >= 45:
        try:
            out["eval_by_memory"] = _eval_by_memory(data, 1 if dry else 5)
        except oom_error() as e:
            torch.cuda.empty_cache()
            out["eval_by_memory"] = {"status": f"out of memory: {str(e)[:200]}"}
    else:
        out["eval_by_memory"] = {"status": "skipped: budget"}
    checkpoint(out)

    # eager against CUDA graphs
    big = [r for r in out["fedkper_round"] if r["executor"] == "stacked"]
    if big:
        b = big[-1]
        out["graphs"].append({"mode": "eager", "executor": "stacked", "participation": b["participation"],
                              "train_s_per_round_median": b["train_s_per_round"].get("median"),
                              "capture_s": None, "status": "measured (the fedkper_round row)"})
    if GRAPH_FIELD in TrainConfig.model_fields and dev.type == "cuda":
        p = participations[-1]
        try:
            r = _engine_run(data20, "stacked", p, rounds + 1, epochs, 1, extra={GRAPH_FIELD: True})
            tr = [x["train_s"] for x in r["rows"]]
            out["graphs"].append({"mode": "cuda_graphs", "executor": "stacked", "participation": p,
                                  "train_s_per_round_median": statistics.median(tr[1:]) if len(tr) > 1 else tr[0],
                                  "capture_s": tr[0] - statistics.median(tr[1:]) if len(tr) > 1 else None,
                                  "status": "measured (capture_s: first round minus the median of the rest)"})
        except Exception as e:  # noqa: BLE001
            out["graphs"].append({"mode": "cuda_graphs", "status": f"failed: {e!r}"[:300], "capture_s": None})
    else:
        have = GRAPH_FIELD in TrainConfig.model_fields
        out["graphs"].append({"mode": "cuda_graphs", "status": "not run" if have else "not implemented",
                              "capture_s": None,
                              "reason": "CUDA graphs need a CUDA device" if have else
                                        f"medpfl's executors have no CUDA-graph path (TrainConfig has no "
                                        f"{GRAPH_FIELD!r} field; the stacked executor launches eagerly)"})
    return out


# ----------------------------------------------------------------------------- part 3: PFLlib beside medpfl
PFLLIB_ARGS = ["-data", "BloodDir01", "-ncl", "8", "-m", "CNN", "-algo", "FedAvg", "-eg", "1", "-nc", "20",
               "-jr", "0.1", "-ls", "5", "-lbs", "12", "-lr", "0.01", "-go", "bench"]  # the harness's run_all.sh


def part3_pfllib(ctx, checkpoint) -> dict:
    import importlib.util

    carry = ctx.carry / "pfllib"
    system, harness = carry / "PFLlib" / "system" / "main.py", carry / "harness" / "run_pfllib.py"
    out: dict = {"present": system.is_file() and harness.is_file(), "reason": None, "sequence": [], "runs": [],
                 "ratios": {}}
    if not out["present"]:
        man = json.loads((ctx.carry / "manifest.json").read_text()).get("pfllib", {})
        out["reason"] = (f"PFLlib was not carried ({man.get('reason') or 'no ' + str(system)}): fetch "
                         "github:TsingZ0/PFLlib with the search tool's fetch verb, re-run prepare, carry .gpu")
        out["_status"] = "absent"
        return out
    missing = [m for m in ("h5py", "sklearn") if importlib.util.find_spec(m) is None]
    if missing:
        out["reason"] = f"PFLlib needs {missing}, not importable here (the GPU image has them)"
        out["_status"] = "absent"
        return out
    rounds = ctx.rounds or 20
    epochs = 1 if ctx.dry_run else 5
    work = ctx.work / "peer"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(carry / "PFLlib", work / "PFLlib")
    h = carry / "harness"
    # import-only stand-ins for what PFLlib imports but FedAvg never uses, where the module is missing
    stubs = work / "stubs"
    stubs.mkdir(parents=True)
    used = []
    for stub in sorted((h / "stubs").iterdir()):
        if stub.is_dir() and importlib.util.find_spec(stub.name) is None:
            shutil.copytree(stub, stubs / stub.name)
            used.append(stub.name)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "PEER_DIR": str(work)}
    py = sys.executable
    # the clients: medpfl's default-study partition dir0.1, written in PFLlib's layout
    r = run_subprocess([py, h / "make_pfllib_data.py", "--partition", ctx.data["partitions"]["dir0.1"],
                        "--samples", ctx.data["samples"], "--raw", ctx.carry / "data" / "bloodmnist.npz",
                        "--out", work / "PFLlib" / "dataset" / "BloodDir01"],
                       ctx, ctx.work / "part3-data.log", min(300, ctx.remaining()), env=env)
    if r["rc"] != 0:
        raise RuntimeError(f"make_pfllib_data.py failed: {r['log_tail'][-5:]}")
    # medpfl's side through the harness's run_medpfl.py, which calls <project>/.venv/bin/medpfl: a
    # project folder of links to this checkout, the work data and a two-line `medpfl` script
    proj = work / "project"
    (proj / ".venv" / "bin").mkdir(parents=True)
    for name in ("src", "params.yaml", "config"):
        (proj / name).symlink_to(ROOT / name)
    (proj / "data").symlink_to(ctx.work / "data")
    shim = proj / ".venv" / "bin" / "medpfl"
    shim.write_text(f"#!/bin/sh\nexec {py} -m medpfl.cli \"$@\"\n")
    shim.chmod(0o755)
    dev = "cuda" if ctx.device.startswith("cuda") else "cpu"
    seq = ["P_matched", "M_sequential", "P_stock", "M_stacked"] if not ctx.dry_run else ["P_matched", "M_sequential"]
    if dev == "cpu" and not ctx.dry_run:
        seq = ["P_matched", "M_sequential"]
    out["sequence"] = seq
    out["setting"] = {"rounds": rounds, "clients": 20, "participation": 0.1, "local_epochs": epochs, "batch_size": 12,
                      "lr": 0.01, "optimizer": "plain SGD on both sides (the harness's medpfl_plain_sgd overlay)",
                      "device": dev, "stubs": used, "pfllib_commit": json.loads(
                          (ctx.carry / "manifest.json").read_text())["pfllib"].get("commit")}
    rundir = work / "runs"
    rundir.mkdir()
    for i, item in enumerate(seq):
        if ctx.remaining() < 40:
            out["_status"] = "partial"
            ctx.notes.append(f"{item}: skipped, the command's budget ran out")
            continue
        tag = f"{item}_{i + 1}"
        if item.startswith("P_"):
            cmd = [py, h / "run_pfllib.py", "--out", rundir / f"{tag}.json", "--arch", item[2:].lower(),
                   "--schedule", "medpfl", "--pfllib", work / "PFLlib", "--", *PFLLIB_ARGS, "-gr", str(rounds),
                   "-dev", dev, *(["-ls", str(epochs)] if epochs != 5 else [])]
            penv = {**env, "PYTHONPATH": os.pathsep.join([str(stubs), env.get("PYTHONPATH", "")])}
        else:
            ov = work / f"{tag}.yaml"
            ov.write_text(json.dumps({"train": {"device": dev, "executor": item[2:].lower(), "rounds": rounds,
                                                "local_epochs": epochs}}))
            cmd = [py, h / "run_medpfl.py", "--overlay", h / "overlays" / "medpfl_plain_sgd.yaml", "--overlay", ov,
                   "--out-dir", rundir / tag, "--project", proj, "--threads", "2"]
            penv = env
        log(f"part 3: {tag}")
        r = run_subprocess(cmd, ctx, rundir / f"{tag}.log", ctx.remaining() - 20, env=penv, cwd=ROOT)
        row = {"item": item, "tag": tag, "rc": r["rc"], "process_wall_s": r["wall_s"]}
        f = rundir / f"{tag}.json"
        if r["rc"] == 0 and f.is_file():
            s = json.loads(f.read_text())
            if s["library"] == "PFLlib":
                row.update(library="PFLlib", params=s["params"], train_s_per_round=s["mean_train_phase_seconds_0_to_R-1"],
                           eval_s_per_round=s["mean_eval_seconds_1_to_R"],
                           round_s=s["mean_round_seconds_train0..R-1_plus_eval1..R"],
                           pfllib_own_time_cost=s["pfllib_avg_time_cost_per_round"],
                           samples_per_s=s["train_samples_per_second_0_to_R-1"],
                           per_round_train_s=[x["train_phase_seconds"] for x in s["rounds"][:s["global_rounds"]]],
                           final_acc_union_client_splits=s["final_test_acc_union_client_splits"],
                           final_acc_official=(s.get("final_official_test") or {}).get("accuracy"))
            else:
                row.update(library="medpfl", train_s_per_round=s["mean_train_seconds"],
                           eval_s_per_round=s["mean_eval_seconds"], round_s=s["mean_round_seconds"],
                           samples_per_s=s["train_samples_per_second"],
                           per_round_train_s=[x["train_seconds"] for x in s["rounds"]],
                           final_acc_union_client_splits=s["final_test_acc_union_client_splits"],
                           final_acc_official=s["final_global_test_acc_official"])
        else:
            row["log_tail"] = r["log_tail"][-15:]
        out["runs"].append(row)
        checkpoint(out)
    ok = {r["item"]: r for r in out["runs"] if "round_s" in r}
    for m in ("M_sequential", "M_stacked"):
        for p in ("P_matched", "P_stock"):
            if m in ok and p in ok:
                out["ratios"][f"{m}/{p}"] = {k: ok[m][k] / ok[p][k] for k in ("train_s_per_round", "eval_s_per_round",
                                                                             "round_s") if ok[p][k]}
    if len(ok) < len(seq):
        out["_status"] = "partial" if out.get("_status") != "absent" else out["_status"]
    r = run_subprocess([py, h / "summarize.py", rundir], ctx, ctx.work / "part3-summary.log", 60, env=env)
    out["harness_summary"] = r["log_tail"]
    return out


# ----------------------------------------------------------------------------- part 4: FedKPer Table 1
def table1_jobs(ctx) -> tuple[list[dict], dict]:
    from medpfl.compose import load_params
    from medpfl.config import train_job

    overlays = [ROOT / "config" / "fedkper-table1.yaml", ROOT / "config" / "fedkper-table1-cpu.yaml"]
    params = load_params(ROOT / "params.yaml", overlays)
    methods, seeds = list(params.methods), list(params.seeds)
    if ctx.dry_run:  # with --stack-seeds two seeds, so that the dry run stacks
        methods, seeds = ["fedavg", "fedkper"], seeds[:2 if getattr(ctx, "stack_seeds", False) else 1]
    jobs = []
    for seed in seeds:
        for method in methods:
            job = train_job(params, "bloodmnist", "fedkper-dir0.1", method, seed)
            job["study"] = "fedkper-table1-gpu"
            job["train"]["device"] = ctx.device
            if ctx.rounds:
                job["train"]["rounds"] = ctx.rounds
            jobs.append(job)
    i, n = ctx.shard
    if getattr(ctx, "stack_seeds", False):  # a unit is one method's seeds (one process); shard by unit
        units = [[j for j in jobs if j["method"] == m] for m in methods]
        mine = [job for unit in units[i - 1::n] for job in unit]
    else:
        mine = jobs[i - 1::n]
    meta = {"study": "config/fedkper-table1.yaml + config/fedkper-table1-cpu.yaml (BloodMNIST, 13 rows, seeds 1-3), "
                     "study name fedkper-table1-gpu, train.device " + ctx.device,
            "methods": methods, "seeds": seeds, "jobs_total": len(jobs),
            "rounds": jobs[0]["train"]["rounds"] if jobs else None}
    return mine, meta


def part4_table1(ctx, checkpoint) -> dict:
    jobs, meta = table1_jobs(ctx)
    stacked = bool(getattr(ctx, "stack_seeds", False))
    # a unit is one process: one job, or with --stack-seeds one method's seeds (medpfl train, one --job each)
    units = ([[j for j in jobs if j["method"] == m] for m in dict.fromkeys(j["method"] for j in jobs)] if stacked
             else [[j] for j in jobs])
    cores = os.cpu_count() or 1
    parallel = ctx.jobs or min(13, cores)
    threads = max(1, cores // parallel)
    runs_root = ctx.work / "table1" / "runs"
    if runs_root.exists():
        shutil.rmtree(runs_root)
    out: dict = {"study": meta, "shard": f"{ctx.shard[0]}/{ctx.shard[1]} (every {ctx.shard[1]}-th job from the "
                                          f"{ctx.shard[0]}-th, jobs ordered by seed then method)",
                 "jobs_total": meta["jobs_total"], "parallel": parallel, "threads_per_job": threads,
                 "path": "medpfl train (no --parent: no MLflow) then evaluate, through medpfl.cli; no Snakemake"
                         + ("; each method's seeds one process and one computation (train.stack_seeds)" if stacked
                            else ""), "stack_seeds": stacked, "processes": len(units),
                 "wall_s": None, "sum_job_wall_s": None, "runs": [], "_status": "ok"}
    py = sys.executable
    pending = list(units)
    active: dict = {}
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < parallel:
            unit = pending.pop(0)
            cmd = [py, "-m", "medpfl.cli", "train"]
            dirs = []
            for job in unit:
                rd = runs_root / job["dataset"] / job["partition"] / job["method"] / f"seed{job['seed']}"
                rd.mkdir(parents=True, exist_ok=True)
                (rd / "job.in.json").write_text(json.dumps(job))
                cmd += ["--job", f"@{rd / 'job.in.json'}", "--out-dir", rd]
                dirs.append(rd)
            cmd += ["--arrays", ctx.data["arrays"], "--samples", ctx.data["samples"], "--partition-table",
                    ctx.data["partitions"]["fedkper-dir0.1"], "--threads", str(threads)]
            f = open(dirs[0].parent / "train-seeds.log" if stacked else dirs[0] / "train.log", "w")
            proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True)
            active[proc.pid] = (proc, unit, dirs, time.perf_counter(), f)
        time.sleep(0.5)
        for pid, (proc, unit, dirs, start, f) in list(active.items()):
            rc = proc.poll()
            if rc is None and ctx.remaining() < 25:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
                rc = "killed: budget"
            if rc is None:
                continue
            f.close()
            del active[pid]
            for job, rd in zip(unit, dirs):
                _table1_row(out, job, rd, rc, time.perf_counter() - start, len(unit), Path(f.name), checkpoint)
        if pending and ctx.remaining() < 60:
            for unit in pending:
                for job in unit:
                    out["runs"].append({"method": job["method"], "seed": job["seed"], "rc": "not started: budget"})
            out["_status"] = "partial"
            pending = []
    out["wall_s"] = time.perf_counter() - t0
    # a stacked process's wall time is counted once (its seeds' rows each hold it)
    out["sum_job_wall_s"] = sum(r.get("wall_s", 0.0) / r.get("seeds_in_process", 1) for r in out["runs"])
    # the runs come back as one tarball: records, rounds, job, metrics, logs (collect builds the report)
    return _table1_tarball(ctx, out, runs_root)


def _table1_row(out: dict, job: dict, rd: Path, rc, wall_s: float, seeds_in_process: int, log_file: Path,
                checkpoint) -> None:
    """Part 4's row of one finished job (evaluated where it trained), appended to ``out["runs"]``."""
    from medpfl.evaluate import evaluate_run

    row = {"method": job["method"], "seed": job["seed"], "rc": rc, "wall_s": wall_s,
           "seeds_in_process": seeds_in_process}
    if rc != 0 and (rd / "records.parquet").is_file():  # a stacked process failed for another seed
        row["rc_process"], rc = rc, 0
    if rc == 0:
        try:
            import pandas as pd

            s = evaluate_run(rd)
            rounds = pd.read_parquet(rd / "rounds.parquet")
            row.update(rounds=len(rounds), train_s=float(rounds["train_seconds"].sum()),
                       eval_s=float(rounds["eval_seconds"].sum()),
                       s_per_round=float(rounds["round_seconds"].mean()),
                       executor=json.loads((rd / "job.json").read_text()).get("executor"),
                       **{k: s.get(k) for k in ("avg_global_acc", "avg_local_acc", "final_global_acc",
                                                "avg_worst_client_acc", "balance")})
        except Exception as e:  # noqa: BLE001
            row["evaluate_error"] = repr(e)[:300]
    else:
        row["log_tail"] = log_file.read_text(errors="replace").splitlines()[-12:]
        out["_status"] = "partial"
    out["runs"].append(row)
    log(f"part 4: {job['method']} seed {job['seed']} rc={rc} in {row['wall_s']:.0f} s")
    checkpoint(out)


def _table1_tarball(ctx, out: dict, runs_root: Path) -> dict:
    """Part 4's runs as one tarball in ``ctx.out`` (records, rounds, job, metrics, logs): ``out``
    with its name and size."""
    stacked = "-stacked" if getattr(ctx, "stack_seeds", False) else ""
    shard = "" if ctx.shard == (1, 1) else f"-s{ctx.shard[0]}of{ctx.shard[1]}"
    tar_path = ctx.out / f"part4-table1{stacked}{shard}-runs.tar.gz"
    keep = ("records.parquet", "rounds.parquet", "job.json", "metrics.json", "round_metrics.csv", "client_accuracy.csv",
            "train.log", "train-seeds.log")
    with tarfile.open(tar_path, "w:gz") as tar:
        for f in sorted(runs_root.rglob("*")):
            if f.is_file() and f.name in keep:
                tar.add(f, arcname=str(f.relative_to(runs_root)))
    out["runs_tarball"] = {"file": tar_path.name, "bytes": tar_path.stat().st_size}
    if tar_path.stat().st_size > 15 * 2**20:
        ctx.notes.append("runs tarball over 15 MiB: the device tool returns files up to 16 MiB")
    return out


# ----------------------------------------------------------------------------- part 5: large models
VIT_B16 = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
           "patch_size": 16}


def _resized_subset(blood, table, size: int, device):
    """(ProcessedData of only the table's samples, resized to ``size`` px (bilinear), ids 0..n-1;
    the table with those ids)."""
    import pandas as pd
    import torch
    import torch.nn.functional as F

    from medpfl.data.preprocess import ProcessedData

    ids = np.unique(table["sample_id"].to_numpy())
    remap = np.full(len(blood.labels), -1, dtype=np.int64)
    remap[ids] = np.arange(len(ids))
    chunks = []
    for s in range(0, len(ids), 512):
        x = torch.as_tensor(blood.images[ids[s:s + 512]], device=device).float()
        y = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        chunks.append(y.round().clamp(0, 255).to(torch.uint8).cpu().numpy())
    images = np.concatenate(chunks)
    src = blood.samples.set_index("sample_id").loc[ids]
    samples = pd.DataFrame({"sample_id": np.arange(len(ids), dtype=np.int64), "split": src["split"].to_numpy(),
                            "index_in_split": src["index_in_split"].to_numpy(), "label": blood.labels[ids]})
    t = table.copy()
    t["sample_id"] = remap[t["sample_id"].to_numpy()]
    return ProcessedData(images=images, labels=blood.labels[ids], samples=samples, num_classes=blood.num_classes,
                         norm=blood.norm, class_names=blood.class_names), t


def _large_case(ctx, blood, name: str) -> dict:
    """The data, partition and train settings of one large-model case (dry run: tiny)."""
    from medpfl.config import partition_config

    dry = ctx.dry_run
    if name == "vit_lora":
        # dry run (both cases): 1 % of the data over 5 clients at 32 px (over 20 clients one may hold
        # one sample per class, which the floor split leaves without a train or test sample)
        part = partition_config(scheme="dirichlet_pairs", num_clients=5 if dry else 20, alpha=0.1, pool="all",
                                data_fraction=0.01 if dry else 0.2, seed=2025,
                                local_test={"rule": "ratios", "ratios": [0.4, 0.3, 0.3]})
        train = {"participation": 0.1 if dry else 1.0, "local_epochs": 1, "batch_size": 32,
                 "optimizer": {"lr": 0.001, "momentum": 0.0, "weight_decay": 0.0, "schedule": "cosine", "min_lr": 1e-6},
                 "model": "vit_lora", "transform": {"channels": 3, "normalize": "imagenet"}}
        return {"size": 32 if dry else 224, "partition": part, "train": train, "eval_batch": 256,
                "setting": "FHBench (config/fhbench-medmnist.yaml) on BloodMNIST upsampled 28->224: pairs Dir(0.1), "
                           "20 % of the pooled splits, 4:3:3, 20 clients all every round, 1 epoch, batch 32, FedAvg"}
    part = partition_config(scheme="dirichlet", num_clients=5 if dry else 20, alpha=0.1, self_balancing=False,
                            min_samples=1 if dry else 10, pool="all", data_fraction=0.01 if dry else 1.0, seed=1,
                            local_test={"rule": "ratios", "ratios": [0.7, 0.2, 0.1]})
    train = {"participation": 0.1, "local_epochs": 1 if dry else 5, "batch_size": 64,
             "optimizer": {"lr": 0.001, "momentum": 0.0, "weight_decay": 0.0, "lr_decay": 1.0},
             "sampling": {"scheme": "stream"}, "model": "resnet101"}
    return {"size": 32 if dry else 64, "partition": part, "train": train, "eval_batch": 512,
            "setting": "FedMIC (config/fedmic-main.yaml, lam0.1-n20) on BloodMNIST upsampled 28->64 (a stand-in for "
                       "bloodmnist_64, not in the mirror): Dir(0.1) over the pooled splits, 7:2:1, 10 % of 20 "
                       "clients, 5 epochs, batch 64, FedAvg, random init as the paper"}


def part5_large(ctx, checkpoint) -> dict:
    import torch

    from medpfl.algorithms import resolve_method
    from medpfl.config import EvalConfig, TrainConfig
    from medpfl.data.partition import build_partition, partition_pool
    from medpfl.fl.data import FederatedData
    from medpfl.fl.engine import Engine
    from medpfl.fl.functional import make_forward, template_on
    from medpfl.models import build_model
    from medpfl.models.vit import MissingWeightsError
    from medpfl.models.zoo import parameter_counts

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network there: look in the cache only, never wait on one
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    dev = torch.device(ctx.device)
    rounds = ctx.rounds or 3
    blood = load_blood(ctx)
    out: dict = {"rounds": rounds, "runs": [], "_status": "ok"}
    for name in ("vit_lora", "resnet101"):
        case = _large_case(ctx, blood, name)
        cfg = case["partition"]
        pool = partition_pool(blood.samples, cfg)
        table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, name)
        sub, table = _resized_subset(blood, table, case["size"], dev)
        data = FederatedData.build(sub, table, dev, pool="all")
        model_args: dict = {}
        weights = "random init (the FedMIC setting)"
        if name == "vit_lora":
            try:
                build_model("vit_lora", 3, 8, 224, {})
                weights = "pretrained google/vit-base-patch16-224 from the Hugging Face cache"
            except MissingWeightsError:
                model_args = {"checkpoint": None, "config": VIT_B16}
                weights = "random init with ViT-B/16's shape (no cached checkpoint)"
        for ex in ("sequential", "stacked"):
            if ctx.remaining() < 60:
                out["runs"].append({"model": name, "executor": ex, "status": "skipped: budget"})
                out["_status"] = "partial"
                continue
            train = TrainConfig(rounds=rounds, executor=ex, checkpoint_every=0, model_args=model_args,
                                **case["train"])
            row = {"model": name, "executor": ex, "image_size": case["size"], "weights": weights,
                   "setting": case["setting"], "clients": data.num_clients,
                   "train_samples": int(sum(len(t) for t in data.client_train)), "status": "ok"}
            reset_memory(dev)
            t = time.perf_counter()
            try:
                template = build_model(train.model, data.in_channels, data.num_classes, data.image_size,
                                       train.model_args)
                row["params"] = parameter_counts(template)
                cls, mcfg = resolve_method("fedavg", {})
                algo = cls(mcfg, make_forward(template_on(template, dev)), data.num_classes)
                res = Engine(algo, data, train, EvalConfig(every=1, batch_size=case["eval_batch"]), seed=1,
                             executor_kind=ex).run()
            except oom_error() as e:
                row.update(status=f"out of memory: {str(e)[:300]}", wall_s=time.perf_counter() - t,
                           peak_memory=peak_memory(dev))
                out["runs"].append(row)
                del e
                torch.cuda.empty_cache()
                checkpoint(out)
                continue
            rr = res.rounds
            sizes = np.array([len(tr) for tr in data.client_train])
            imgs = [int(sizes[[int(c) for c in s.split()]].sum()) * train.local_epochs for s in rr["sampled_clients"]]
            tr = rr["train_seconds"].tolist()
            row.update(wall_s=time.perf_counter() - t, rounds=len(rr), first_round_train_s=tr[0],
                       train_s_per_round=spread(tr[1:] if len(tr) > 1 else tr),
                       eval_s_per_round=spread(rr["eval_seconds"].tolist()),
                       round_s_per_round=spread(rr["round_seconds"].tolist()),
                       train_images_per_s=sum(imgs[1:] or imgs) / sum(tr[1:] or tr),
                       m=int(rr["num_sampled"].iloc[0]), peak_memory=peak_memory(dev))
            out["runs"].append(row)
            checkpoint(out)
            del res, algo, template
        del data, sub
    return out
