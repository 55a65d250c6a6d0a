"""Seeds of one method stacked as one computation (``train.stack_seeds``,
:mod:`medpfl.fl.seed_stack`): each seed's run equals its separate run on the stacked executor
(float64: to rounding; float32: within the contract's tolerance between executors), the seeds'
local training of a round really runs as one program, and what may not be merged is not."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.seed_stack import MergedRoundInfo, RngStream, run_seed_stack
from medpfl.fl.stacked import StackedExecutor
from medpfl.models import ZOO
from tests.conftest import assert_trees_close, make_algo
from tests.test_contract import COST, METHODS, _train, assert_runs_agree, cached, model_for

def engine(fed_data, method, seed, executor="stacked", rounds=None, checkpoint=None, **overrides):
    """The contract's run of ``method`` (tests/test_contract.py: its model, tiny args, costs) with
    ``seed``, unstarted."""
    model = model_for(method)
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, **{**COST.get(method, {}), **overrides})
    train = _train(model=model, model_args=ZOO[model].tiny_args)
    if rounds is not None:
        train = train.model_copy(update={"rounds": rounds})
    return Engine(algo, fed_data, train, EvalConfig(), seed=seed, executor_kind=executor, checkpoint=checkpoint,
                  fingerprint="contract")


def mlp_engine(fed_data, method, seed, rounds=2, checkpoint=None):
    """``method`` on the MLP (fast on a CPU), stacked executor, checkpoint every round."""
    t = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, model="mlp", checkpoint_every=1)
    return Engine(make_algo(method, model="mlp"), fed_data, t, EvalConfig(), seed=seed, executor_kind="stacked",
                  checkpoint=checkpoint, fingerprint="mlp")


def _stackable(method: str) -> bool:
    model = model_for(method)
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, **COST.get(method, {}))
    return algo.stackable and getattr(algo.forward, "not_stackable_because", None) is None


STACKABLE = [m for m in METHODS if _stackable(m)]
#: compared with the contract's separate run of seed 1 (2 rounds, the contract's model): one method
#: per kind of state or download (none; control variates; a server buffer; K server cores and a
#: per-client vector; a low-rank update broadcast to all; a shared teacher context)
COMPARED = ("fedavg", "scaffold", "fedgkd", "apple", "fedmic", "fedkper")


def _small_model(method: str) -> str:
    """``mlp`` where the method runs on it (fast on a CPU), else the contract's model."""
    from medpfl.algorithms.base import check_required_parts

    try:
        check_required_parts(make_algo(method, model="mlp", **COST.get(method, {})))
        return "mlp"
    except ValueError:
        return model_for(method)


def test_most_methods_stack():
    """The registry's stackable methods (those the tests below cover) are most of it."""
    assert len(STACKABLE) >= 20 and set(COMPARED) | {"ditto", "fedbabu"} <= set(STACKABLE)


@pytest.mark.parametrize("method", COMPARED)
def test_stacked_seed_equals_its_separate_run(fed_data, method):
    """Seeds 1 and 2 stacked, every round merged; seed 1 gets the run it gets alone on the
    stacked executor (the contract's run, tests/test_contract.py: counts equal; losses, bytes,
    server and client states within the contract's tolerance between executors), and seed 2
    another one (its own seed's batches and initialisation)."""
    _, alone = cached(fed_data, method, "stacked")
    out = run_seed_stack([engine(fed_data, method, 1), engine(fed_data, method, 2)])
    assert [o.error for o in out] == [None, None]
    assert [o.merged_rounds for o in out] == [len(alone.rounds)] * 2
    assert_runs_agree(alone, out[0].result)
    assert not out[1].result.records["loss"].equals(out[0].result.records["loss"])


