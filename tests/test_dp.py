"""Differential privacy (``train.dp``: DP-FedAvg, McMahan et al., ICLR 2018, Algorithm 1) and the
upload transforms (``train.upload``; ``medpfl.fl.upload``, ``medpfl.fl.privacy``).

Evidence kept here: the accountant's ε equals opacus' own documented values (its RDP and PRV
accountant tests, the docstring example of its RDP analysis) and a hand computation at q = 1; the
engine's per-round ε equals a direct accountant call; the server's noise has the stated std
z·S/m over many coordinates; every clipped upload has norm <= S and an update below S is sent
unchanged; refusals name the method and the key; a killed and resumed DP run equals an
uninterrupted one; both executors agree; without the keys nothing changes (job description, no
pipeline); the metrics, MLflow scalars and the report carry ε where a run has it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.algorithms import REGISTRY
from medpfl.compose import validate_params
from medpfl.config import EvalConfig, ParamsError, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.payload import LowRank, payload_dense_nbytes, payload_nbytes
from medpfl.fl.privacy import DPFedAvg, dp_epsilon, make_upload_pipeline, not_applicable_reason
from medpfl.fl.upload import UploadContext, chain, clip_by_norm, gaussian_noise, low_rank, update_norms
from medpfl.metrics import privacy_summary, summarize_run
from tests.conftest import assert_trees_close, make_algo

MLP = {"hidden": 8}  # 3*28*28*8 + 8 + 8*4 + 4 = 18,860 parameters: fast, and every entry counts
DP = {"clip_norm": 0.5, "noise_multiplier": 1.0, "delta": 1e-3}


def _train(**kw) -> TrainConfig:
    base = {"rounds": 2, "participation": 0.6, "local_epochs": 1, "batch_size": 16, "checkpoint_every": 1,
            "model": "mlp", "model_args": MLP, "device": "cpu"}
    return TrainConfig(**{**base, **kw})


def _engine(fed_data, method="fedavg", executor="sequential", checkpoint=None, callbacks=(), model="mlp",
            model_args=None, **train_kw) -> Engine:
    args = MLP if model == "mlp" and model_args is None else (model_args or {})
    algo = make_algo(method, model=model, model_args=args)
    return Engine(algo, fed_data, _train(model=model, model_args=args, **train_kw), EvalConfig(), seed=1,
                  executor_kind=executor, checkpoint=checkpoint, callbacks=list(callbacks), fingerprint="dp")


def _spy(eng: Engine) -> list[dict]:
    """Record every round's payload as sent, the reference (the received model) and what the
    method's aggregate reads."""
    seen: list[dict] = []
    pipe = eng.uploader
    send, receive = pipe.send, pipe.receive

    def spy_send(uploads, shared, clients, seed, r):
        out = send(uploads, shared, clients, seed, r)
        seen.append({"raw": uploads, "ref": shared[pipe.decl.reference], "sent": out})
        return out

    def spy_receive(sent, shared, seed, r, m):
        out = receive(sent, shared, seed, r, m)
        seen[-1]["received"] = out
        return out

    pipe.send, pipe.receive = spy_send, spy_receive
    return seen


# ----- the accountant --------------------------------------------------------------------------
def test_rdp_epsilon_equals_opacus_documented_value():
    """opacus ``tests/accountants_test.py::test_rdp_accountant``: q = 0.04, z = 1.5, int(90 / 0.04) =
    2250 steps, δ = 1e-5 -> ε = 7.32911117143 (assertAlmostEqual, 7 places)."""
    assert dp_epsilon(1.5, 0.04, int(90 / 0.04), 1e-5, "rdp") == pytest.approx(7.32911117143, abs=1e-7)


