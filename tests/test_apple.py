"""APPLE (Luo & Wu, IJCAI 2022): the mixture of hand-made core models, the lambda_t schedules,
the DR vector's gradient step on a hand case (exact and PFLlib's layer mean, closed form), the
core's gradient p_ii grad, the server replacing only the uploaders' cores, p_i and the BN
buffers never uploaded, the download's bytes (K core models per recipient), BatchNorm buffers
kept per client, and the non-default readings on both executors."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.algorithms.apple import dr_lambda
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import model_state
from medpfl.fl.optim import sgd
from medpfl.models import build_model
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, make_algo, phase_chains

RND = RoundInfo(round=0, rounds=10, lr=0.1, num_clients=2, seed=1, base_lr=0.1)


def _tiny(**kw):
    """APPLE on a linear model of 1 input, 2 classes (``mlr``): classifier.weight [2, 1], classifier.bias [2]."""
    return make_algo("apple", num_classes=2, model="mlr", in_channels=1, image_size=None, **kw)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def _cores(*models):
    return {k: torch.stack([m[k] for m in models]) for k in models[0]}


def _lin(w, b):
    return {"classifier.weight": _t(*w), "classifier.bias": _t(*b)}


def test_defaults_and_program():
    algo = make_algo("apple")
    c = algo.cfg
    assert (c.dr_lr, c.dr_lr_decay, c.mu, c.schedule, c.reg_rounds_fraction, c.dr_gradient, c.core_lr_times_k) == \
        (1e-3, False, 1e-3, "cosine", 1.0, "exact", False)
    rnd = RoundInfo(round=3, rounds=10, lr=0.05, num_clients=7, base_lr=0.1)
    (ph,) = algo.phases(rnd)
    assert ph.name == "train" and dict(ph.trainable) == {"core": None, "dr": None}
    chains = phase_chains(ph, rnd.lr)  # the run's optimizer (momentum 0.9, weight decay 1e-5), each tree its lr
    assert chains["core"] == sgd(0.05, 0.9, 1e-5) and chains["dr"].transforms[:-1] == chains["core"].transforms[:-1]
    assert chains["dr"].lr == pytest.approx(1e-3)
    (k_ph,) = make_algo("apple", core_lr_times_k=True, dr_lr_decay=True).phases(rnd)
    assert phase_chains(k_ph, rnd.lr)["core"].lr == pytest.approx(0.35)  # PFLlib: lr x N
    assert phase_chains(k_ph, rnd.lr)["dr"].lr == pytest.approx(0.5e-3)  # authors: lr_coef x decay^r
    assert set(algo.upload_spec()) == {"core", "num_samples"}
    assert set(algo.upload_spec()["core"].shapes) == set(algo.forward.trainable)


def test_lambda_schedule():
    cos = [dr_lambda(t, 8, 1.0, "cosine") for t in range(10)]
    assert cos[0] == 1.0 and cos[4] == pytest.approx(0.5) and cos[2] == pytest.approx((math.cos(math.pi / 4) + 1) / 2)
    assert cos[6] == pytest.approx((math.cos(3 * math.pi / 4) + 1) / 2)
    assert all(a > b for a, b in zip(cos[:8], cos[1:8])) and cos[8] == cos[9] == 0.0
    # the authors' horizon: L = int(0.1 T); FHBench's: L = T
    assert dr_lambda(5, 100, 0.1, "cosine") == pytest.approx(0.5) and dr_lambda(10, 100, 0.1, "cosine") == 0.0
    assert dr_lambda(0, 100, 0.1, "exponential") == 1.0
    assert dr_lambda(5, 100, 0.1, "exponential") == pytest.approx(1e-3 ** 0.5)
    assert dr_lambda(10, 100, 0.1, "exponential") == 0.0
    assert dr_lambda(0, 5, 0.0, "cosine") == 0.0  # no horizon: no proximal term


def test_mixture_of_hand_made_cores():
    """Client 1 of K = 3, p = [0.2, 0.5, 0.3]: sum_{j != 1} p_j C_j + p_1 c with its trained own c
    (not the server's C_1); the personalized model is sum_j p_j C_j with the server's cores."""
    algo = _tiny()
    c0, c1, c2 = _lin(([1.0], [2.0]), (0.0, 1.0)), _lin(([3.0], [0.0]), (1.0, 1.0)), _lin(([0.0], [-1.0]), (2.0, 0.0))
    own_c = _lin(([5.0], [5.0]), (0.0, 0.0))
    cores = _cores(c0, c1, c2)
    p = _t(0.2, 0.5, 0.3)
    e1 = _t(0.0, 1.0, 0.0)
    mixed = algo.mixture(p, cores, e1, own_c)
    torch.testing.assert_close(mixed["classifier.weight"], _t([0.2 + 2.5], [0.4 + 2.5 - 0.3]))
    torch.testing.assert_close(mixed["classifier.bias"], _t(0.6, 0.0) + _t(0.0, 0.0) + _t(0.0, 0.2))
    pm = algo.personalized_model({"p": p}, {"cores": cores})
    torch.testing.assert_close(pm["classifier.weight"], _t([0.2 + 1.5], [0.4 - 0.3]))
    torch.testing.assert_close(pm["classifier.bias"], _t(0.5 + 0.6, 0.2 + 0.5))
    # begin picks C_i exactly as the own core, from the shared download
    trees, ctx = algo.begin({"cores": cores}, {"p": p}, {"client": torch.tensor(1)}, RND)
    assert_trees_close(trees["core"], c1, atol=0)
    assert torch.equal(ctx["own"], e1) and trees["dr"]["p"] is p
    # with c = C_1 the training mixture and the personalized model agree
    assert_trees_close(algo.mixture(p, cores, e1, trees["core"]), pm, atol=1e-15)
    # the same algebra on the exact layer-mean surrogate: its value is the mixture's
    assert_trees_close(_tiny(dr_gradient="layer_mean").mixture(p, cores, e1, own_c), mixed, atol=0)


def _grads(algo, cores, p, client, batch, rnd):
    received = {"cores": cores}
    trees, ctx = algo.begin(received, {"p": p}, {"client": torch.tensor(client)}, rnd)
    ctx = {**algo.shared_context(received, rnd), **ctx}
    core = {k: v.clone().requires_grad_() for k, v in trees["core"].items()}
    pp = trees["dr"]["p"].clone().requires_grad_()
    (ph,) = algo.phases(rnd)
    loss = ph.loss({"core": core, "dr": {"p": pp}}, ctx, batch)
    g = torch.autograd.grad(loss, [pp, *core.values()])
    return ph, g[0], dict(zip(core, g[1:]))


def test_dr_vector_gradient_step_hand_case():
    """K = 2, client 0; x = 1, y = 0; C_0: W = [[1], [0]], b = 0; C_1: W = [[0], [2]], b = [1, 0];
    p = [0.7, 0.3]: w = W [[0.7], [0.6]], b [0.3, 0], logits [1.0, 0.6]; a = 1 - sigmoid(0.4);
    grad_logits = [-a, a] = grad_W (x = 1) = grad_b.
    d/dp_0 = <C_0, grad> = -a;  d/dp_1 = <C_1, grad> = 2a - a = a;  + mu lambda (p - 1/2).
    Round 0: lambda = 1; mu = 0.1: + [0.02, -0.02]. The own core's gradient: p_0 grad."""
    algo = _tiny(mu=0.1)
    cores = _cores(_lin(([1.0], [0.0]), (0.0, 0.0)), _lin(([0.0], [2.0]), (1.0, 0.0)))
    p = _t(0.7, 0.3)
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    a = 1.0 - 1.0 / (1.0 + math.exp(-0.4))
    ph, gp, gc = _grads(algo, cores, p, 0, batch, RND)
    torch.testing.assert_close(gp, _t(-a + 0.02, a - 0.02), atol=1e-12, rtol=0)
    torch.testing.assert_close(gc["classifier.weight"], 0.7 * _t([-a], [a]), atol=1e-12, rtol=0)
    torch.testing.assert_close(gc["classifier.bias"], 0.7 * _t(-a, a), atol=1e-12, rtol=0)
    # the engine's step on p at the phase's lr (1e-3, absolute), no momentum, no weight decay
    leaf = {"p": p.clone()}
    opt = phase_chains(ph, RND.lr, momentum=0.0, weight_decay=0.0)["dr"]
    opt.step_(leaf, {"p": gp.clone()}, opt.init(leaf), count=1)
    torch.testing.assert_close(leaf["p"], _t(0.7 - 1e-3 * (-a + 0.02), 0.3 - 1e-3 * (a - 0.02)), atol=1e-15, rtol=0)
    # lambda_t = 0 at the end of the horizon: no proximal pull
    late = RoundInfo(round=10, rounds=10, lr=0.1, num_clients=2, base_lr=0.1)
    _, gp_late, _ = _grads(algo, cores, p, 0, batch, late)
    torch.testing.assert_close(gp_late, _t(-a, a), atol=1e-12, rtol=0)
    # PFLlib/FHBench's layer mean: (1/|P|) sum_t mean(grad_t * C_j,t), |P| = 2 tensors of 2 elements
    _, gm, gcm = _grads(_tiny(mu=0.1, dr_gradient="layer_mean"), cores, p, 0, batch, RND)
    torch.testing.assert_close(gm, _t(0.5 * (-a / 2 + 0.0) + 0.02, 0.5 * (2 * a / 2 - a / 2) - 0.02), atol=1e-12,
                               rtol=0)
    assert_trees_close(gcm, gc, atol=1e-15)  # the core's gradient is unchanged


def test_own_dr_entry_differentiates_against_the_trained_core():
    """d/dp_i uses the client's current core c (not the downloaded C_i): with c = C_i + d the
    gradient gains <d, grad>; client 1 here."""
    algo = _tiny(mu=0.0)
    cores = _cores(_lin(([1.0], [0.0]), (0.0, 0.0)), _lin(([0.0], [0.0]), (0.0, 0.0)))
    p = _t(0.5, 0.5)
    batch = {"x": _t([1.0]), "y": torch.tensor([0]), "w": _t(1.0)}
    received = {"cores": cores}
    trees, ctx = algo.begin(received, {"p": p}, {"client": torch.tensor(1)}, RND)
    ctx = {**algo.shared_context(received, RND), **ctx}
    core = {"classifier.weight": _t([0.0], [4.0]), "classifier.bias": _t(0.0, 0.0)}  # c = C_1 + d
    pp = p.clone().requires_grad_()
    (ph,) = algo.phases(RND)
    (g,) = torch.autograd.grad(ph.loss({"core": core, "dr": {"p": pp}}, ctx, batch), [pp])
    # w: W = [[0.5], [2.0]] -> logits [0.5, 2.0]; s = softmax; grad_W = [[s0 - 1], [s1]]
    s0 = 1.0 / (1.0 + math.exp(1.5))
    torch.testing.assert_close(g, _t(s0 - 1.0, 4.0 * (1.0 - s0)), atol=1e-12, rtol=0)


def test_server_replaces_only_the_uploaders_cores():
    algo = make_algo("apple", model="mlp", model_args={"hidden": 8})
    torch.manual_seed(0)
    params = {k: torch.randn(s) for k, s in algo.forward.shapes.items()}
    server = algo.init_server(params, Federation(4))
    assert set(server) == {"cores"} and set(server["cores"]) == set(algo.forward.trainable)
    for k, c in server["cores"].items():  # K identical copies of the initial model
        assert c.shape == (4, *params[k].shape) and all(torch.equal(c[j], params[k]) for j in range(4))
    ups = {"core": {k: torch.randn(2, *params[k].shape) for k in algo.forward.trainable},
           "num_samples": torch.tensor([5.0, 9.0])}
    new = algo.aggregate(server, ups, torch.tensor([2, 0]), RND)
    for k, c in new["cores"].items():
        assert torch.equal(c[2], ups["core"][k][0]) and torch.equal(c[0], ups["core"][k][1])
        assert torch.equal(c[1], params[k]) and torch.equal(c[3], params[k])
    assert algo.global_model(new) is None
    state = algo.init_client_state(params, 3, Federation(4))  # the DR vector has K = 4 entries, from the hook's input
    assert set(state) == {"p"} and torch.equal(state["p"], torch.full((4,), 0.25))
    assert torch.equal(algo.init_client_state(params, 3, Federation(5))["p"], torch.full((5,), 0.2))


def test_p_and_buffers_never_leave_the_client():
    algo = make_algo("apple", model="simplecnn", model_args={"batch_norm": True})
    assert algo.forward.buffers
    torch.manual_seed(0)
    params = model_state(build_model("simplecnn", 3, 4, 28, {"batch_norm": True}))
    state = algo.init_client_state(params, 1, Federation(3))
    assert set(state) == {"p", "buffers"} and set(state["buffers"]) == set(algo.forward.buffers)
    cores = {k: torch.stack([params[k]] * 3) for k in algo.forward.trainable}
    trees, ctx = algo.begin({"cores": cores}, state, {"client": torch.tensor(1)}, RND)
    info = {"num_samples": torch.tensor(7.0), "steps": {"train": torch.tensor(2)}}
    up, new_state, model = algo.finish(trees, {**algo.shared_context({"cores": cores}, RND), **ctx}, state, info, RND)
    assert set(up) == {"core", "num_samples"} and set(up["core"]) == set(algo.forward.trainable)
    assert not set(up["core"]) & set(algo.forward.buffers)
    assert set(new_state) == {"p", "buffers"}
    for b in algo.forward.buffers:  # the evaluated mixture carries the client's own buffers
        assert torch.equal(model[b], state["buffers"][b])


def _engine(algo, fed_data, executor="sequential", rounds=2, model="mlp", model_args=None):
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0,
                        model=model, model_args=model_args)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor).run()