@pytest.mark.parametrize("method", [m for m in STACKABLE if m not in COMPARED])
def test_every_stackable_method_merges_its_seeds(fed_data, method):
    """Every other stackable method: one round of seeds 1 and 2 merged into one program (no
    client-side hook reads ``rnd.seed``, the seeds' downloads, states and contexts stack), with
    finite records that differ between the seeds."""
    model = _small_model(method)
    t = TrainConfig(rounds=1, participation=0.6, local_epochs=1, batch_size=16, model=model,
                    model_args=ZOO[model].tiny_args)

    def eng(seed):
        algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, **COST.get(method, {}))
        return Engine(algo, fed_data, t, EvalConfig(), seed=seed, executor_kind="stacked")

    out = run_seed_stack([eng(1), eng(2)])
    assert [o.error for o in out] == [None, None]
    assert [o.merged_rounds for o in out] == [1, 1]
    a, b = (o.result.records for o in out)
    assert a["loss"].notna().all() and b["loss"].notna().all() and not a["loss"].equals(b["loss"])


def test_float64_stacked_seeds_equal_separate_runs_to_rounding(fed_data, monkeypatch):
    """In float64 the stacked seeds and their separate stacked runs agree to rounding, on a
    method with a shared teacher context (FedKPer), one with a persistent personal model (Ditto)
    and one with a frozen head (FedBABU): the same batches per row (its own seed), the same
    downloads, contexts and server steps. A row given another seed's batches, or another seed's
    download, would differ by far more (the seeds' losses differ by > 1e-3)."""
    monkeypatch.setattr(FederatedData, "x", lambda self, idx: self.images[idx].to(torch.float64) / 127.5 - 1.0)
    real_init = Engine.initial_params
    monkeypatch.setattr(Engine, "initial_params", lambda self: {k: v.double() for k, v in real_init(self).items()})
    for method in ("fedkper", "ditto", "fedbabu"):
        def eng(seed):
            t = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, model="mlp")
            return Engine(make_algo(method, model="mlp"), fed_data, t, EvalConfig(), seed=seed,
                          executor_kind="stacked")
        alone = [eng(s).run() for s in (1, 2, 3)]
        out = run_seed_stack([eng(1), eng(2), eng(3)])
        for o, a in zip(out, alone):
            assert o.error is None and o.merged_rounds == 2
            assert next(iter(a.server["model"].values())).dtype == torch.float64
            assert_trees_close(a.server, o.result.server, atol=1e-12, rtol=1e-10)
            assert_trees_close(a.client_states, o.result.client_states, atol=1e-12, rtol=1e-10)
            cols = ["round", "view", "client_id", "accuracy"]
            assert a.records[cols].equals(o.result.records[cols]), method
            torch.testing.assert_close(torch.tensor(a.records["loss"].to_numpy()),
                                       torch.tensor(o.result.records["loss"].to_numpy()), atol=1e-10, rtol=1e-10)
        assert (alone[0].records["loss"] - alone[1].records["loss"]).abs().max() > 1e-3


def test_one_program_per_round_for_all_seeds(fed_data, monkeypatch):
    """Each round's local training of the 3 seeds is one call of the stacked executor with the
    seeds' trainers as rows (m = sum of the seeds' m), each row with its own seed; the separate
    runs' executors are not called for local training."""
    calls = []
    real = StackedExecutor.train_clients

    def spy(self, algo, down, states, clients, rnd, seeds=None, row_context=None):
        calls.append((len(clients), None if seeds is None else list(seeds), isinstance(rnd, MergedRoundInfo)))
        return real(self, algo, down, states, clients, rnd, seeds, row_context)

    monkeypatch.setattr(StackedExecutor, "train_clients", spy)
    out = run_seed_stack([mlp_engine(fed_data, "fedavg", s) for s in (1, 2, 3)])
    m = len(out[0].result.rounds["sampled_clients"].iloc[0].split())
    assert len(calls) == len(out[0].result.rounds)  # one per round, not one per seed and round
    assert all(n == 3 * m and seeds == [1] * m + [2] * m + [3] * m and merged for n, seeds, merged in calls)


