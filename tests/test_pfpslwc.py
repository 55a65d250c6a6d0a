"""PFPS-LWC (Liu et al., Appl. Sci. 2025; spec methods-fedmic-pfpslwc.md part B): the
Lightweight Classifier's unsquared head norm (Eq. 9), the label-free recall phase of
Progressive Local Training (Eq. 3-4) and when it runs, what the client keeps, and the ablation
baseline: with both switches off it is FedPer, through the same code, to the bit."""

import dataclasses
import math

import pandas as pd
import pytest
import torch

from medpfl.algorithms.fedper import FedPer
from medpfl.algorithms.pfpslwc import PFPSLWC, head_l2_norm, recall_distance
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import RoundInfo
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=1, rounds=2, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
HEAD = ("classifier.weight", "classifier.bias")
BODY = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")
TRAIN = dict(rounds=2, participation=0.6, local_epochs=1, batch_size=16)


def _engine(fed_data, method="pfpslwc", executor="sequential", **overrides):
    algo = make_algo(method, **overrides)
    return Engine(algo, fed_data, TrainConfig(**TRAIN), EvalConfig(), seed=1, executor_kind=executor)


_RUNS: dict = {}


def _run(fed_data, method="pfpslwc", executor="sequential", **overrides):
    key = (method, executor, tuple(sorted(overrides.items())))
    if key not in _RUNS:
        _RUNS[key] = _engine(fed_data, method, executor, **overrides).run()
    return _RUNS[key]


def _sampled(res):
    return [[int(c) for c in s.split()] for s in res.rounds["sampled_clients"]]


# ----------------------------------------------------------------------------- LWC (Eq. 7-9)


def test_head_norm_value_and_gradient_hand_case():
    """||phi||_2 over weight and bias together, unsquared: sqrt(1 + 4 + 0 + 4 + 16) = 5; its
    gradient lam * phi / ||phi|| (not weight decay's lam * phi)."""
    w = torch.tensor([[1.0, 2.0], [0.0, 2.0]], requires_grad=True)
    b = torch.tensor([4.0, 0.0], requires_grad=True)
    lam = 0.02
    reg = lam * head_l2_norm({"classifier.weight": w, "classifier.bias": b})
    assert reg.item() == pytest.approx(0.1)
    gw, gb = torch.autograd.grad(reg, [w, b])
    torch.testing.assert_close(gw, torch.tensor([[0.004, 0.008], [0.0, 0.008]]))
    torch.testing.assert_close(gb, torch.tensor([0.016, 0.0]))
    z = torch.zeros(3, requires_grad=True)  # a zero head: subgradient 0, not NaN
    assert torch.equal(torch.autograd.grad(head_l2_norm({"h": z}), z)[0], torch.zeros(3))


def _mlp_batch():
    torch.manual_seed(5)
    return {"x": torch.randn(6, 3, 28, 28), "y": torch.tensor([0, 1, 2, 3, 0, 1]), "w": torch.full((6,), 1 / 6)}


def _mlp_params(seed=0):
    from medpfl.models import build_model

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_model("mlp", 3, 4, 28, {"hidden": 8}).named_parameters()}


def test_local_loss_adds_lam_times_head_norm_to_the_head_only():
    """L_local = CE + lam ||phi||_2 (Eq. 7): the value differs from FedPer's CE by lam times the
    norm of all head parameters; the body's gradient is CE's, the head's gets lam phi/||phi||."""
    kw = dict(model="mlp", model_args={"hidden": 8})
    on, off = make_algo("pfpslwc", **kw), make_algo("pfpslwc", lwc=False, **kw)
    p = {k: v.double().requires_grad_() for k, v in _mlp_params().items()}
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in _mlp_batch().items()}
    lo, lf = on.local_loss({"model": p}, {}, batch), off.local_loss({"model": p}, {}, batch)
    head = [p[k] for k in HEAD]
    norm = torch.sqrt(sum((t.detach() ** 2).sum() for t in head))
    assert (lo - lf).item() == pytest.approx(0.02 * norm.item(), rel=1e-12)
    go = dict(zip(p, torch.autograd.grad(lo, list(p.values()))))
    gf = dict(zip(p, torch.autograd.grad(lf, list(p.values()))))
    for k in ("fc1.weight", "fc1.bias"):
        assert torch.equal(go[k], gf[k])
    for k in HEAD:
        torch.testing.assert_close(go[k] - gf[k], 0.02 * p[k].detach() / norm, atol=1e-15, rtol=1e-10)


# ----------------------------------------------------------------------------- PLT (Eq. 3-4)


def test_recall_distance_hand_case():
    """1 - cos per sample, averaged with the batch weights; padding (w = 0) adds nothing."""
    z_saved = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, -1.0]])
    z = torch.tensor([[0.0, 1.0], [2.0, 2.0], [7.0, 5.0]])
    w = torch.tensor([0.5, 0.5, 0.0])
    # cos = 0 (orthogonal) and 1 (parallel): (1 + 0) / 2
    assert recall_distance(z, z_saved, w).item() == pytest.approx(0.5)
    w3 = torch.full((3,), 1 / 3)
    cos3 = (21 - 5) / (math.sqrt(10) * math.sqrt(74))
    assert recall_distance(z, z_saved, w3).item() == pytest.approx((1 + 0 + 1 - cos3) / 3)