def test_prv_epsilon_equals_opacus_documented_value():
    """opacus ``tests/accountants_test.py::test_prv_accountant``: the same setting with the PRV
    accountant -> ε = 6.777395712150674 (7 places)."""
    assert dp_epsilon(1.5, 0.04, int(90 // 0.04), 1e-5, "prv") == pytest.approx(6.777395712150674, abs=1e-7)


def test_opacus_rdp_analysis_reproduces_its_docstring_example():
    """The example in the docstring of ``opacus.accountants.analysis.rdp`` (the pinned version's
    documentation): [(q=1e-5, σ=1.0, 10 steps), (1e-4, 3.0, 4)], orders 2..32, δ = 1e-5 -> (0.336, 23)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = range(2, 33)
    rdp = np.zeros(len(orders))
    for q, sigma, steps in [(1e-5, 1.0, 10), (1e-4, 3.0, 4)]:
        rdp += compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    eps, order = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert round(float(eps), 3) == 0.336 and int(order) == 23


def test_full_participation_epsilon_by_hand():
    """q = 1 (every client every round): the Gaussian mechanism with sensitivity 1 and std z has
    RDP α / (2 z²) at order α (Mironov, "Rényi Differential Privacy", CSF 2017), T rounds compose
    additively to α T / (2 z²), converted to (ε, δ) by Balle et al. 2020, Thm 21 (opacus'
    conversion): ε = min_α [α T/(2 z²) + log((α-1)/α) - (log δ + log α)/(α - 1)] over opacus'
    default orders 1.1, 1.2, ..., 10.9, 12, ..., 63."""
    z, t, delta = 2.0, 10, 1e-5
    alphas = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=np.float64)
    eps = alphas * t / (2 * z * z) + np.log((alphas - 1) / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1)
    assert dp_epsilon(z, 1.0, t, delta, "rdp") == pytest.approx(float(eps.min()), rel=1e-12)
    assert dp_epsilon(z, 1.0, 0, delta) == 0.0


def test_dp_fedavg_noise_scale_and_sample_rate():
    """σ = z S / m and q = m / K (McMahan et al. 2018, Alg. 1 with W = K, uniform weights)."""
    from medpfl.config import DPConfig

    dp = DPFedAvg(DPConfig(clip_norm=2.0, noise_multiplier=1.5, delta=1e-6), num_clients=20, per_round=2)
    assert dp.sigma == 1.5 * 2.0 / 2 and dp.sample_rate == 0.1
    with pytest.raises(ParamsError, match=r"train\.dp\.delta: 0\.1 is not below 1/K = 0\.05"):
        DPFedAvg(DPConfig(clip_norm=1.0, noise_multiplier=1.0, delta=0.1), num_clients=20, per_round=2)


# ----- the transforms --------------------------------------------------------------------------
def _tree(norms, seed=0):
    """A stacked update tree with rows of the given L2 norms (flat over two leaves)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(len(norms), 3, 4, generator=g), torch.randn(len(norms), 5, generator=g)
    n = update_norms({"a": a, "b": b}).to(torch.float32)
    s = torch.tensor(norms, dtype=torch.float32) / n
    return {"a": a * s.view(-1, 1, 1), "b": b * s.view(-1, 1), "n": torch.tensor([1, 2, 3, 4])[: len(norms)]}


def test_clip_bounds_every_row_and_keeps_rows_below_the_bound():
    tree = _tree([0.3, 1.0, 2.5, 40.0])
    out = clip_by_norm(1.0).encode(tree, UploadContext(0, 0, (0, 1, 2, 3)))
    norms = update_norms(out)
    assert (norms <= 1.0 * (1 + 1e-6)).all()
    assert norms[2:].tolist() == pytest.approx([1.0, 1.0], rel=1e-6)  # clipped rows land on S
    for k in ("a", "b"):
        assert torch.equal(out[k][0], tree[k][0])  # below S: unchanged, bit for bit
        assert torch.allclose(out[k][3] * 40.0, tree[k][3], rtol=1e-5)  # clipped: same direction
    assert torch.equal(out["n"], tree["n"])  # integer leaves pass through
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_by_norm(0.0)


def test_gaussian_noise_depends_on_seed_round_and_client_only():
    tree = {"w": torch.zeros(3, 2000)}
    t = gaussian_noise(0.1)
    a = t.encode(tree, UploadContext(7, 2, (4, 1, 3)))["w"]
    b = t.encode({"w": torch.zeros(2, 2000)}, UploadContext(7, 2, (3, 4)))["w"]  # other rows, other order
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], t.encode(tree, UploadContext(7, 3, (4, 1, 3)))["w"][0])  # another round
    assert float(a.std()) == pytest.approx(0.1, rel=0.05) and abs(float(a.mean())) < 0.01