def test_client_hooks_cannot_read_one_seed_for_all_rows(fed_data, monkeypatch):
    """A client-side hook that reads ``rnd.seed`` in a merged round raises, naming
    train.stack_seeds (no row gets another seed's value); that seed's error ends every engine of
    the round, each reported in its outcome."""
    from medpfl.algorithms.fedavg import FedAvg

    real = FedAvg.phases

    def reads_seed(self, rnd):
        rnd.seed  # noqa: B018  (the read is the test)
        return real(self, rnd)

    monkeypatch.setattr(FedAvg, "phases", reads_seed)
    out = run_seed_stack([mlp_engine(fed_data, "fedavg", s) for s in (1, 2)])
    assert all(isinstance(o.error, AttributeError) and "train.stack_seeds" in str(o.error) for o in out)
    # the same hook in a separate run reads the run's seed
    assert mlp_engine(fed_data, "fedavg", 1).run().rounds.shape[0] == 2


def test_rng_streams_stay_apart():
    """Two streams draw what each would alone, interleaved."""
    torch.manual_seed(0)
    a, b = RngStream(torch.device("cpu")), RngStream(torch.device("cpu"))
    with a.active():
        torch.manual_seed(1)
        a1 = torch.rand(3)
    with b.active():
        torch.manual_seed(2)
        b1 = torch.rand(3)
    outer = torch.rand(1)
    with a.active():
        a2 = torch.rand(3)
    with b.active():
        b2 = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.cat([a1, a2]), torch.rand(6))
    torch.manual_seed(2)
    assert torch.equal(torch.cat([b1, b2]), torch.rand(6))
    torch.manual_seed(0)
    assert torch.equal(outer, torch.rand(1))  # the caller's stream is untouched


def test_engines_at_different_rounds_catch_up_then_merge(fed_data, tmp_path):
    """Seed 1 resumes from a checkpoint after round 1 of 3, seed 2 starts at round 0: seed 2
    trains round 0 alone, then both merge; each equals its uninterrupted separate run."""
    ck = tmp_path / "s1.pt"
    e = mlp_engine(fed_data, "fedavg", 1, rounds=3, checkpoint=ck)
    gen = e.rounds()
    req = next(gen)
    req = gen.send(req.run(e.clients))  # round 0 done and checkpointed; stop before round 1 trains
    gen.close()
    assert ck.exists()
    alone = [mlp_engine(fed_data, "fedavg", s, rounds=3).run() for s in (1, 2)]
    e1 = mlp_engine(fed_data, "fedavg", 1, rounds=3, checkpoint=ck)
    out = run_seed_stack([e1, mlp_engine(fed_data, "fedavg", 2, rounds=3)])
    assert out[0].result.resumed_from == 1
    assert [o.merged_rounds for o in out] == [2, 2]
    for o, a in zip(out, alone):
        assert_runs_agree(a, o.result)


def test_a_diverging_seed_ends_alone(fed_data, monkeypatch):
    """A seed whose server state turns NaN ends with DivergenceError; the other seed finishes."""
    from medpfl.algorithms.fedavg import FedAvg
    from medpfl.errors import DivergenceError

    real = FedAvg.aggregate

    def poisoned(self, server, uploads, clients, rnd):
        out = real(self, server, uploads, clients, rnd)
        if rnd.seed == 2 and rnd.round == 1:
            out = {**out, "model": {k: v * float("nan") for k, v in out["model"].items()}}
        return out

    monkeypatch.setattr(FedAvg, "aggregate", poisoned)
    out = run_seed_stack([mlp_engine(fed_data, "fedavg", s) for s in (1, 2)])
    assert out[0].error is None and len(out[0].result.rounds) == 2
    assert isinstance(out[1].error, DivergenceError) and "round 2" in str(out[1].error)