def test_phases_and_the_recall_schedule():
    algo = make_algo("pfpslwc")
    recall, train = algo.phases(RND)
    assert [recall.name, train.name] == ["recall", "train"]
    assert dict(recall.trainable) == {"model": "body"} and dict(train.trainable) == {"model": None}
    # the local training's optimizer and batch size (spec B.2 READING)
    assert recall.optimizer == RunOptimizer() and recall.batch_size is None  # the run's, at the round's lr
    assert int(recall.epochs({"trained": torch.tensor(0.0)})) == 0  # first participation: no theta_l
    assert int(recall.epochs({"trained": torch.tensor(1.0)})) == 1
    assert int(make_algo("pfpslwc", recall_epochs=5).phases(RND)[0].epochs({"trained": torch.tensor(1.0)})) == 5
    assert [p.name for p in make_algo("pfpslwc", plt=False).phases(RND)] == ["train"]


def _clone(tree):
    return {k: v.clone() for k, v in tree.items()}


def _recall_setup(fed_data, client=2, trained=1.0):
    """A client whose saved model differs from the received body: (algo, phase, trees, ctx, sctx, ids)."""
    algo = make_algo("pfpslwc")
    saved, received = initial_params(seed=1), initial_params(seed=0)
    state = {"model": saved, "trained": torch.tensor(trained)}
    trees, ctx = algo.begin({"body": {k: received[k] for k in BODY}}, state, {}, RND)
    ex = SequentialExecutor(fed_data, TrainConfig(batch_size=16), seed=1, eval_batch_size=256)
    ids = fed_data.client_train[client]
    sctx = ex._sample_context(algo, ctx, ids)
    return algo, ex, algo.phases(RND)[0], trees, ctx, sctx, ids