def test_low_rank_decodes_what_it_encodes_and_must_come_last():
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(2, 6, 2, generator=g), torch.randn(2, 2, 10, generator=g)
    tree = {"w": (u @ v).reshape(2, 6, 2, 5), "b": torch.randn(2, 6, generator=g)}  # rank 2 per row
    t = low_rank(0.99)
    sent = t.encode(tree, UploadContext(0, 0, (0, 1)))
    assert isinstance(sent["w"], LowRank) and sent["w"].rank.tolist() == [2, 2] and torch.equal(sent["b"], tree["b"])
    back = t.decode(sent, {"w": (6, 2, 5), "b": (6,)})
    torch.testing.assert_close(back["w"], tree["w"], atol=1e-5, rtol=1e-5)
    assert payload_nbytes(sent) < payload_dense_nbytes(sent)
    with pytest.raises(ValueError, match="must be the last transform"):
        chain(low_rank(0.9), clip_by_norm(1.0))


# ----- config and refusals ---------------------------------------------------------------------
def _params(method="fedavg", train=None, method_params=None):
    return {"data": {"datasets": ["bloodmnist"]}, "partitions": [{"name": "p", "num_clients": 10}],
            "methods": [method], "method_params": method_params or {}, "seeds": [1], "train": train or {}}


def test_job_description_unchanged_without_the_keys():
    dump = TrainConfig().model_dump()
    assert "dp" not in dump and "upload" not in dump
    on = TrainConfig(dp=DP, upload=[{"name": "low_rank", "energy": 0.9}]).model_dump()
    assert on["dp"] == {**DP, "accountant": "rdp"} and on["upload"] == [{"name": "low_rank", "energy": 0.9}]


def test_config_refusals_name_the_key():
    with pytest.raises(ParamsError, match=r"  - train\.upload: low_rank must be the last transform"):
        validate_params(_params(train={"upload": [{"name": "low_rank", "energy": 0.9}, {"name": "clip", "max_norm": 1}]}))
    with pytest.raises(ParamsError, match=r"method_params\.a\.train\.dp: cannot be combined with a gaussian upload"):
        validate_params(_params("a", train={"dp": DP}, method_params={
            "a": {"algorithm": "fedavg", "train": {"upload": [{"name": "gaussian", "std": 0.1}]}}}))
    with pytest.raises(ValueError, match="Field required"):
        TrainConfig(dp={"clip_norm": 1.0})  # a privacy setting has no default
    with pytest.raises(ParamsError) as e:
        validate_params(_params("scaffold", train={"dp": DP}))
    msg = str(e.value)
    assert "train.dp: DP-FedAvg cannot run with method 'scaffold'" in msg and "control-variate" in msg
    assert "method_params.scaffold.train.dp: null" in msg and "\n" not in msg.split(": invalid parameters")[-1].strip()
    with pytest.raises(ParamsError, match=r"method_params\.kd\.train\.upload: upload transforms cannot run with "
                                          r"method 'kd' \(fedkd\)"):
        validate_params(_params("kd", method_params={"kd": {"algorithm": "fedkd",
                                                            "train": {"upload": [{"name": "clip", "max_norm": 1}]}}}))
    validate_params(_params("fedavg", train={"dp": DP}))  # accepted


def test_every_method_declares_or_is_refused_with_a_reason():
    for name, cls in REGISTRY.items():
        decl = cls.model_upload
        why = not_applicable_reason(cls)
        assert (decl is None) == (why is not None), name
        if decl is None:
            assert "declares no model upload" not in why, f"{name}: give it a reason in privacy.NOT_APPLICABLE"


