"""pFedKD-WCL (Hu, Kothari & Banerjee, Algorithms 2025; spec ``methods-pfedkdwcl-epfl.md`` A.1):
the client's weighted combination loss (Eq. 3) and its gradient on a tiny linear model (closed
form, numpy, and the official code's plain-torch formula), the server gradient
grad_w KL(p_w || p_theta) (closed form dKL/dz_k = p_k (log p_k - log q_k - KL) and the code's
``compute_kl_gradients``), the server step (uniform, n-weighted, the code's last-client bug),
theta's persistence and independent initialisation, a whole round against a plain-torch
reference, what crosses to the server, and the two executors in float64."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.payload import UploadSpecError, check_upload, payload_nbytes
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Download, RoundInfo, phase_plan
from medpfl.fl.sampling import seeded_cpu_rng
from medpfl.fl.stacked import StackedExecutor
from medpfl.fl.tree import tree_index, tree_leaves
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, make_algo
from tests.linear_model import kd_hand_case, linear_algo, random_params

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=4, seed=1, base_lr=0.01, batch_size=20)
D, C = 2, 3  # the tiny linear model: logits = x W^T + b


def lin(W, b):
    return {"fc.weight": torch.tensor(W, dtype=torch.float64), "fc.bias": torch.tensor(b, dtype=torch.float64)}


def np_softmax(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def client_loss_and_grad(algo, theta, teacher, x, y, w):
    """The client objective through the method's own hooks (shared context, sample context, the
    phase's loss) and its gradient w.r.t. theta's weight and bias."""
    ctx = algo.shared_context({"model": teacher}, RND)
    batch = {"x": x, "y": y, "w": w, **algo.sample_context(ctx, x)}
    p = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    (phase,) = algo.phases(RND)
    loss = phase.loss({"theta": p}, ctx, batch)
    gw, gb = torch.autograd.grad(loss, [p["fc.weight"], p["fc.bias"]])
    return loss.item(), gw, gb


# ----- defaults ------------------------------------------------------------------------------
def test_defaults_and_phase():
    algo = make_algo("pfedkdwcl")
    c = algo.cfg
    assert (c.gamma, c.local_steps, c.theta_init, c.server_weighting, c.server_lr, c.legacy_last_client_grad) == \
        (0.1, 20, "persistent", "uniform", None, False)
    assert "Algorithms 2025" in algo.paper and "Hu" in algo.paper
    (ph,) = algo.phases(RND)
    assert ph.name == "train" and dict(ph.trainable) == {"theta": None} and ph.steps == 20
    # the run's optimizer and batch size (the study: SGD lr 0.01, no momentum/decay, batch 20)
    assert ph.optimizer == RunOptimizer() and ph.batch_size is None
    assert make_algo("pfedkdwcl", local_steps=None).phases(RND)[0].steps is None  # train.local_epochs epochs


# ----- the client objective, Eq. (3) ----------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.1, 0.7])
def test_client_loss_and_gradient_closed_form(gamma):
    # theta uniform (p_theta = 1/3 each), teacher p_w = (1/2, 1/4, 1/4), two samples, labels 0
    # and 1 (kd_hand_case): CE = ln 3; KL(p_w || p_theta) = 1/2 ln(9/8).
    algo = linear_algo("pfedkdwcl", D, C, gamma=gamma)
    case = kd_hand_case()
    loss, gw, gb = client_loss_and_grad(algo, lin(*case["student"]), lin(*case["teacher"]), case["x"], case["y"],
                                        case["w"])
    assert loss == pytest.approx((1 - gamma) * math.log(3.0) + gamma * 0.5 * math.log(9.0 / 8.0), rel=1e-12)
    # d loss / d logits_i = 1/2 [(1 - gamma)(p_theta - e_{y_i}) + gamma (p_theta - p_w)]
    kd = np.array([1 / 3 - 1 / 2, 1 / 3 - 1 / 4, 1 / 3 - 1 / 4])
    g0 = 0.5 * ((1 - gamma) * np.array([1 / 3 - 1, 1 / 3, 1 / 3]) + gamma * kd)
    g1 = 0.5 * ((1 - gamma) * np.array([1 / 3, 1 / 3 - 1, 1 / 3]) + gamma * kd)
    # by hand: db = (1-gamma)(-1/6, -1/6, 1/3) + gamma (-1/6, 1/12, 1/12)
    np.testing.assert_allclose(gb.numpy(), [-(1 - gamma) / 6 - gamma / 6, -(1 - gamma) / 6 + gamma / 12,
                                            (1 - gamma) / 3 + gamma / 12], rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), g0 + g1, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), np.outer(g0, [1.0, 2.0]) + np.outer(g1, [-1.0, 3.0]), rtol=1e-12)


@pytest.mark.parametrize("gamma", [0.0, 0.1, 1.0])
def test_client_loss_matches_numpy_and_the_official_code_padding_ignored(gamma):
    W, b = [[0.5, -1.0], [1.5, 0.25], [-0.75, 2.0]], [0.1, -0.2, 0.3]
    Wt, bt = [[-1.0, 0.5], [0.25, 1.0], [2.0, -0.5]], [0.0, 0.5, -0.5]
    x = torch.tensor([[1.0, -0.5], [0.3, 2.0], [-1.2, 0.7]], dtype=torch.float64)
    y = torch.tensor([2, 0, 1])
    w = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)  # the third sample is padding
    algo = linear_algo("pfedkdwcl", D, C, gamma=gamma)
    loss, gw, gb = client_loss_and_grad(algo, lin(W, b), lin(Wt, bt), x, y, w)

    # numpy, by the definition, over the two real samples
    xn, yn = x.numpy()[:2], y.numpy()[:2]
    q = np_softmax(xn @ np.array(W).T + np.array(b))
    p = np_softmax(xn @ np.array(Wt).T + np.array(bt))
    ce = -np.log(q[[0, 1], yn])
    kl = np.sum(p * (np.log(p) - np.log(q)), axis=1)
    assert loss == pytest.approx((1 - gamma) * ce.mean() + gamma * kl.mean(), rel=1e-12)
    g = 0.5 * ((1 - gamma) * (q - np.eye(C)[yn]) + gamma * (q - p))  # d loss / d logits
    np.testing.assert_allclose(gb.numpy(), g.sum(0), rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(gw.numpy(), g.T @ xn, rtol=1e-10, atol=1e-15)

    # plain torch, as pfedkdUser.train writes it (log_softmax outputs, nll_loss, kl_div batchmean)
    Wl, bl = (torch.tensor(W, dtype=torch.float64, requires_grad=True),
              torch.tensor(b, dtype=torch.float64, requires_grad=True))
    xr, yr = x[:2], y[:2]
    output = F.log_softmax(xr @ Wl.T + bl, dim=1)
    global_probs = F.softmax(xr @ torch.tensor(Wt, dtype=torch.float64).T + torch.tensor(bt, dtype=torch.float64), 1)
    local_probs = F.softmax(xr @ Wl.T + bl, dim=1)
    ref = (1 - gamma) * F.nll_loss(output, yr) + gamma * F.kl_div(local_probs.log(), global_probs,
                                                                  reduction="batchmean")
    rw, rb = torch.autograd.grad(ref, [Wl, bl])
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(gb, rb, rtol=1e-10, atol=1e-14)


def test_teacher_is_frozen_in_the_client_loss():
    algo = linear_algo("pfedkdwcl", D, C, gamma=0.5)
    teacher = {k: v.clone().requires_grad_(True) for k, v in lin([[1.0, -1.0]] * 3, [0.3, 0.0, -0.3]).items()}
    ctx = algo.shared_context({"model": teacher}, RND)
    assert ctx["teacher"] is teacher
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    batch = {"x": x, "y": torch.tensor([1]), "w": torch.ones(1, dtype=torch.float64),
             **algo.sample_context(ctx, x)}
    theta = {k: v.clone().requires_grad_(True) for k, v in lin([[0.5, 0.0]] * 3, [0.0, 0.1, 0.2]).items()}
    loss = algo.wcl_loss({"theta": theta}, ctx, batch)
    assert all(g is None for g in torch.autograd.grad(loss, list(teacher.values()), allow_unused=True))


# ----- the server gradient --------------------------------------------------------------------
def _kl_grad_closed_form(Wt, bt, W, b, x):
    """grad_w mean_x KL(p_w(x) || p_theta(x)) for a linear w, by dKL/dz_k = p_k (log p_k - log q_k - KL)."""
    p = np_softmax(x @ Wt.T + bt)
    q = np_softmax(x @ W.T + b)
    kl = np.sum(p * (np.log(p) - np.log(q)), axis=1, keepdims=True)
    dz = p * (np.log(p) - np.log(q) - kl)  # [n, C]
    return dz.T @ x / len(x), dz.mean(0)


def test_server_gradient_closed_form_and_official_code_summed_over_batches():
    gen = torch.Generator().manual_seed(0)
    Wt, bt = torch.randn(C, D, generator=gen, dtype=torch.float64), torch.randn(C, generator=gen, dtype=torch.float64)
    W, b = torch.randn(C, D, generator=gen, dtype=torch.float64), torch.randn(C, generator=gen, dtype=torch.float64)
    x = torch.randn(3, D, generator=gen, dtype=torch.float64)
    teacher, theta = {"fc.weight": Wt, "fc.bias": bt}, {"fc.weight": W, "fc.bias": b}
    algo = linear_algo("pfedkdwcl", D, C)
    (kl_pass,) = algo.passes(RND)
    assert kl_pass.name == "kl_grad" and kl_pass.when == "after"
    ctx = algo.shared_context({"model": teacher}, RND)
    # the local train set in two padded batches (as an executor cuts it); batch weights 1/b, 0 on padding
    y = torch.zeros(2, dtype=torch.int64)
    b1 = {"x": x[:2], "y": y, "w": torch.tensor([0.5, 0.5], dtype=torch.float64)}
    b2 = {"x": torch.cat([x[2:], x[:1]]), "y": y, "w": torch.tensor([1.0, 0.0], dtype=torch.float64)}
    s1, s2 = kl_pass.fn({"theta": theta}, ctx, b1), kl_pass.fn({"theta": theta}, ctx, b2)
    summed = {"g": {k: s1["g"][k] + s2["g"][k] for k in s1["g"]}}
    assert set(summed["g"]) == {"fc.weight", "fc.bias"}
    info = {"num_samples": torch.tensor(3.0, dtype=torch.float64), "kl_grad": summed}
    up, state, model = algo.finish({"theta": theta}, ctx, {"theta": theta}, info, RND)
    gW, gb = _kl_grad_closed_form(Wt.numpy(), bt.numpy(), W.numpy(), b.numpy(), x.numpy())
    np.testing.assert_allclose(up["grad"]["fc.weight"].numpy(), gW, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(up["grad"]["fc.bias"].numpy(), gb, rtol=1e-10, atol=1e-14)
    assert np.abs(gW).max() > 1e-3  # not trivially zero

    # pfedkdUser.compute_kl_gradients: kl_div(local_probs.log(), global_probs, batchmean) on all of
    # X_train, local model frozen, backward into the global model
    gw_ = {k: v.clone().requires_grad_(True) for k, v in teacher.items()}
    local_probs = F.softmax(x @ W.T + b, dim=1)
    global_probs = F.softmax(x @ gw_["fc.weight"].T + gw_["fc.bias"], dim=1)
    F.kl_div(local_probs.log(), global_probs, reduction="batchmean").backward()
    torch.testing.assert_close(up["grad"]["fc.weight"], gw_["fc.weight"].grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(up["grad"]["fc.bias"], gw_["fc.bias"].grad, rtol=1e-10, atol=1e-14)


def test_server_gradient_vanishes_when_the_student_matches_the_teacher():
    algo = linear_algo("pfedkdwcl", D, C)
    w = lin([[1.0, -2.0], [0.5, 0.5], [-1.0, 0.0]], [0.1, 0.2, 0.3])
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]], dtype=torch.float64)
    out = algo.kl_grad_sum({"theta": w}, {"teacher": w}, {"x": x, "y": torch.zeros(2, dtype=torch.int64),
                                                          "w": torch.full((2,), 0.5, dtype=torch.float64)})
    for g in out["g"].values():
        assert g.abs().max() < 1e-14


# ----- what crosses, what is kept -------------------------------------------------------------
def test_finish_uploads_the_gradient_and_keeps_theta():
    algo = linear_algo("pfedkdwcl", D, C)
    theta = lin([[1.0, 2.0]] * 3, [0.0, 1.0, 2.0])
    g = {"fc.weight": torch.full((C, D), 6.0, dtype=torch.float64),
         "fc.bias": torch.full((C,), 3.0, dtype=torch.float64)}
    info = {"num_samples": torch.tensor(3.0, dtype=torch.float64), "kl_grad": {"g": g}, "steps": {"train": 20}}
    up, state, model = algo.finish({"theta": theta}, {}, {"theta": lin([[0.0, 0.0]] * 3, [0.0] * 3)}, info, RND)
    assert set(up) == set(algo.upload_spec()) == {"grad", "num_samples"}
    assert torch.equal(up["grad"]["fc.weight"], torch.full((C, D), 2.0, dtype=torch.float64))
    assert torch.equal(up["grad"]["fc.bias"], torch.full((C,), 1.0, dtype=torch.float64))
    assert state == {"theta": theta} and model is theta
    assert algo.personalized_model(state, {"model": None}) is theta
    # an upload carrying theta is refused by the upload check
    stacked = {"grad": {k: v.unsqueeze(0) for k, v in g.items()}, "num_samples": torch.ones(1)}
    check_upload(algo.name, algo.upload_spec(), stacked, 1)
    leak = {**stacked, "theta": {k: v.unsqueeze(0) for k, v in theta.items()}}
    with pytest.raises(UploadSpecError):
        check_upload(algo.name, algo.upload_spec(), leak, 1)


def test_begin_persistent_keeps_theta_global_restarts_from_w():
    w = lin([[1.0, 1.0]] * 3, [0.0] * 3)
    own = lin([[-1.0, 2.0]] * 3, [0.5] * 3)
    trees, ctx = linear_algo("pfedkdwcl", D, C).begin({"model": w}, {"theta": own}, {}, RND)
    assert trees == {"theta": own} and ctx == {}
    trees, _ = linear_algo("pfedkdwcl", D, C, theta_init="global").begin({"model": w}, {"theta": own}, {}, RND)
    assert trees == {"theta": w}


# ----- the server step ------------------------------------------------------------------------
def _uploads():
    g = {"fc.weight": torch.tensor([[[1.0, 0.0]] * 3, [[0.0, 2.0]] * 3, [[4.0, -4.0]] * 3]),
         "fc.bias": torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, -2.0], [0.0, 0.0, 8.0]])}
    return {"grad": g, "num_samples": torch.tensor([10.0, 30.0, 60.0])}


def _server():
    return {"model": {"fc.weight": torch.ones(C, D), "fc.bias": torch.zeros(C)}}


def _step(weights, lr):
    g = _uploads()["grad"]
    s = _server()["model"]
    return {k: s[k] - lr * sum(a * g[k][j] for j, a in enumerate(weights)) for k in s}


@pytest.mark.parametrize("cfg,weights", [
    ({}, [1 / 3, 1 / 3, 1 / 3]),
    ({"server_weighting": "num_samples"}, [0.1, 0.3, 0.6]),
    # the official code's bug: only the last sampled client's gradient, scaled by 1 + n_last / sum n
    ({"legacy_last_client_grad": True}, [0.0, 0.0, 1.6]),
    ({"legacy_last_client_grad": True, "server_weighting": "num_samples"}, [0.0, 0.0, 1.6]),
])
def test_server_step(cfg, weights):
    algo = linear_algo("pfedkdwcl", D, C, **cfg)
    clients = torch.tensor([3, 0, 2])
    new = algo.aggregate(_server(), _uploads(), clients, RND)
    assert_trees_close(new["model"], _step(weights, RND.lr), atol=1e-7)
    # by hand for the bias of the uniform case: 1 - 0.01 * (1/3)(1+2+0, 1+0+0, 1-2+8) = (-0.01, -1/300, -0.07/3)
    if not cfg:
        torch.testing.assert_close(new["model"]["fc.bias"], torch.tensor([-0.01, -0.01 / 3, -0.07 / 3]))


def test_legacy_step_ignores_every_client_but_the_last():
    algo = linear_algo("pfedkdwcl", D, C, legacy_last_client_grad=True)
    up = _uploads()
    other = {"grad": {k: v.clone() for k, v in up["grad"].items()}, "num_samples": up["num_samples"]}
    for v in other["grad"].values():
        v[:2] = 123.0  # the first two clients' gradients change, their sizes do not
    a = algo.aggregate(_server(), up, torch.tensor([3, 0, 2]), RND)
    b = algo.aggregate(_server(), other, torch.tensor([3, 0, 2]), RND)
    assert_trees_close(a, b, atol=0)
    # (1 + 60/100) g_last at lr 0.01: weight row [4, -4] -> 1 - 0.016 * (4, -4)
    torch.testing.assert_close(a["model"]["fc.weight"][0], torch.tensor([1 - 0.064, 1 + 0.064]))


def test_server_lr_and_its_decay():
    rnd = RoundInfo(round=3, rounds=5, lr=0.005, num_clients=4, seed=1, base_lr=0.01)
    clients = torch.tensor([3, 0, 2])
    default = linear_algo("pfedkdwcl", D, C).aggregate(_server(), _uploads(), clients, rnd)
    assert_trees_close(default["model"], _step([1 / 3] * 3, 0.005), atol=1e-7)  # the round's client lr
    own = linear_algo("pfedkdwcl", D, C, server_lr=0.2).aggregate(_server(), _uploads(), clients, rnd)
    assert_trees_close(own["model"], _step([1 / 3] * 3, 0.1), atol=1e-7)  # 0.2 decayed as the client lr (x 1/2)


def test_buffers_of_the_global_model_are_not_stepped():
    algo = make_algo("pfedkdwcl", model="cnn4bn")
    assert "bn1.running_mean" in algo.forward.buffers and "bn1.running_mean" not in algo.upload_spec()["grad"].shapes
    server = {"model": {k: torch.zeros(s) for k, s in algo.forward.shapes.items()}}
    g = {k: torch.ones((2, *algo.forward.shapes[k])) for k in algo.forward.trainable}
    new = algo.aggregate(server, {"grad": g, "num_samples": torch.tensor([1.0, 3.0])}, torch.tensor([0, 1]), RND)
    assert torch.equal(new["model"]["bn1.running_mean"], server["model"]["bn1.running_mean"])
    torch.testing.assert_close(new["model"]["conv1.weight"], torch.full(algo.forward.shapes["conv1.weight"], -0.01))


# ----- theta's initialisation -----------------------------------------------------------------
def _engine(fed_data, algo, seed=1, **train):
    t = TrainConfig(**{"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 16, **train})
    return Engine(algo, fed_data, t, EvalConfig(), seed=seed, executor_kind="sequential")


def test_theta_init_is_random_per_client_seeded_and_independent_of_the_global_init(fed_data):
    eng = _engine(fed_data, make_algo("pfedkdwcl"))
    w0 = eng.initial_params()
    states = eng.initial_client_states(w0)
    th = states["theta"]
    k = fed_data.num_clients
    assert set(th) == set(w0)
    for name, t in th.items():
        assert t.shape == (k, *w0[name].shape) and t.dtype == w0[name].dtype
    cw = th["classifier.weight"]
    for i in range(k):
        assert not torch.allclose(cw[i], w0["classifier.weight"])
        for j in range(i):
            assert not torch.allclose(cw[i], cw[j])
    # PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in 512
    bound = 1 / math.sqrt(512)
    assert cw.abs().max() <= bound and cw.abs().max() > 0.9 * bound
    assert cw.std() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    # a function of (run seed, client id) only: the same again, another seed differs, and a draw
    # of client c outside the engine under the same seed gives the same tensor
    again = _engine(fed_data, make_algo("pfedkdwcl")).initial_client_states(w0)
    assert_trees_close(states, again, atol=0)
    other = _engine(fed_data, make_algo("pfedkdwcl"), seed=2).initial_client_states(w0)
    assert not torch.allclose(other["theta"]["classifier.weight"], cw)
    algo = make_algo("pfedkdwcl")  # (building the template draws from the generator: outside the block)
    with seeded_cpu_rng("client_state", 1, 3):
        direct = algo.init_client_state(w0, 3, Federation(5))
    assert_trees_close(direct["theta"], tree_index(th, 3), atol=0)
    # independent of the global init: re-drawing w_0 under another seed leaves theta unchanged
    w0b = _engine(fed_data, make_algo("pfedkdwcl"), seed=7).initial_params()
    assert_trees_close(eng.initial_client_states(w0b), states, atol=0)
    # the global RNG is left as it was
    torch.manual_seed(5)
    ref = torch.rand(3)
    torch.manual_seed(5)
    eng.initial_client_states(w0)
    assert torch.equal(torch.rand(3), ref)
    # theta_init=global: theta starts as w_0
    glob = _engine(fed_data, make_algo("pfedkdwcl", theta_init="global")).initial_client_states(w0)
    for i in range(k):
        assert_trees_close(tree_index(glob["theta"], i), w0, atol=0)


def test_only_methods_that_ask_get_a_seeded_client_init(fed_data):
    """pFedKD-WCL declares ``seeded_client_init``; a method that does not (FedKD draws its W_h in
    ``init_client_state``) keeps drawing from the global generator as before."""
    assert make_algo("pfedkdwcl").seeded_client_init and not make_algo("fedkd").seeded_client_init
    algo = make_algo("fedkd")
    eng = _engine(fed_data, algo)
    w0 = eng.initial_params()
    torch.manual_seed(5)
    states = eng.initial_client_states(w0)
    torch.manual_seed(5)
    ref = [algo.init_client_state(w0, c, Federation(5)) for c in range(fed_data.num_clients)]
    for c in range(fed_data.num_clients):
        assert_trees_close(tree_index(states, c), ref[c], atol=0)


def test_theta_persists_across_rounds_and_global_init_restarts_it(fed_data):
    """With gamma = 0 a persistent theta never sees w: two runs whose global models move at
    different server step sizes train identical thetas (theta is never reset to w_t). With
    theta_init = global the second round starts from w_1, so the thetas differ."""
    runs = {}
    for mode in ("persistent", "global"):
        for lr in (1e-3, 1.0):
            algo = make_algo("pfedkdwcl", model="mlp", gamma=0.0, local_steps=2, server_lr=lr, theta_init=mode)
            runs[mode, lr] = _engine(fed_data, algo, model="mlp").run()
    p_small, p_big = runs["persistent", 1e-3], runs["persistent", 1.0]
    assert not torch.allclose(p_small.server["model"]["classifier.weight"], p_big.server["model"]["classifier.weight"])
    assert_trees_close(p_small.client_states, p_big.client_states, atol=0)
    # persistent theta is not w: neither the initial nor the final global model
    final_w = p_small.server["model"]["classifier.weight"]
    for i in range(fed_data.num_clients):
        assert not torch.allclose(p_small.client_states["theta"]["classifier.weight"][i], final_w, atol=1e-3)
    g_small, g_big = runs["global", 1e-3], runs["global", 1.0]
    assert not torch.allclose(g_small.client_states["theta"]["classifier.weight"],
                              g_big.client_states["theta"]["classifier.weight"])
    # personalized evaluation scores theta, the global model is scored too
    views = set(p_small.records["view"])
    assert {"personalized_on_local", "global_on_local", "local_after_training"} <= views
    assert_trees_close(p_small.personalized, p_small.client_states["theta"], atol=0)


def test_global_init_round_starts_from_the_received_model(fed_data):
    """theta_init = global with gamma = 0 and one step: theta_1 = w_t - lr grad CE(w_t) on the
    first batch, whatever the state held."""
    algo = linear_algo("pfedkdwcl", 3 * 28 * 28, 4, gamma=0.0, local_steps=1, theta_init="global")
    train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=8,
                        optimizer={"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0})
    ex = SequentialExecutor(fed_data, train, seed=1, eval_batch_size=64)
    rnd = RoundInfo(round=0, rounds=1, lr=0.1, num_clients=fed_data.num_clients, seed=1, base_lr=0.1, batch_size=8)
    w = random_params(3 * 28 * 28, 4, seed=1)
    up, state, _ = ex.run_client(algo, {"model": w}, algo.shared_context({"model": w}, rnd),
                                 {"theta": random_params(3 * 28 * 28, 4, seed=9)}, 0, rnd)
    ids = fed_data.client_train[0]
    pos = phase_plan(len(ids), 8, 1, 1, 0, 0, algo.phases(rnd)[0])[0]
    W = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    ce = F.cross_entropy(fed_data.x(ids[pos]).flatten(1) @ W["fc.weight"].T + W["fc.bias"], fed_data.labels[ids[pos]])
    gw, gb = torch.autograd.grad(ce, [W["fc.weight"], W["fc.bias"]])
    torch.testing.assert_close(state["theta"]["fc.weight"], w["fc.weight"] - 0.1 * gw, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state["theta"]["fc.bias"], w["fc.bias"] - 0.1 * gb, atol=1e-6, rtol=1e-5)


# ----- one whole round against a plain-torch reference -----------------------------------------
def _reference_round(fed_data, algo, rnd, w, thetas, clients, gamma, steps, bs, lr, weights):
    """The official algorithm written out in plain torch (float64) on the engine's batches: per
    client, ``steps`` SGD steps on (1-gamma) nll(log_softmax) + gamma kl_div(batchmean) against
    the frozen w; then grad_w kl_div(log p_theta, p_w, batchmean) on its whole train split; then
    one server step with the given weights."""
    Ww, bw = w["fc.weight"].double(), w["fc.bias"].double()
    grads, new_thetas = [], []
    for c, th in zip(clients.tolist(), thetas):  # python ints: derive_seed keys by repr
        ids = fed_data.client_train[c]
        plan = phase_plan(len(ids), bs, 1, rnd.seed, rnd.round, c, algo.phases(rnd)[0])
        Wt, bt = th["fc.weight"].double().clone(), th["fc.bias"].double().clone()
        for s in range(steps):
            pos = plan[s][plan[s] >= 0]
            X, y = fed_data.x(ids[pos]).double().flatten(1), fed_data.labels[ids[pos]]
            Wt.requires_grad_(True)
            bt.requires_grad_(True)
            out = F.log_softmax(X @ Wt.T + bt, dim=1)
            with torch.no_grad():
                gp = F.softmax(X @ Ww.T + bw, dim=1)
            loss = (1 - gamma) * F.nll_loss(out, y) + gamma * F.kl_div(out, gp, reduction="batchmean")
            g1, g2 = torch.autograd.grad(loss, [Wt, bt])
            Wt, bt = (Wt - lr * g1).detach(), (bt - lr * g2).detach()
        new_thetas.append((Wt, bt))
        X = fed_data.x(ids).double().flatten(1)
        Wg, bg = Ww.clone().requires_grad_(True), bw.clone().requires_grad_(True)
        with torch.no_grad():
            lp = F.softmax(X @ Wt.T + bt, dim=1)
        kl = F.kl_div(lp.log(), F.softmax(X @ Wg.T + bg, dim=1), reduction="batchmean")
        grads.append(torch.autograd.grad(kl, [Wg, bg]))
    Wn = Ww - lr * sum(a * g[0] for a, g in zip(weights, grads))
    bn = bw - lr * sum(a * g[1] for a, g in zip(weights, grads))
    return (Wn, bn), new_thetas


@pytest.mark.parametrize("executor", [SequentialExecutor, StackedExecutor])
@pytest.mark.parametrize("weighting", ["uniform", "num_samples"])
def test_one_round_matches_a_plain_torch_reference(fed_data, executor, weighting):
    gamma, steps, bs, lr = 0.3, 4, 8, 0.05
    d = 3 * 28 * 28
    algo = linear_algo("pfedkdwcl", d, 4, gamma=gamma, local_steps=steps, server_weighting=weighting)
    train = TrainConfig(rounds=1, participation=0.6, local_epochs=1, batch_size=bs,
                        optimizer={"lr": lr, "momentum": 0.0, "weight_decay": 0.0})
    ex = executor(fed_data, train, seed=1, eval_batch_size=64)
    rnd = RoundInfo(round=0, rounds=1, lr=lr, num_clients=fed_data.num_clients, seed=1, base_lr=lr, batch_size=bs)
    clients = np.array([3, 0, 2])
    w = random_params(d, 4, seed=1)
    thetas = [random_params(d, 4, seed=10 + int(c)) for c in clients]
    states = {"theta": {k: torch.stack([t[k] for t in thetas]) for k in w}}
    server = {"model": w}
    down = algo.download(server, torch.as_tensor(clients), rnd)
    models, uploads, new_states = ex.train_clients(algo, down, states, clients, rnd)
    new = algo.aggregate(server, uploads, torch.as_tensor(clients), rnd)
    n = np.array([len(fed_data.client_train[c]) for c in clients], dtype=np.float64)
    weights = [1 / 3] * 3 if weighting == "uniform" else list(n / n.sum())
    (Wn, bn), ref_thetas = _reference_round(fed_data, algo, rnd, w, thetas, clients, gamma, steps, bs, lr, weights)
    for j, (Wt, bt) in enumerate(ref_thetas):
        torch.testing.assert_close(new_states["theta"]["fc.weight"][j].double(), Wt, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(new_states["theta"]["fc.bias"][j].double(), bt, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(models["fc.weight"][j], new_states["theta"]["fc.weight"][j], atol=0, rtol=0)
    torch.testing.assert_close(new["model"]["fc.weight"].double(), Wn, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(new["model"]["fc.bias"].double(), bn, atol=1e-7, rtol=1e-5)
    assert set(uploads) == {"grad", "num_samples"}
    torch.testing.assert_close(uploads["num_samples"].double(), torch.as_tensor(n))


# ----- the engine: what crosses, and both executors in float64 ---------------------------------
def test_theta_never_crosses_to_the_server(fed_data):
    algo = make_algo("pfedkdwcl", model="mlp", local_steps=2)
    crossed = []
    real = algo.aggregate

    def spy(server, uploads, clients, rnd):
        crossed.append(uploads)
        return real(server, uploads, clients, rnd)

    algo.aggregate = spy
    res = _engine(fed_data, algo, participation=0.6, model="mlp").run()
    thetas = tree_leaves(res.client_states)
    trainable = [algo.forward.shapes[k] for k in algo.forward.trainable]
    per_client = sum(math.prod(s) for s in trainable) * 4 + 4  # float32 gradient + n
    for r, up in enumerate(crossed):
        assert set(up) == {"grad", "num_samples"} and set(up["grad"]) == set(algo.forward.trainable)
        assert payload_nbytes(up) == res.rounds["bytes_up"].iloc[r] == 3 * per_client
        for leaf in tree_leaves(up["grad"]):
            for t in thetas:
                if t.shape[1:] == leaf.shape[1:]:
                    for row in leaf:
                        assert not any(torch.allclose(row, t[i]) for i in range(t.shape[0]))


def test_stacked_equals_sequential_in_float64_with_the_defaults(fed_data, monkeypatch):
    """In float32 the two executors drift apart by up to ~1e-4 over the default 2 x 20 steps from a
    random theta on the CNN (summation-order noise amplified through max-pool/ReLU switches; the
    contract's state tolerance allows for it); in float64 they agree to rounding: the same
    program, batches, theta draws, KL-gradient pass and server step (mlp: fast in float64)."""
    monkeypatch.setattr(FederatedData, "x", lambda self, idx: self.images[idx].to(torch.float64) / 127.5 - 1.0)
    real_init = Engine.initial_params
    monkeypatch.setattr(Engine, "initial_params", lambda self: {k: v.double() for k, v in real_init(self).items()})
    out = {}
    for kind in ("sequential", "stacked"):
        t = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, model="mlp")
        out[kind] = Engine(make_algo("pfedkdwcl", model="mlp"), fed_data, t, EvalConfig(), seed=1,
                           executor_kind=kind).run()
    seq, stk = out["sequential"], out["stacked"]
    assert seq.client_states["theta"]["fc1.weight"].dtype == torch.float64
    assert_trees_close(seq.server, stk.server, atol=1e-12, rtol=1e-10)
    assert_trees_close(seq.client_states, stk.client_states, atol=1e-12, rtol=1e-10)
    cols = ["round", "view", "client_id", "accuracy"]
    assert seq.records[cols].equals(stk.records[cols])
    torch.testing.assert_close(torch.tensor(seq.records["loss"].to_numpy()),
                               torch.tensor(stk.records["loss"].to_numpy()), atol=1e-10, rtol=1e-10)
    # the global model moved (the server step), and every sampled theta moved away from its draw
    w0 = Engine(make_algo("pfedkdwcl", model="mlp"), fed_data, TrainConfig(model="mlp"), EvalConfig(),
                seed=1).initial_params()
    assert (seq.server["model"]["fc1.weight"] - w0["fc1.weight"]).abs().max() > 1e-6


def test_download_is_the_global_model_only():
    algo = linear_algo("pfedkdwcl", D, C)
    w = lin([[1.0, 0.0]] * 3, [0.0] * 3)
    down = algo.download({"model": w}, torch.tensor([0, 1]), RND)
    assert isinstance(down, Download) and down.shared == {"model": w} and not down.per_client