def test_recall_reads_no_labels_and_trains_only_the_body(fed_data):
    algo, ex, recall, trees, ctx, sctx, ids = _recall_setup(fed_data)
    z_saved, _ = algo.forward.features_logits(ctx["saved"], fed_data.x(ids))
    assert torch.equal(sctx["recall_z"], z_saved)  # f(theta_l, x): the saved body's features, frozen
    # the objective on a batch without labels is the objective on one with them
    batch = {"x": fed_data.x(ids[:5]), "w": torch.full((5,), 0.2), "recall_z": sctx["recall_z"][:5]}
    no_y = algo.recall_loss(trees, ctx, batch)
    assert torch.equal(no_y, algo.recall_loss(trees, ctx, {**batch, "y": torch.tensor([3, 2, 1, 0, 3])}))
    # the whole phase on data with scrambled labels: the same trained model, to the bit
    out, steps = ex._run_phase(algo, recall, {"model": _clone(trees["model"])}, ctx, sctx, ids, 2, RND)
    g = torch.Generator().manual_seed(0)
    scrambled = dataclasses.replace(fed_data, labels=torch.randint(0, 4, fed_data.labels.shape, generator=g))
    assert not torch.equal(scrambled.labels[ids], fed_data.labels[ids])
    ex2 = SequentialExecutor(scrambled, TrainConfig(batch_size=16), seed=1, eval_batch_size=256)
    out2, steps2 = ex2._run_phase(algo, recall, {"model": _clone(trees["model"])}, ctx, sctx, ids, 2, RND)
    assert steps == steps2 == -(-len(ids) // 16)  # one epoch at the training batch size
    for k in trees["model"]:
        assert torch.equal(out["model"][k], out2["model"][k])
    for k in HEAD:  # the head is a constant of the phase
        assert torch.equal(out["model"][k], trees["model"][k])
    for k in BODY:
        assert not torch.equal(out["model"][k], trees["model"][k])
    # and it moved the body towards the saved features
    before = recall_distance(algo.forward.features_logits(trees["model"], fed_data.x(ids))[0], z_saved,
                             torch.full((len(ids),), 1 / len(ids)))
    after = recall_distance(algo.forward.features_logits(out["model"], fed_data.x(ids))[0], z_saved,
                            torch.full((len(ids),), 1 / len(ids)))
    assert after < before


def test_recall_is_skipped_before_the_first_participation(fed_data):
    algo, ex, recall, trees, ctx, sctx, ids = _recall_setup(fed_data, trained=0.0)
    out, steps = ex._run_phase(algo, recall, {"model": _clone(trees["model"])}, ctx, sctx, ids, 2, RND)
    assert steps == 0
    assert all(torch.equal(out["model"][k], trees["model"][k]) for k in trees["model"])


class _Spy:
    """Records every client's per-phase models (sequential executor) and what finish stored."""

    def __init__(self, eng):
        self.phases, self.finished = [], []
        ex, algo = eng.executor, eng.algo
        run_phase, finish = ex._run_phase, algo.finish

        def spy_phase(a, ph, trees, ctx, sctx, ids, client, rnd):
            out, n = run_phase(a, ph, trees, ctx, sctx, ids, client, rnd)
            self.phases.append((rnd.round, client, ph.name, n, {k: v.clone() for k, v in out["model"].items()}))
            return out, n

        def spy_finish(trees, ctx, state, info, rnd):
            up, new, ev = finish(trees, ctx, state, info, rnd)
            self.finished.append((rnd.round, int(info["client"]), {k: int(v) for k, v in info["steps"].items()},
                                  float(state["trained"]), up, new))
            return up, new, ev

        ex._run_phase = spy_phase
        algo.finish = spy_finish


def test_recall_runs_exactly_on_returning_clients_and_theta_l_is_stored_after_training(fed_data):
    eng = _engine(fed_data)
    spy = _Spy(eng)
    res = eng.run()
    sampled = _sampled(res)
    assert set(sampled[0]) & set(sampled[1]), "the schedule should bring a client back"
    seen: set = set()
    for r, c, steps, trained, up, new in spy.finished:
        n = len(fed_data.client_train[c])
        assert steps["train"] == -(-n // 16)
        assert steps["recall"] == (-(-n // 16) if c in seen else 0)  # only after a first participation
        assert trained == (1.0 if c in seen else 0.0)
        # theta_l (the body kept) is the body after local training, the one uploaded
        assert all(torch.equal(new["model"][k], up["body"][k]) for k in BODY)
        after_train = [m for (rr, cc, name, _, m) in spy.phases if (rr, cc, name) == (r, c, "train")][0]
        assert all(torch.equal(new["model"][k], after_train[k]) for k in after_train)
        if c in seen:
            after_recall = [m for (rr, cc, name, _, m) in spy.phases if (rr, cc, name) == (r, c, "recall")][0]
            assert not torch.equal(new["model"]["fc.weight"], after_recall["fc.weight"])
        seen.add(c)
    for c in seen:  # the stored model of every client is its last trained one
        last = [new for (r, cc, *_rest, new) in spy.finished if cc == c][-1]
        assert all(torch.equal(res.client_states["model"][k][c], last["model"][k]) for k in last["model"])


# ----------------------------------------------------------------------------- FedPer underneath


def test_the_server_side_and_the_personalized_model_are_fedpers_own_code():
    assert issubclass(PFPSLWC, FedPer)
    for hook in ("upload_spec", "init_server", "download", "init_client_state", "finish", "aggregate",
                 "personalized_model", "has_global_model", "personalized"):
        assert getattr(PFPSLWC, hook) is getattr(FedPer, hook), hook


def test_only_the_body_crosses(fed_data):
    algo = make_algo("pfpslwc")
    res = _run(fed_data)
    body_bytes = 4 * sum(torch.Size(s).numel() for s in algo.forward.part_shapes("body").values())
    assert (res.rounds["bytes_up"] == 3 * (body_bytes + 4)).all()
    assert (res.rounds["bytes_down"] == 3 * body_bytes).all()
    assert set(algo.upload_spec()) == {"body", "num_samples"} and set(algo.upload_spec()["body"].shapes) == set(BODY)


def _assert_runs_equal_to_the_bit(a, b):
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=True)
    for col in ("round", "sampled_clients", "bytes_up", "bytes_down"):
        assert a.rounds[col].tolist() == b.rounds[col].tolist()
    for x, y in [(a.server, b.server), (a.client_states, b.client_states), (a.personalized, b.personalized)]:
        _equal_trees(x, y)


def _equal_trees(x, y):
    if isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            _equal_trees(x[k], y[k])
    else:
        assert torch.equal(x, y)


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_both_switches_off_is_fedper_to_the_bit(fed_data, executor):
    fedper = _run(fed_data, "fedper", executor)
    off = _run(fed_data, "pfpslwc", executor, plt=False, lwc=False)
    _assert_runs_equal_to_the_bit(fedper, off)
    on = _run(fed_data, "pfpslwc", executor)
    assert not torch.equal(on.server["body"]["fc.weight"], fedper.server["body"]["fc.weight"])


@pytest.mark.parametrize("plt,lwc", [(True, False), (False, True)])
def test_each_ablation_runs_and_differs_from_fedper_and_from_the_full_method(fed_data, plt, lwc):
    fedper, full = _run(fed_data, "fedper"), _run(fed_data)
    one = _run(fed_data, plt=plt, lwc=lwc)
    assert one.rounds["bytes_up"].tolist() == fedper.rounds["bytes_up"].tolist()
    for other in (fedper, full):
        assert not torch.equal(one.server["body"]["fc.weight"], other.server["body"]["fc.weight"])
    la = one.records[one.records["view"] == "local_after_training"]
    assert la["accuracy"].between(0, 1).all() and la["loss"].notna().all()
    if not plt:  # LWC only: round 0 (nobody returns yet) differs from FedPer by the head norm alone
        assert not one.records.equals(fedper.records)
    else:  # PLT only: round 0 is FedPer's exactly (no client has a saved body yet)
        r0 = lambda r: r.records[r.records["round"] == 0].reset_index(drop=True)  # noqa: E731
        pd.testing.assert_frame_equal(r0(one), r0(fedper), check_exact=True)