@pytest.mark.slow
def test_pipeline_trains_each_methods_seeds_as_one_job(tmp_path):
    """With ``train.stack_seeds: true`` Snakemake runs one train_seeds job per method for its 2
    seeds, which writes both run folders (job.json without the switch, records, rounds), two
    FINISHED MLflow runs and evaluations as rule train would; seed 2's records equal its run by
    ``medpfl train`` alone (counts equal, losses within the executors' tolerance); the workflow
    lints; and a second invocation has nothing to do."""
    import json
    import subprocess

    from helpers import (copy_repo, job_stats, make_env, mlflow_client, snakemake, study_runs, tiny_params, tool,
                         write_params, write_synthetic)

    snakefile = copy_repo(tmp_path / "workflow") / "Snakefile"
    work = tmp_path / "work"
    work.mkdir()
    synth = write_synthetic(work / "synth.npz")
    write_params(work, tiny_params(synth, methods=("fedavg",), seeds=(1, 2), executor="auto", stack_seeds=True))
    env = make_env(work)
    out = snakemake(work, env=env, snakefile=snakefile).stdout
    stats = job_stats(out)
    assert stats.get("train_seeds") == 1 and "train" not in stats and stats["evaluate"] == 2, out[-3000:]
    runs = work / "results" / "ci" / "runs" / "synth" / "d" / "fedavg"
    for s in (1, 2):
        job = json.loads((runs / f"seed{s}" / "job.json").read_text())
        assert job["seed"] == s and "stack_seeds" not in job["train"]
        assert (runs / f"seed{s}" / "metrics.json").is_file()
    log = (runs / "train-seeds.log").read_text()
    assert "2 of 2 rounds trained stacked" in log, log[-2000:]
    _, children = study_runs(mlflow_client(work))
    assert sorted((c.data.tags["seed"], c.info.status) for c in children) == [("1", "FINISHED"), ("2", "FINISHED")]

    # seed 2 alone, by the stage command (the stacked executor, as in the stack)
    job = {k: v for k, v in json.loads((runs / "seed2" / "job.json").read_text()).items()
           if k not in ("environment", "model_size", "earlier_environments")}
    job["train"]["executor"] = "stacked"
    alone = tmp_path / "alone"
    subprocess.run([tool("medpfl"), "train", "--job", json.dumps(job), "--arrays", str(work / "data/processed/synth.npz"),
                    "--samples", str(work / "data/processed/synth.samples.parquet"), "--partition-table",
                    str(work / "data/partitions/synth/d/partition.parquet"), "--out-dir", str(alone)],
                   check=True, env=env, cwd=work, capture_output=True)
    a = pd.read_parquet(alone / "records.parquet")
    b = pd.read_parquet(runs / "seed2" / "records.parquet")
    cols = ["round", "view", "client_id", "n_samples", "accuracy"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    torch.testing.assert_close(torch.tensor(a["loss"].to_numpy()), torch.tensor(b["loss"].to_numpy()),
                               atol=1e-4, rtol=1e-4)

    lint = snakemake(work, "--lint", env=env, check=False, snakefile=snakefile)
    assert lint.returncode == 0, lint.stdout[-3000:]
    assert "Nothing to be done" in snakemake(work, env=env, snakefile=snakefile).stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stacked_seeds_on_cuda_equal_their_separate_runs(synthetic_processed):
    """On CUDA: 3 seeds of FedKPer stacked (CUDA RNG streams kept apart) give each seed its
    separate stacked run (counts equal, losses within the executors' tolerance)."""
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition

    pool = synthetic_processed.samples[synthetic_processed.samples["split"] == "train"]
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                            partition_config(num_clients=5, alpha=0.5, seed=1, min_samples=20), "t")
    data = FederatedData.build(synthetic_processed, table, torch.device("cuda"))

    def eng(seed):
        t = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, model="mlp", device="cuda")
        return Engine(make_algo("fedkper", model="mlp"), data, t, EvalConfig(), seed=seed, executor_kind="stacked")

    alone = [eng(s).run() for s in (1, 2, 3)]
    out = run_seed_stack([eng(1), eng(2), eng(3)])
    cols = ["round", "view", "client_id", "accuracy"]
    for o, a in zip(out, alone):
        assert o.error is None and o.merged_rounds == 2
        pd.testing.assert_frame_equal(a.records[cols], o.result.records[cols])
        torch.testing.assert_close(torch.tensor(a.records["loss"].to_numpy()),
                                   torch.tensor(o.result.records["loss"].to_numpy()), atol=1e-4, rtol=1e-4)
