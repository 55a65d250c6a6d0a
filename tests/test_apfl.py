"""APFL (Deng, Kamani & Mahdavi 2020, Algorithm 1 and the adaptive alpha): alpha's gradient step
on a hand case for each ``alpha_grad`` reading (the closed form d/dalpha of the mixed loss, the
end-point approximation of FedTorch and PFLlib, FHBench's swapped one), its clipping, the mixed
model, the scored parameters of every ``personal_state`` x ``alpha_update`` reading (one mixture,
never a mixture of a mixture), v's gradient not flowing into w, the programs of the three alpha
modes, and the global model being FedAvg's; the non-default readings on both executors."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.optim import RunOptimizer, sgd
from medpfl.fl.program import RoundInfo
from tests.conftest import assert_trees_close, initial_params, make_algo, phase_chains

RND = RoundInfo(round=0, rounds=1, lr=0.1, num_clients=5, seed=1, base_lr=0.1)


def _tiny(**kw):
    """APFL on a linear model of 1 input, 2 classes (``mlr``): classifier.weight [2, 1], classifier.bias [2]."""
    return make_algo("apfl", num_classes=2, model="mlr", in_channels=1, image_size=None, **kw)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def _alpha_step(algo, v, w, alpha, batch, rnd=RND):
    """One step of the ``alpha`` phase as an executor runs it: the phase's loss, its gradient
    w.r.t. alpha, the engine's SGD at the phase's lr, momentum and weight decay, the projection."""
    ph = algo.phases(rnd)[-1]
    assert ph.name == "alpha" and dict(ph.trainable) == {"alpha": None} and ph.steps == 1
    a = alpha.clone().requires_grad_()
    trees = {"model": w, "personal": v, "alpha": {"alpha": a}}
    (g,) = torch.autograd.grad(ph.loss(trees, {}, batch), [a])
    leaf = {"alpha": a.detach().clone()}
    opt = phase_chains(ph, rnd.lr)["alpha"]
    opt.step_(leaf, {"alpha": g.clone()}, opt.init(leaf), count=1)
    return g, ph.project({"alpha": leaf})["alpha"]["alpha"]


def test_defaults_and_programs():
    algo = make_algo("apfl")
    cfg = algo.cfg
    assert (cfg.alpha_init, cfg.alpha_update, cfg.alpha_lr_scale, cfg.alpha_reg, cfg.personal_objective,
            cfg.personal_state, cfg.weighting) == (1.0, "round", 1.0, 0.02, "mixed", "v", "num_samples")
    train, alpha = algo.phases(RND)
    assert train.name == "train" and dict(train.trainable) == {"model": None, "personal": None}
    assert train.optimizer == RunOptimizer()  # w and v: the run's optimizer at the round's lr
    assert alpha.name == "alpha" and alpha.steps == 1 and alpha.optimizer == sgd(RND.lr)  # plain SGD
    (step,) = make_algo("apfl", alpha_update="step", alpha_lr_scale=0.5).phases(RND)
    assert dict(step.trainable) == {"model": None, "personal": None, "alpha": None}
    chains = phase_chains(step, 0.1)
    assert chains["alpha"] == sgd(0.05, 0.9, 1e-5) and chains["model"] == chains["personal"] == sgd(0.1, 0.9, 1e-5)
    assert step.project is not None
    (fixed,) = make_algo("apfl", alpha_update="fixed").phases(RND)
    assert dict(fixed.trainable) == {"model": None, "personal": None}


def test_alpha_gradient_step_hand_case():
    """One sample x = 1, y = 0; v: W = [[1], [0]], b = 0; w = 0; alpha = 0.5, so the mixture has
    W = [[0.5], [0]], logits [0.5, 0], p_0 = sigmoid(0.5). d/dalpha CE = <v - w, grad CE(v_bar)>
    = (p_0 - 1) * x * 1 (only W[0, 0] differs) = sigmoid(0.5) - 1 = -0.377541; plus rho alpha =
    0.02 * 0.5: g = -0.367541; alpha <- 0.5 - 0.1 g = 0.5367541."""
    algo = _tiny()
    v = {"classifier.weight": _t([1.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    w = {"classifier.weight": _t([0.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    sig = 1.0 / (1.0 + math.exp(-0.5))
    g, new = _alpha_step(algo, v, w, torch.tensor(0.5, dtype=torch.float64), batch)
    assert g.item() == pytest.approx(sig - 1.0 + 0.02 * 0.5, abs=1e-12)
    assert g.item() == pytest.approx(-0.367541, abs=1e-6)
    assert new.item() == pytest.approx(0.5 - 0.1 * (sig - 1.0 + 0.01), abs=1e-12)
    # alpha_lr_scale scales the step; alpha_reg 0 drops the rho term
    g0, new0 = _alpha_step(_tiny(alpha_reg=0.0, alpha_lr_scale=2.0), v, w, torch.tensor(0.5, dtype=torch.float64),
                           batch)
    assert g0.item() == pytest.approx(sig - 1.0, abs=1e-12)
    assert new0.item() == pytest.approx(0.5 - 0.2 * (sig - 1.0), abs=1e-12)


def test_alpha_gradient_matches_the_closed_form_on_a_cnn():
    """<v - w, grad f(v_bar)> summed over every parameter, float64, cnn4 with a batch of 4."""
    algo = make_algo("apfl", alpha_reg=0.0)
    w = {k: t.double() for k, t in initial_params(seed=0).items()}
    v = {k: t.double() for k, t in initial_params(seed=1).items()}
    torch.manual_seed(2)
    batch = {"x": torch.randn(4, 3, 28, 28, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 3]),
             "w": torch.full((4,), 0.25, dtype=torch.float64)}
    a = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(algo.alpha_loss(v, w, a, batch), [a])
    vbar = {k: (0.3 * v[k] + 0.7 * w[k]).requires_grad_() for k in v}
    gf = torch.autograd.grad(F.cross_entropy(algo.forward(vbar, batch["x"]), batch["y"]), list(vbar.values()))
    closed = sum(torch.sum((v[k] - w[k]) * gk) for k, gk in zip(vbar, gf))
    torch.testing.assert_close(g, closed, atol=1e-12, rtol=1e-10)


def test_alpha_is_clipped_to_the_unit_interval():
    algo = _tiny()
    clip = algo.clip_alpha
    for a, want in [(1.3, 1.0), (-0.2, 0.0), (0.4, 0.4), (1.0, 1.0), (0.0, 0.0)]:
        assert clip({"alpha": {"alpha": torch.tensor(a)}})["alpha"]["alpha"].item() == pytest.approx(want)
    # the hand case from alpha = 0.99 steps above 1 (0.99 + 0.1 * 0.36...) and is clipped to 1
    v = {"classifier.weight": _t([1.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    w = {"classifier.weight": _t([0.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    _, new = _alpha_step(algo, v, w, torch.tensor(0.99, dtype=torch.float64), batch)
    assert new.item() == 1.0
    # and a step pushing it below 0 lands on 0 (class 1: the gradient is positive)
    _, low = _alpha_step(_tiny(alpha_lr_scale=100.0), v, w, torch.tensor(0.05, dtype=torch.float64),
                         {**batch, "y": torch.tensor([1])})
    assert low.item() == 0.0


def test_mixed_model_mixes_parameters_and_keeps_v_buffers():
    algo = make_algo("apfl", model="simplecnn", model_args={"batch_norm": True})
    bufs = algo.forward.buffers
    assert bufs
    torch.manual_seed(0)

    def draw(count):
        return {k: (torch.tensor(count) if "num_batches" in k else torch.rand(s) + 0.5 if "running_var" in k
                    else torch.randn(s)) for k, s in algo.forward.shapes.items()}

    v, w = draw(7), draw(2)
    alpha = torch.tensor(0.25)
    mixed = algo.mix(v, w, alpha)
    for k in algo.forward.trainable:
        torch.testing.assert_close(mixed[k], 0.25 * v[k] + 0.75 * w[k])
    for k in bufs:
        assert mixed[k] is v[k]  # by reference: a training-mode forward updates v's statistics
    cloned = algo.mix(v, w, alpha, clone_buffers=True)
    assert all(cloned[k] is not v[k] and torch.equal(cloned[k], v[k]) for k in bufs)
    # personalized model: alpha v + (1 - alpha) w with the current global w
    pm = algo.personalized_model({"personal": v, "alpha": alpha}, {"model": w})
    assert_trees_close(pm, mixed, atol=0)
    # predict is the plain forward of the mixed state
    x = torch.randn(2, 3, 28, 28)
    torch.testing.assert_close(algo.predict(pm, x), algo.forward(pm, x))


def test_v_gradient_does_not_flow_into_w():
    """Training objective CE(w) + CE(alpha v + (1 - alpha) sg(w)): w gets grad CE(w) only, v gets
    alpha grad f(v_bar); alpha is a constant of the phase (float64, cnn4)."""
    algo = make_algo("apfl")
    w = {k: t.double().requires_grad_() for k, t in initial_params(seed=0).items()}
    v = {k: t.double().requires_grad_() for k, t in initial_params(seed=1).items()}
    alpha = torch.tensor(0.6, dtype=torch.float64)
    torch.manual_seed(4)
    batch = {"x": torch.randn(4, 3, 28, 28, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 3]),
             "w": torch.full((4,), 0.25, dtype=torch.float64)}
    loss = algo.train_loss({"model": w, "personal": v, "alpha": {"alpha": alpha}}, {}, batch)
    gw = torch.autograd.grad(loss, list(w.values()), retain_graph=True)
    gv = torch.autograd.grad(loss, list(v.values()))
    ref_w = torch.autograd.grad(F.cross_entropy(algo.forward(w, batch["x"]), batch["y"]), list(w.values()))
    vbar = {k: (0.6 * v[k] + 0.4 * w[k]).detach().requires_grad_() for k in v}
    gbar = torch.autograd.grad(F.cross_entropy(algo.forward(vbar, batch["x"]), batch["y"]), list(vbar.values()))
    for a, b in zip(gw, ref_w):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    for a, b in zip(gv, gbar):
        torch.testing.assert_close(a, 0.6 * b, atol=1e-12, rtol=1e-10)


def test_step_mode_trains_alpha_with_the_mixed_loss_every_step():
    algo = _tiny(alpha_update="step")
    v = {"classifier.weight": _t([1.0], [0.0]).requires_grad_(), "classifier.bias": _t(0.0, 0.0).requires_grad_()}
    w = {"classifier.weight": _t([0.0], [0.0]).requires_grad_(), "classifier.bias": _t(0.0, 0.0).requires_grad_()}
    a = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    loss = algo.train_loss({"model": w, "personal": v, "alpha": {"alpha": a}}, {}, batch)
    (g,) = torch.autograd.grad(loss, [a])
    assert g.item() == pytest.approx(1.0 / (1.0 + math.exp(-0.5)) - 1.0 + 0.01, abs=1e-12)
    # personal_objective: own -> v on CE(v) alone, alpha still on the mixed loss
    own = _tiny(alpha_update="step", personal_objective="own")
    loss = own.train_loss({"model": w, "personal": v, "alpha": {"alpha": a}}, {}, batch)
    gv = torch.autograd.grad(loss, list(v.values()), retain_graph=True)
    (ga,) = torch.autograd.grad(loss, [a])
    ref = torch.autograd.grad(F.cross_entropy(own.forward(v, batch["x"]), batch["y"]), list(v.values()))
    for x, y in zip(gv, ref):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)
    assert ga.item() == pytest.approx(g.item(), abs=1e-12)


def test_finish_uploads_w_and_keeps_v_and_alpha():
    algo = _tiny()
    w = {"classifier.weight": _t([0.0], [2.0]), "classifier.bias": _t(1.0, 0.0)}
    v = {"classifier.weight": _t([4.0], [0.0]), "classifier.bias": _t(0.0, 1.0)}
    trees = {"model": w, "personal": v, "alpha": {"alpha": _t(0.25)}}
    info = {"num_samples": _t(9.0), "steps": {"train": torch.tensor(3), "alpha": torch.tensor(1)}}
    up, state, ev = algo.finish(trees, {}, {}, info, RND)
    assert set(up) == set(algo.upload_spec()) == {"model", "num_samples"} and up["model"] is w
    assert state["personal"] is v and state["alpha"].item() == 0.25
    torch.testing.assert_close(ev["classifier.weight"], _t([1.0], [1.5]))  # 0.25 v + 0.75 w_i
    torch.testing.assert_close(ev["classifier.bias"], _t(0.75, 0.25))
    _, kept, _ = _tiny(personal_state="mixture").finish(trees, {}, {}, info, RND)
    assert_trees_close(kept["personal"], ev, atol=0)


def _engine(algo, fed_data, executor="sequential", rounds=2):
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor).run()


def test_global_model_is_fedavg_and_alpha_moves_only_on_trained_clients(fed_data):
    avg = _engine(make_algo("fedavg"), fed_data)
    res = _engine(make_algo("apfl"), fed_data)
    assert_trees_close(res.server["model"], avg.server["model"], atol=1e-6)
    assert res.rounds["bytes_up"].tolist() == avg.rounds["bytes_up"].tolist()
    trained = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    alpha = res.client_states["alpha"]
    assert ((alpha >= 0) & (alpha <= 1)).all()
    assert any(alpha[c].item() < 1.0 for c in trained)  # it moved (round 0: v = w, only 0.02 alpha acts)
    assert all(alpha[c].item() == 1.0 for c in range(fed_data.num_clients) if c not in trained)
    assert (res.records["view"] == "personalized_on_local").any()
    # uniform weighting: the plain mean of the uploaded w_i
    uni = _engine(make_algo("apfl", weighting="uniform"), fed_data, rounds=1)
    assert not torch.allclose(uni.server["model"]["classifier.weight"],
                              _engine(make_algo("apfl"), fed_data, rounds=1).server["model"]["classifier.weight"])


def test_fixed_alpha_zero_personalizes_to_the_global_model(fed_data):
    res = _engine(make_algo("apfl", alpha_update="fixed", alpha_init=0.0), fed_data)
    assert (res.client_states["alpha"] == 0).all()
    pers = res.records[res.records["view"] == "personalized_on_local"]
    glob = res.records[res.records["view"] == "global_on_local"] if "global_on_local" in set(res.records["view"]) \
        else None
    if glob is not None:
        cols = ["round", "client_id", "accuracy"]
        pd.testing.assert_frame_equal(pers[cols].reset_index(drop=True), glob[cols].reset_index(drop=True))


@pytest.mark.parametrize("overrides", [
    {"alpha_update": "step", "personal_objective": "own", "personal_state": "mixture"},
    {"alpha_update": "step", "personal_objective": "own", "personal_state": "mixture", "alpha_grad": "endpoint"},  # PFLlib
    {"alpha_update": "round", "personal_objective": "own", "personal_state": "mixture", "alpha_grad": "fhbench"},
    {"alpha_update": "fixed", "alpha_init": 0.5}])
def test_other_readings_run_alike_on_both_executors(fed_data, overrides):
    seq = _engine(make_algo("apfl", **overrides), fed_data, "sequential")
    stk = _engine(make_algo("apfl", **overrides), fed_data, "stacked")
    pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]).reset_index(drop=True),
                                  stk.records.drop(columns=["loss"]).reset_index(drop=True))
    np.testing.assert_allclose(seq.records["loss"], stk.records["loss"], atol=1e-4)
    assert_trees_close(seq.server, stk.server, atol=2e-5, rtol=1e-4)
    assert_trees_close(seq.client_states, stk.client_states, atol=1e-4, rtol=1e-4)
    alpha = seq.client_states["alpha"]
    assert ((alpha >= 0) & (alpha <= 1)).all()


SIG1 = 1.0 / (1.0 + math.exp(-1.0))


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_alpha_gradient_readings_hand_case(alpha):
    """x = 1, y = 0; v: W = [[1], [0]], b = 0 (logits [1, 0]); w = 0 (logits [0, 0]). Own-CE
    gradients: g_v = (p - e_0) x with p = softmax([1, 0]): W [[s - 1], [1 - s]], s = sigmoid(1);
    g_w: W [[-1/2], [1/2]]; the biases alike. v - w differs only in W[0, 0] (by 1), so
    endpoint: d = alpha (s - 1) + (1 - alpha)(-1/2); fhbench: d = -(alpha (-1/2) + (1 - alpha)(s - 1));
    exact: d = sigmoid(alpha) - 1 (the mixture's logits [alpha, 0]). Each plus rho alpha = 0.02 alpha."""
    v = {"classifier.weight": _t([1.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    w = {"classifier.weight": _t([0.0], [0.0]), "classifier.bias": _t(0.0, 0.0)}
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    want = {"exact": 1.0 / (1.0 + math.exp(-alpha)) - 1.0,
            "endpoint": alpha * (SIG1 - 1.0) + (1.0 - alpha) * (-0.5),
            "fhbench": -(alpha * (-0.5) + (1.0 - alpha) * (SIG1 - 1.0))}
    for reading, d in want.items():
        algo = _tiny(alpha_grad=reading)
        g, new = _alpha_step(algo, v, w, torch.tensor(alpha, dtype=torch.float64), batch)
        assert g.item() == pytest.approx(d + 0.02 * alpha, abs=1e-12), reading
        assert new.item() == pytest.approx(min(1.0, max(0.0, alpha - 0.1 * (d + 0.02 * alpha))), abs=1e-12)
    # at alpha = 1/2 FHBench's swap is exactly the negative of the end-point product
    if alpha == 0.5:
        assert want["fhbench"] == pytest.approx(-want["endpoint"])
    # step mode: the same alpha-gradient from the training objective (mixed and own objectives)
    for reading, d in want.items():
        for objective in ("mixed", "own"):
            algo = _tiny(alpha_update="step", alpha_grad=reading, personal_objective=objective)
            a = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
            vv = {k: t.clone().requires_grad_() for k, t in v.items()}
            ww = {k: t.clone().requires_grad_() for k, t in w.items()}
            (ga,) = torch.autograd.grad(algo.train_loss({"model": ww, "personal": vv, "alpha": {"alpha": a}}, {}, batch),
                                        [a])
            assert ga.item() == pytest.approx(d + 0.02 * alpha, abs=1e-12), (reading, objective)


@pytest.mark.parametrize("alpha_update", ["round", "step", "fixed"])
@pytest.mark.parametrize("personal_state", ["v", "mixture"])
def test_scored_parameters_of_every_reading(personal_state, alpha_update):
    """Hand-made v, trained local w_i, global w and alpha = 0.25: right after training the client
    scores 0.25 v + 0.75 w_i; its personalized model is 0.25 v + 0.75 w (personal_state v, the
    paper) or 0.25 v + 0.75 w_i (mixture: the stored mixture itself, PFLlib and FHBench); never
    the double mixture 0.0625 v + 0.1875 w_i + 0.75 w."""
    algo = _tiny(personal_state=personal_state, alpha_update=alpha_update)
    v = {"classifier.weight": _t([4.0], [0.0]), "classifier.bias": _t(0.0, 8.0)}
    wi = {"classifier.weight": _t([0.0], [2.0]), "classifier.bias": _t(1.0, 0.0)}
    wg = {"classifier.weight": _t([-4.0], [6.0]), "classifier.bias": _t(3.0, -2.0)}
    trees = {"model": wi, "personal": v, "alpha": {"alpha": _t(0.25)}}
    info = {"num_samples": _t(9.0), "steps": {"train": torch.tensor(3)}}
    _, state, ev = algo.finish(trees, {}, {}, info, RND)
    after = {"classifier.weight": _t([1.0], [1.5]), "classifier.bias": _t(0.75, 2.0)}  # 0.25 v + 0.75 w_i
    assert_trees_close(ev, after, atol=1e-12)
    pm = algo.personalized_model(state, {"model": wg})
    if personal_state == "v":
        want = {"classifier.weight": _t([-2.0], [4.5]), "classifier.bias": _t(2.25, 0.5)}  # 0.25 v + 0.75 w
    else:
        want = after
    assert_trees_close(pm, want, atol=1e-12)
    double = {k: 0.25 * after[k] + 0.75 * wg[k] for k in after}
    assert not torch.allclose(pm["classifier.weight"], double["classifier.weight"])


@pytest.mark.parametrize("personal_state", ["v", "mixture"])
def test_personalized_view_scores_the_reading_model(fed_data, personal_state):
    """Through the engine: the last round's personalized_on_local counts are those of the model
    each reading names, rebuilt from the returned client states and global model."""
    from medpfl.fl.evaluation import eval_groups

    algo = make_algo("apfl", personal_state=personal_state, alpha_update="step")
    res = _engine(algo, fed_data)
    pers = res.records[(res.records["view"] == "personalized_on_local") & (res.records["round"] == 1)]
    pers = pers.set_index("client_id").sort_index()
    trained = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    for c in range(fed_data.num_clients):
        v = {k: t[c] for k, t in res.client_states["personal"].items()}
        a = res.client_states["alpha"][c]
        model = v if personal_state == "mixture" else algo.mix(v, res.server["model"], a)
        correct, _, _ = eval_groups(algo.predict, model, fed_data, [fed_data.client_test[c]], 256)
        assert pers.loc[c, "correct"] == int(correct.sum())
        if personal_state == "mixture" and c not in trained:  # never trained: the initial model (as PFLlib)
            assert a.item() == 1.0