@pytest.mark.parametrize("method", sorted(m for m, c in REGISTRY.items() if c.model_upload is not None))
def test_every_declared_method_runs_private(fed_data, method):
    """One DP round of every method that declares a model upload: the declaration matches its
    upload spec and download, the aggregate reads the private mean in every row, ε is recorded."""
    model = "cnn4bn" if "bn" in REGISTRY[method].requires_parts else "mlp"
    eng = _engine(fed_data, method, model=model, rounds=1, checkpoint_every=0, dp=DP)
    seen = _spy(eng)
    res = eng.run()
    rows = seen[0]["received"][REGISTRY[method].model_upload.upload]
    for v in rows.values():
        assert torch.equal(v[0].expand_as(v), v)
    assert res.rounds["epsilon"].tolist() == pytest.approx([dp_epsilon(1.0, 3 / 5, 1, 1e-3)])


def test_engine_refuses_buffers_and_a_large_delta(fed_data):
    with pytest.raises(ParamsError, match=r"train\.dp: method 'fedavg' would send the buffers .*running_mean.*"
                                          r"train\.model=cnn4bn"):
        _engine(fed_data, "fedavg", model="cnn4bn", dp=DP)
    with pytest.raises(ParamsError, match=r"train\.dp\.delta: 0\.5 is not below 1/K = 0\.2"):
        _engine(fed_data, "fedavg", dp={**DP, "delta": 0.5})
    with pytest.raises(ParamsError, match=r"train\.dp: DP-FedAvg cannot run with method 'scaffold'"):
        _engine(fed_data, "scaffold", dp=DP)  # the engine refuses too, for runs built without a params file


# ----- the engine ------------------------------------------------------------------------------
def test_server_noise_has_the_stated_std_and_every_upload_is_clipped(fed_data):
    """The server's noise, recovered as (private model − reference) − mean of the clipped
    updates as sent, is N(0, σ²) with σ = z S / m over the 18,860 coordinates of each round (the
    sample std within 5 standard errors, 5 σ / sqrt(2 n)); every sent update has norm <= S."""
    z, s = 2.0, 0.1
    eng = _engine(fed_data, dp={**DP, "clip_norm": s, "noise_multiplier": z})
    seen = _spy(eng)
    res = eng.run()
    m = 3
    sigma = z * s / m
    for r, rec in enumerate(seen):
        sent = rec["sent"]["model"]
        assert set(rec["sent"]) == {"model"}  # the weights are not sent under DP
        assert (update_norms(sent) <= s * (1 + 1e-6)).all()
        raw = {k: rec["raw"]["model"][k] - rec["ref"][k] for k in sent}
        assert (update_norms(raw) > s).all()  # these updates were clipped (else the test proves little)
        private = rec["received"]["model"]
        noise = torch.cat([(private[k][0].double() - rec["ref"][k].double() - sent[k].double().mean(0)).reshape(-1)
                           for k in sent])
        n = noise.numel()
        assert n == 18860
        assert abs(float(noise.std()) / sigma - 1) < 5 / math.sqrt(2 * n)
        assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(n)
        assert res.rounds["epsilon"].iloc[r] == dp_epsilon(z, m / 5, r + 1, DP["delta"])
    assert res.rounds["bytes_up"].tolist() == [m * 18860 * 4] * 2  # the model update only, dense float32


def test_clip_above_every_norm_sends_the_update_unchanged(fed_data):
    eng = _engine(fed_data, upload=[{"name": "clip", "max_norm": 1e9}])
    seen = _spy(eng)
    eng.run()
    for rec in seen:
        for k, v in rec["sent"]["model"].items():
            assert torch.equal(v, rec["raw"]["model"][k] - rec["ref"][k])
        assert torch.equal(rec["sent"]["num_samples"], rec["raw"]["num_samples"])


def test_low_rank_upload_is_counted_as_sent(fed_data):
    eng = _engine(fed_data, "fedkper", upload=[{"name": "clip", "max_norm": 1.0}, {"name": "low_rank", "energy": 0.5}])
    seen = _spy(eng)
    res = eng.run()
    for r, rec in enumerate(seen):
        assert any(isinstance(v, LowRank) for v in rec["sent"]["model"].values())
        assert res.rounds["bytes_up"].iloc[r] == payload_nbytes(rec["sent"])
        assert res.rounds["bytes_up_dense"].iloc[r] == payload_dense_nbytes(rec["sent"])
    assert (res.rounds["bytes_up"] < res.rounds["bytes_up_dense"]).all()


