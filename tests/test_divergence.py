"""The engine's divergence guard: a run whose model or state becomes NaN/inf stops in that round
with a DivergenceError naming the method, the round and the leaf; the last good checkpoint is
kept; ``medpfl train`` reports it in one line with exit status 2 and marks the MLflow run FAILED."""

from __future__ import annotations

import json

import pytest
import torch

from medpfl.cli import main
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import DivergenceError, Engine
from medpfl.fl.tree import first_nonfinite, tree_leaves
from medpfl.fl.payload import LowRank
from tests.conftest import assert_trees_close, make_algo, prepare_train_job


def _engine(fed_data, algo, lr=0.01, rounds=4, executor="sequential", checkpoint=None):
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1,
                        optimizer={"lr": lr})
    return Engine(algo, fed_data, train, EvalConfig(every=1), seed=1, executor_kind=executor, checkpoint=checkpoint,
                  fingerprint="divergence")


def _finite(tree) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(tree) if t.is_floating_point())


def test_first_nonfinite_names_tree_and_key():
    good = {"model": {"a": torch.ones(3), "n": torch.tensor(7)}}
    assert first_nonfinite({"server state": good}) is None
    bad = {"model": {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "c": torch.tensor([float("nan")])}}
    assert first_nonfinite({"server state": good, "upload": bad}) == ("upload", "['model']['b']")
    lr = {"delta": LowRank(torch.ones(2, 1), torch.tensor([float("nan")]), torch.ones(1, 2), torch.tensor(1))}
    assert first_nonfinite({"upload": lr}) == ("upload", "['delta'].s")
    assert first_nonfinite({"empty": {}}) is None


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_huge_lr_raises_divergence_error_naming_round_and_leaf(fed_data, executor):
    with pytest.raises(DivergenceError) as e:
        _engine(fed_data, make_algo("fedavg"), lr=1e4, executor=executor).run()
    msg = str(e.value)
    assert "\n" not in msg
    assert "method 'fedavg' diverged in round 1/4" in msg
    assert "['model']['" in msg and ("upload" in msg or "server state" in msg)
    assert "train.optimizer.lr (now 10000" in msg


def test_normal_lr_does_not_raise(fed_data):
    res = _engine(fed_data, make_algo("fedavg"), lr=0.01).run()
    assert len(res.rounds) == 4 and _finite(res.global_params)


def test_method_without_global_model_diverges_in_its_client_states(fed_data):
    """Local never uploads and never updates the server: its client states are checked."""
    with pytest.raises(DivergenceError, match=r"'local' diverged in round 1/4 .*: client state \['model'\]\['"):
        _engine(fed_data, make_algo("local"), lr=1e4).run()


def test_method_with_clipping_is_pointed_at_it(fed_data):
    with pytest.raises(DivergenceError, match=r"method_params\.<method>\.clip_grad_norm"):
        _engine(fed_data, make_algo("fedkper", clip_grad_norm=None), lr=1e4).run()


def test_last_good_checkpoint_is_kept_and_resumes(fed_data, tmp_path):
    """NaN injected by the server update of round index 2: rounds 0-1 stay in the checkpoint,
    untouched, and a run resumed from it equals an uninterrupted run."""
    ckpt = tmp_path / "checkpoint.pt"
    algo = make_algo("fedavg")
    real = algo.aggregate

    def blow_up(server, uploads, clients, rnd):
        out = real(server, uploads, clients, rnd)
        if rnd.round == 2:
            out = {**out, "model": {**out["model"], "fc.weight": out["model"]["fc.weight"] * float("nan")}}
        return out

    algo.aggregate = blow_up
    with pytest.raises(DivergenceError) as e:
        _engine(fed_data, algo, checkpoint=ckpt).run()
    msg = str(e.value)
    assert "diverged in round 3/4" in msg and "server state ['model']['fc.weight']" in msg
    assert f"checkpoint {ckpt} (after round 2) is kept" in msg
    blob = torch.load(ckpt, weights_only=False)
    assert blob["next_round"] == 2 and len(blob["rounds"]) == 2
    assert _finite(blob["server"]) and _finite(blob["client_states"])
    full = _engine(fed_data, make_algo("fedavg")).run()
    resumed = _engine(fed_data, make_algo("fedavg"), checkpoint=ckpt).run()
    assert resumed.resumed_from == 2
    assert full.records.drop(columns=["loss"]).equals(resumed.records.drop(columns=["loss"]))
    assert_trees_close(full.global_params, resumed.global_params, atol=0)


