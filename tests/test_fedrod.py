"""FedRoD (Chen & Chao, ICLR 2022; PFLlib clientrod): the balanced softmax loss of the generic
model on a hand-computed case, the stop-gradient pattern of the personal head, the prediction
summing both heads, and the personal head staying on the client."""

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedrod import balanced_softmax_ce, label_log_prior
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
HEAD = ("classifier.weight", "classifier.bias")


def test_balanced_softmax_hand_case():
    """Counts (3, 1, 0, 0): log prior (log 3/4, log 1/4, -inf, -inf). Zero logits, y = 0:
    -log 0.75. Logits (log 3, 0, 5, 1), y = 1: the absent classes drop out, p_1 = 0.25 / (3 * 0.75
    + 0.25) = 0.1, loss -log 0.1. Batch mean of the two (w = 1/2 each)."""
    hist = torch.tensor([3.0, 1.0, 0.0, 0.0])
    lp = label_log_prior(hist)
    torch.testing.assert_close(lp[:2], torch.tensor([math.log(0.75), math.log(0.25)]))
    assert torch.isneginf(lp[2:]).all()
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 5.0, 1.0]], requires_grad=True)
    y, w = torch.tensor([0, 1]), torch.tensor([0.5, 0.5])
    loss = balanced_softmax_ce(logits, y, w, lp)
    assert loss.item() == pytest.approx((-math.log(0.75) - math.log(0.1)) / 2, rel=1e-6)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(g).all() and torch.equal(g[:, 2:], torch.zeros(2, 2))  # absent classes get no gradient
    # softmax(g + log pi) - onehot, halved: sample 1 -> (0.9, 0.1 - 1) / 2
    torch.testing.assert_close(g[1, :2], torch.tensor([0.45, -0.45]))
    # counts or proportions: the same loss (a constant shift of the logits)
    assert balanced_softmax_ce(logits, y, w, torch.log(hist)).item() == pytest.approx(loss.item(), rel=1e-6)
    # a uniform prior is plain cross-entropy
    uni = balanced_softmax_ce(logits, y, w, label_log_prior(torch.ones(4)))
    assert uni.item() == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)


def _batch(dtype=torch.float64):
    torch.manual_seed(3)
    return {"x": torch.randn(4, 3, 28, 28, dtype=dtype), "y": torch.tensor([0, 1, 0, 1]),
            "w": torch.full((4,), 0.25, dtype=dtype)}