def test_dp_run_resumes_to_the_same_numbers(fed_data, tmp_path):
    full = _engine(fed_data, dp=DP).run()
    ckpt = tmp_path / "checkpoint.pt"

    class Kill(Exception):
        pass

    def die(r, row, recs):
        if r == 1:
            raise Kill()

    with pytest.raises(Kill):
        _engine(fed_data, dp=DP, checkpoint=ckpt, callbacks=[die]).run()
    resumed = _engine(fed_data, dp=DP, checkpoint=ckpt).run()
    assert resumed.resumed_from == 1
    pd.testing.assert_frame_equal(full.records, resumed.records)
    assert resumed.rounds["epsilon"].tolist() == full.rounds["epsilon"].tolist()
    assert_trees_close(full.server, resumed.server, atol=0)


def test_both_executors_agree_under_dp_and_upload_noise(fed_data):
    for kw in ({"dp": DP}, {"upload": [{"name": "gaussian", "std": 0.01}]}):
        seq = _engine(fed_data, **kw).run()
        stk = _engine(fed_data, executor="stacked", **kw).run()
        pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]), stk.records.drop(columns=["loss"]))
        cols = ["bytes_up", "bytes_up_dense", "bytes_down"] + (["epsilon"] if "dp" in kw else [])
        pd.testing.assert_frame_equal(seq.rounds[cols], stk.rounds[cols])
        assert_trees_close(seq.server, stk.server, atol=2e-5, rtol=1e-4)


def test_no_pipeline_without_the_keys(fed_data):
    eng = _engine(fed_data)
    assert eng.uploader is None
    assert make_upload_pipeline(_train(), eng.algo, 5, 3) is None
    assert "epsilon" not in eng.run().rounds


# ----- metrics, MLflow, report -----------------------------------------------------------------
def _rounds(eps=None):
    df = pd.DataFrame({"round": [0, 1], "lr": [0.1, 0.1], "sampled_clients": ["0 1", "1 2"], "num_sampled": [2, 2],
                       "bytes_up": [8, 8], "bytes_down": [8, 8], "train_seconds": [1.0, 1.0],
                       "eval_seconds": [0.5, 0.5], "round_seconds": [1.5, 1.5]})
    if eps is not None:
        df["epsilon"] = eps
    return df


def _records():
    return pd.DataFrame([{"round": r, "view": "local_after_training", "client_id": c, "n_samples": 10, "correct": 5,
                          "accuracy": 0.5, "balanced_accuracy": 0.5, "loss": 1.0} for r in (0, 1) for c in (0, 1)])


def test_metrics_carry_epsilon_where_recorded():
    per, _ = summarize_run(_records(), _rounds([1.5, 2.25]), 3, False, False)
    assert per["epsilon"].tolist() == [1.5, 2.25]
    per_old, _ = summarize_run(_records(), _rounds(), 3, False, False)  # a round log without the column
    assert "epsilon" not in per_old
    job = {"algorithm": "fedavg", "method_params": {}, "train": {"rounds": 2, "dp": {**DP, "accountant": "rdp"}}}
    (vals, text) = privacy_summary(job, 2.25)
    assert vals == {"epsilon": 2.25, "dp_delta": 1e-3} and "DP-FedAvg" in text and "Poisson" in text
    vals, text = privacy_summary({"algorithm": "fedmic", "method_params": {"dp_noise_std": 0.01}, "train": {}}, None)
    assert vals == {"epsilon": None, "dp_delta": None} and "unbounded" in text
    vals, text = privacy_summary({"algorithm": "fedavg", "method_params": {},
                                  "train": {"upload": [{"name": "gaussian", "std": 0.01}]}}, None)
    assert vals["epsilon"] is None and "unclipped" in text
    assert privacy_summary({"algorithm": "fedmic", "method_params": {"dp_noise_std": 0.0}, "train": {}}, None) is None
    assert privacy_summary({"algorithm": "fedavg", "method_params": {}, "train": {}}, None) is None