def test_cli_train_reports_divergence_in_one_line(tmp_path, capsys):
    job, uri = prepare_train_job(tmp_path, method="fedavg", study="diverge",
                                 train={"rounds": 3, "batch_size": 16, "checkpoint_every": 1, "optimizer": {"lr": 1e4}})
    out = tmp_path / "run"
    code = main(["train", "--job", json.dumps(job), "--arrays", str(tmp_path / "arrays.npz"), "--samples",
                 str(tmp_path / "samples.parquet"), "--partition-table", str(tmp_path / "partition.parquet"),
                 "--parent", str(tmp_path / "parent.json"), "--out-dir", str(out), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("medpfl train: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "method 'fedavg' diverged in round 1/3" in lines[0] and "train.optimizer.lr" in lines[0]
    for f in ("records.parquet", "rounds.parquet", "final_model.pt", "checkpoint.pt"):
        assert not (out / f).exists(), f
    from mlflow.tracking import MlflowClient

    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


@pytest.mark.parametrize("method, overrides", [("fedkd", {"max_grad_norm": None}), ("fedmic", {})])
def test_low_rank_upload_of_a_diverged_client_is_a_divergence_error(fed_data, method, overrides):
    """FedKD and FedMIC compress uploads by SVD; a diverged client's update makes ``linalg.svd``
    fail on NaN input before the post-training check could see it. The engine turns that
    LinAlgError into the same one-line DivergenceError."""
    with pytest.raises(DivergenceError) as e:
        _engine(fed_data, make_algo(method, **overrides), lr=1e4).run()
    msg = str(e.value)
    assert f"method {method!r} diverged in round" in msg and "train.optimizer.lr (now 10000" in msg
    assert "a linear-algebra routine met a NaN or inf in local training (linalg.svd" in msg


def test_other_linalg_errors_are_not_called_divergence(fed_data):
    """A LinAlgError not caused by non-finite input propagates as it is (it is a bug, not a
    diverged run)."""
    algo = make_algo("fedavg")

    def singular(server, uploads, clients, rnd):
        torch.linalg.inv(torch.zeros(2, 2))

    algo.aggregate = singular
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        _engine(fed_data, algo).run()
    algo.aggregate = lambda *a: torch.linalg.svd(torch.full((3, 2), float("nan")))
    with pytest.raises(DivergenceError, match=r"round 1/4 .*in the server update \(linalg.svd"):
        _engine(fed_data, algo).run()


def test_an_error_the_nonfinite_values_cause_later_in_the_round_is_the_divergence_error(fed_data, tmp_path):
    """The guard's flags are read after the round (with the records, one host copy); an
    exception that the non-finite uploads cause before then (here: a server hook that refuses
    them) gives way to the DivergenceError an immediate check would have raised, with that
    exception as its cause; the diverged round reaches no callback and no checkpoint."""
    algo = make_algo("fedavg")
    real = algo.aggregate

    def refuses_nan(server, uploads, clients, rnd):
        if not all(bool(torch.isfinite(t).all()) for t in tree_leaves(uploads)):
            raise ValueError("a NaN reached the server hook")
        return real(server, uploads, clients, rnd)

    algo.aggregate = refuses_nan
    seen = []
    eng = _engine(fed_data, algo, lr=1e4, checkpoint=tmp_path / "checkpoint.pt")
    eng.callbacks.append(lambda r, row, records: seen.append(r))
    with pytest.raises(DivergenceError) as e:
        eng.run()
    msg = str(e.value)
    assert "method 'fedavg' diverged in round 1/4" in msg and "is not finite (NaN or inf) after local training" in msg
    assert isinstance(e.value.__cause__, ValueError) and "server hook" in str(e.value.__cause__)
    assert seen == [] and not (tmp_path / "checkpoint.pt").exists()