def test_run_downloads_every_core_and_moves_p_only_on_trained_clients(fed_data):
    algo = make_algo("apple", model="mlp", model_args={"hidden": 16})
    res = _engine(algo, fed_data, model_args={"hidden": 16})
    k = fed_data.num_clients
    p_bytes = sum(math.prod(algo.forward.shapes[n]) * 4 for n in algo.forward.trainable)
    m = res.rounds["num_sampled"]
    assert res.rounds["bytes_down"].tolist() == (m * k * p_bytes).tolist()  # K cores to each recipient
    assert res.rounds["bytes_up"].tolist() == (m * (p_bytes + 4)).tolist()  # the own core + n_i
    trained = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    p = res.client_states["p"]
    assert p.shape == (k, k)
    for c in range(k):
        moved = not torch.equal(p[c], torch.full((k,), 1.0 / k))
        assert moved == (c in trained), c
    # the cores of clients that never trained are still the (common) initial model; a trained one moved
    cores = res.server["cores"]
    untouched = [c for c in range(k) if c not in trained]
    for kk, v in cores.items():
        assert all(torch.equal(v[c], v[untouched[0]]) for c in untouched)
    for t in trained:
        assert untouched and any(not torch.equal(v[t], v[untouched[0]]) for v in cores.values())
    views = set(res.records["view"])
    assert "personalized_on_local" in views and "global_test" not in views and "global_on_local" not in views