def test_round_scalars_log_epsilon_live():
    from medpfl.train import round_scalars

    row = {"lr": 0.1, "bytes_up": 8, "bytes_down": 8, "round_seconds": 1.0, "train_seconds": 1.0}
    assert round_scalars([], {**row, "epsilon": 0.7})["dp_epsilon"] == 0.7
    assert "dp_epsilon" not in round_scalars([], row) and "epsilon" not in round_scalars([], {**row, "epsilon": 0.7})


def test_report_shows_epsilon_only_where_a_run_has_it(tmp_path):
    from medpfl.report.tables import DP_DELTA, DP_NOTE, Run, plain_caption, plain_table

    def run(method, seed, summary):
        base = {"rounds": 2, "mb_per_round": 1.0, "seconds_per_round": 1.0}
        return Run(tmp_path, {"dataset": "d", "partition": "p", "method": method, "seed": seed},
                   {**base, **summary}, pd.DataFrame())

    plain = plain_table({"fedavg": [run("fedavg", 1, {})]})
    assert DP_DELTA not in plain and not any("DP ε" in c for c in plain.columns) and plain_caption(plain)[:5] != "DP ε:"
    t = plain_table({"fedavg": [run("fedavg", 1, {})],
                     "fedavg-dp": [run("fedavg-dp", 1, {"epsilon": 2.0, "dp_delta": 1e-5}),
                                   run("fedavg-dp", 2, {"epsilon": 2.0, "dp_delta": 1e-5})]})
    col = next(c for c in t.columns if c.startswith("DP ε"))
    assert t[col].tolist() == ["—", "2.000 ± 0.000"] and t[DP_DELTA].tolist() == ["—", "1e-05"]
    assert plain_caption(t).startswith(DP_NOTE)


def test_train_and_evaluate_record_epsilon_end_to_end(tmp_path):
    """``medpfl train`` + ``evaluate`` on a DP job: ε per round in rounds.parquet (= a direct
    accountant call at q = m/K), round_metrics.csv and live MLflow (``dp_epsilon``); the summary's ``epsilon`` (last
    round) and ``dp_delta``, the ``privacy`` statement in metrics.json and as an MLflow tag."""
    import json

    from mlflow.tracking import MlflowClient

    from medpfl.evaluate import evaluate_run
    from medpfl.train import run_training
    from tests.conftest import prepare_train_job

    dp = {**DP, "delta": 1e-2}
    job, uri = prepare_train_job(tmp_path, method="fedavg", study="dp", num_clients=4,
                                 train={"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 16,
                                        "model": "mlp", "model_args": MLP, "dp": dp})
    assert job["train"]["dp"] == {**dp, "accountant": "rdp"}
    out = tmp_path / "run"
    run_training(job, tmp_path / "arrays.npz", tmp_path / "samples.parquet", tmp_path / "partition.parquet", out,
                 parent_file=tmp_path / "parent.json")
    rounds = pd.read_parquet(out / "rounds.parquet")
    expect = [dp_epsilon(1.0, 2 / 4, r + 1, 1e-2) for r in range(2)]
    assert rounds["epsilon"].tolist() == expect and expect[0] < expect[1]
    summary = evaluate_run(out)
    assert summary["epsilon"] == expect[-1] and summary["dp_delta"] == 1e-2
    assert pd.read_csv(out / "round_metrics.csv")["epsilon"].tolist() == pytest.approx(expect, rel=1e-12)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["privacy"].startswith("DP-FedAvg") and "Poisson" in metrics["privacy"]
    client = MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    from medpfl.tracking import round_significant

    shown = [round_significant(e) for e in expect]  # MLflow holds 4 significant digits (tracking.LOGGED_DIGITS)
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "dp_epsilon")) == [
        (0, shown[0]), (1, shown[1])]  # live, per round
    assert [m.value for m in client.get_metric_history(run_id, "epsilon")] == [shown[-1]]  # the summary
    assert client.get_run(run_id).data.tags["privacy"] == metrics["privacy"]