def test_each_tree_gets_the_gradient_of_its_own_loss():
    """model: grad of BSM(g) only; personal: grad of CE(sg(g) + p(sg(z))) only (PFLlib's detach
    pattern: out_p = pred(rep.detach()); CE(out_g.detach() + out_p))."""
    algo = make_algo("fedrod")
    m = {k: v.double().requires_grad_() for k, v in initial_params(seed=0).items()}
    p = {k: (v.double() + 0.1).requires_grad_() for k, v in initial_params(seed=1).items() if k in HEAD}
    hist = torch.tensor([5.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    trees, ctx = algo.begin({"model": m}, {"personal": p}, {"label_hist": hist}, RND)
    batch = _batch()
    loss = algo.local_loss(trees, ctx, batch)
    gm = torch.autograd.grad(loss, list(m.values()), retain_graph=True)
    gp = torch.autograd.grad(loss, list(p.values()))
    z, g = algo.forward.features_logits(m, batch["x"])
    bsm = F.cross_entropy(g + torch.log(hist / 8), batch["y"])
    for a, b in zip(gm, torch.autograd.grad(bsm, list(m.values()))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    pers = F.cross_entropy(g.detach() + algo.forward.head(p, z.detach()), batch["y"])
    for a, b in zip(gp, torch.autograd.grad(pers, list(p.values()))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    total = bsm + pers
    assert loss.item() == pytest.approx(total.item(), rel=1e-12)


def test_predict_sums_both_heads_and_the_global_model_is_the_generic_one():
    algo = make_algo("fedrod")
    m, other = initial_params(seed=0), initial_params(seed=1)
    p = {k: other[k] for k in HEAD}
    x = _batch(torch.float32)["x"]
    z, g = algo.forward.features_logits(m, x)
    personal = z @ p["classifier.weight"].T + p["classifier.bias"]
    torch.testing.assert_close(algo.predict({"model": m, "personal": p}, x), g + personal)
    zero = {k: torch.zeros_like(v) for k, v in p.items()}
    torch.testing.assert_close(algo.predict({"model": m, "personal": zero}, x), g)
    assert torch.equal(algo.predict(m, x), algo.forward(m, x))


def test_phase_state_and_uploads():
    algo = make_algo("fedrod")
    (ph,) = algo.phases(RND)
    assert ph.name == "train" and dict(ph.trainable) == {"model": None, "personal": None} and ph.optimizer == RunOptimizer()
    p0 = initial_params()
    state = algo.init_client_state(p0, 0, Federation(5))
    assert set(state) == {"personal"} and set(state["personal"]) == set(HEAD)
    assert all(torch.equal(state["personal"][k], p0[k]) for k in HEAD)  # PFLlib: deepcopy of the head
    assert state["personal"]["classifier.weight"].data_ptr() != p0["classifier.weight"].data_ptr()
    spec = algo.upload_spec()
    assert set(spec) == {"model", "num_samples"} and dict(spec["model"].shapes) == algo.forward.shapes
    trees = {"model": p0, "personal": state["personal"]}
    up, new, ev = algo.finish(trees, {}, state, {"num_samples": torch.tensor(7.0)}, RND)
    assert set(up) == {"model", "num_samples"} and up["model"] is p0
    assert new == {"personal": state["personal"]} and ev == trees
    server = {"model": initial_params(seed=2)}
    pm = algo.personalized_model(state, server)
    assert pm["model"] is server["model"] and pm["personal"] is state["personal"]
    assert algo.has_global_model and algo.personalized
    assert set(make_algo("fedrod", generic_loss="ce").begin({"model": p0}, state, {"label_hist": torch.ones(4)},
                                                            RND)[1]) == set()


_RUNS: dict = {}


def _run(fed_data, method, capture=None, **overrides):
    algo = make_algo(method, **overrides)
    if capture is not None:
        real = algo.aggregate

        def spy(server, uploads, clients, rnd):
            capture.append(uploads)
            return real(server, uploads, clients, rnd)

        algo.aggregate = spy
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")
    return eng.run(), eng.initial_params()


def test_personal_heads_stay_on_the_clients(fed_data):
    crossed: list = []
    res, init = _run(fed_data, "fedrod", capture=crossed)
    assert len(crossed) == 2
    for up in crossed:
        assert set(up) == {"model", "num_samples"}
        # the server's model is the size-weighted average of what crossed (FedAvg)
    n = crossed[-1]["num_samples"].to(torch.float64)
    for k, v in res.server["model"].items():
        torch.testing.assert_close(v, torch.einsum("m,m...->...", n / n.sum(), crossed[-1]["model"][k].double()).float(),
                                   atol=1e-6, rtol=0)
    assert set(res.server) == {"model"}
    sampled = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    never = set(range(fed_data.num_clients)) - sampled
    assert never
    for c in range(fed_data.num_clients):
        own = {k: v[c] for k, v in res.client_states["personal"].items()}
        moved = not torch.equal(own["classifier.weight"], init["classifier.weight"])
        assert moved == (c in sampled)
        pm = {k: {kk: vv[c] for kk, vv in v.items()} for k, v in res.personalized.items()}
        assert all(torch.equal(pm["personal"][k], own[k]) for k in HEAD)
        assert all(torch.equal(pm["model"][k], res.server["model"][k]) for k in res.server["model"])
        # no personal head equals the generic head after training
        if c in sampled:
            assert not torch.equal(own["classifier.weight"], res.server["model"]["classifier.weight"])
    views = set(res.records["view"])
    assert {"global_test", "global_on_local", "personalized_on_local", "local_after_training"} <= views


def test_with_plain_ce_the_generic_model_is_fedavgs(fed_data):
    """The personal head sends no gradient into the shared model: with CE for the generic head the
    server's model is FedAvg's (same batches, same steps), and the global views are FedAvg's."""
    avg, _ = _run(fed_data, "fedavg")
    ce, _ = _run(fed_data, "fedrod", generic_loss="ce")
    for k in avg.server["model"]:
        assert torch.equal(ce.server["model"][k], avg.server["model"][k]), k
    glob = lambda r: r.records[r.records["view"].isin(["global_test", "global_on_local"])].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(glob(avg), glob(ce))
    bsm, _ = _run(fed_data, "fedrod")
    assert not torch.equal(bsm.server["model"]["fc.weight"], avg.server["model"]["fc.weight"])