def test_batchnorm_buffers_are_the_clients_own(fed_data):
    args = {"batch_norm": True}
    algo = make_algo("apple", model="simplecnn", model_args=args)
    res = _engine(algo, fed_data, rounds=1, model="simplecnn", model_args=args)
    sampled = [int(c) for c in res.rounds["sampled_clients"].iloc[0].split()]
    bufs = res.client_states["buffers"]
    run_mean = [b for b in algo.forward.buffers if b.endswith("running_mean")][0]
    for c in range(fed_data.num_clients):
        changed = bool(bufs[run_mean][c].abs().sum() > 0)  # the initial running mean is 0
        assert changed == (c in sampled), c
    assert not set(res.server["cores"]) & set(algo.forward.buffers)
    # the personalized model carries each client's own running statistics
    for c in range(fed_data.num_clients):
        torch.testing.assert_close(res.personalized[run_mean][c], bufs[run_mean][c], atol=0, rtol=0)


@pytest.mark.parametrize("overrides", [
    {"dr_gradient": "layer_mean", "core_lr_times_k": True},
    {"schedule": "exponential", "reg_rounds_fraction": 0.5, "dr_lr_decay": True, "mu": 0.1},
])
def test_other_readings_run_alike_on_both_executors(fed_data, overrides):
    args = {"hidden": 16}
    seq = _engine(make_algo("apple", model="mlp", model_args=args, **overrides), fed_data, "sequential",
                  model_args=args)
    stk = _engine(make_algo("apple", model="mlp", model_args=args, **overrides), fed_data, "stacked", model_args=args)
    pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]).reset_index(drop=True),
                                  stk.records.drop(columns=["loss"]).reset_index(drop=True))
    np.testing.assert_allclose(seq.records["loss"], stk.records["loss"], atol=1e-4)
    assert_trees_close(seq.server, stk.server, atol=2e-5, rtol=1e-4)
    assert_trees_close(seq.client_states, stk.client_states, atol=1e-4, rtol=1e-4)
    default = _engine(make_algo("apple", model="mlp", model_args=args), fed_data, model_args=args)
    assert not torch.equal(seq.client_states["p"], default.client_states["p"])
