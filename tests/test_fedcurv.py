"""FedCurv's curvature penalty, per-client sums and Fisher diagonal (Shoham et al., 2019, Sec. 3)
on hand-computed cases."""

import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedcurv import curvature_penalty
from medpfl.fl.program import RoundInfo
from medpfl.models import build_model
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=3, seed=1, base_lr=0.01)


def test_curvature_penalty_hand_computed_two_clients():
    # two other clients j = 1, 2 with models w_j and Fisher diagonals u_j; two leaves a, b
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]]), "buf": torch.tensor([9.0])}
    w1 = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([[1.0]])}
    u1 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[2.0]])}
    w2 = {"a": torch.tensor([2.0, -1.0]), "b": torch.tensor([[0.0]])}
    u2 = {"a": torch.tensor([3.0, 0.5]), "b": torch.tensor([[1.0]])}
    P = {k: u1[k] + u2[k] for k in u1}  # a: [4, 2.5], b: [[3]]
    Q = {k: u1[k] * w1[k] + u2[k] * w2[k] for k in u1}  # a: [6, 1.5], b: [[2]]
    # sum_j (w - w_j)^T diag(u_j) (w - w_j):
    #   a: j1 1*1 + 2*1 = 3, j2 3*1 + 0.5*9 = 7.5;  b: j1 2*0.25 = 0.5, j2 1*0.25 = 0.25  -> 11.25
    # constant sum_j w_j^T diag(u_j) w_j:  a: j1 2, j2 12.5;  b: j1 2, j2 0  -> 16.5
    assert curvature_penalty(w, P, Q).item() == pytest.approx(11.25 - 16.5, abs=1e-6)
    # the same through the definition, computed generically (leaf "buf", absent from P, is ignored)
    quad = sum(torch.sum(u[k] * (w[k] - wj[k]) ** 2) for u, wj in ((u1, w1), (u2, w2)) for k in u1)
    const = sum(torch.sum(u[k] * wj[k] ** 2) for u, wj in ((u1, w1), (u2, w2)) for k in u1)
    assert quad.item() == pytest.approx(11.25) and const.item() == pytest.approx(16.5)


def test_curvature_penalty_gradient_pulls_towards_other_clients():
    w = {"a": torch.tensor([1.0, 2.0], requires_grad=True)}
    u1, w1 = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])
    u2, w2 = torch.tensor([3.0, 0.5]), torch.tensor([2.0, -1.0])
    pen = curvature_penalty(w, {"a": u1 + u2}, {"a": u1 * w1 + u2 * w2})
    (g,) = torch.autograd.grad(pen, [w["a"]])
    # d/dw sum_j u_j (w - w_j)^2 = 2 sum_j u_j (w - w_j): [2(1*1 + 3*(-1)), 2(2*1 + 0.5*3)] = [-4, 7]
    torch.testing.assert_close(g, torch.tensor([-4.0, 7.0]))


def _server_with_rows(algo, params, k=3):
    server = algo.init_server(params, Federation(k))
    for n in algo.forward.trainable:
        assert server["u"][n].shape == (k, *params[n].shape)
        assert torch.all(server["u"][n] == 0) and torch.all(server["v"][n] == 0)
        for j in range(k):
            server["u"][n][j] = float(j + 1)  # u rows 1, 2, 3
            server["v"][n][j] = float(10**j)  # v rows 1, 10, 100
    return server


def test_download_gives_each_client_the_sums_over_the_others_without_aliasing():
    algo = make_algo("fedcurv")
    params = initial_params()
    server = _server_with_rows(algo, params)
    d = algo.download(server, torch.tensor([0, 2]), RND)
    assert d.shared["model"] is server["model"]
    assert set(d.per_client) == {"P", "Q"}
    assert set(d.per_client["P"]) == set(algo.forward.trainable)
    for n in algo.forward.trainable:
        P, Q = d.per_client["P"][n], d.per_client["Q"][n]
        assert P.shape == (2, *params[n].shape) and Q.shape == (2, *params[n].shape)
        # client 0: others are 1 and 2 -> P = 2 + 3, Q = 10 + 100
        assert torch.all(P[0] == 5.0) and torch.all(Q[0] == 110.0)
        # client 2: others are 0 and 1 -> P = 1 + 2, Q = 1 + 10 (an in-place subtraction from shared
        # sums, as in the FedNTD code, would also have removed client 0's terms: 2 and 10)
        assert torch.all(P[1] == 3.0) and torch.all(Q[1] == 11.0)
        # the server state is not touched
        assert torch.all(server["u"][n][0] == 1.0) and torch.all(server["v"][n][2] == 100.0)
    # all three sampled, in another order
    d = algo.download(server, torch.tensor([1, 2, 0]), RND)
    n = "classifier.weight"
    assert torch.all(d.per_client["P"][n][0] == 4.0) and torch.all(d.per_client["Q"][n][0] == 101.0)
    assert torch.all(d.per_client["P"][n][1] == 3.0) and torch.all(d.per_client["Q"][n][1] == 11.0)
    assert torch.all(d.per_client["P"][n][2] == 5.0) and torch.all(d.per_client["Q"][n][2] == 110.0)


def test_download_with_one_client_only_is_zero():
    algo = make_algo("fedcurv")
    params = initial_params()
    server = algo.init_server(params, Federation(2))
    n = "classifier.bias"
    server["u"][n][0], server["v"][n][0] = 4.0, 8.0
    d = algo.download(server, torch.tensor([0]), RND)
    assert torch.all(d.per_client["P"][n] == 0) and torch.all(d.per_client["Q"][n] == 0)
    d = algo.download(server, torch.tensor([1]), RND)
    assert torch.all(d.per_client["P"][n] == 4.0) and torch.all(d.per_client["Q"][n] == 8.0)


def test_aggregate_stores_fisher_rows_and_fisher_times_model():
    algo = make_algo("fedcurv")
    params = initial_params()
    server = _server_with_rows(algo, params)
    m_a = {k: torch.full_like(v, 2.0) for k, v in params.items()}
    m_b = {k: torch.full_like(v, -1.0) for k, v in params.items()}
    f_a = {k: torch.full_like(params[k], 0.5) for k in algo.forward.trainable}
    f_b = {k: torch.full_like(params[k], 3.0) for k in algo.forward.trainable}
    uploads = {"model": {k: torch.stack([m_a[k], m_b[k]]) for k in params},
               "fisher": {k: torch.stack([f_a[k], f_b[k]]) for k in f_a},
               "num_samples": torch.tensor([30.0, 10.0])}
    clients = torch.tensor([2, 0])  # first upload from client 2, second from client 0
    new = algo.aggregate(server, uploads, clients, RND)
    for n in algo.forward.trainable:
        assert torch.all(new["u"][n][2] == 0.5) and torch.all(new["u"][n][0] == 3.0)
        assert torch.all(new["v"][n][2] == 0.5 * 2.0) and torch.all(new["v"][n][0] == 3.0 * -1.0)
        assert torch.all(new["u"][n][1] == 2.0) and torch.all(new["v"][n][1] == 10.0)  # unsampled: kept
        # FedAvg of the models: 0.75 * 2 + 0.25 * (-1) = 1.25
        torch.testing.assert_close(new["model"][n], torch.full_like(params[n], 1.25))
        assert torch.all(server["u"][n][2] == 3.0)  # the old state is not modified
    # next round's download to client 1 sees the new rows: P = 3 + 0.5, Q = -3 + 1
    d = algo.download(new, torch.tensor([1]), RND)
    assert torch.all(d.per_client["P"]["fc.bias"] == 3.5) and torch.all(d.per_client["Q"]["fc.bias"] == -2.0)


def test_fisher_pass_is_squared_gradient_of_batch_mean_ce_in_eval_mode():
    algo = make_algo("fedcurv")
    params = initial_params()
    (p,) = algo.passes(RND)
    assert p.name == "fisher" and p.when == "after" and p.batch_size == "train"
    assert p.max_samples == 500 and p.shuffle
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 28, 28, generator=g)
    y = torch.tensor([0, 3, 1, 3, 2])
    w = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])  # last sample is padding
    out = p.fn({"model": params}, {}, {"x": x, "y": y, "w": w})
    assert out["batches"].item() == 1.0
    model = build_model("cnn4", 3, 4, 28)
    model.load_state_dict(params)
    model.eval()
    loss = F.cross_entropy(model(x[:4]), y[:4])
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert set(out["sq"]) == set(names)
    for n, gr in zip(names, grads):
        torch.testing.assert_close(out["sq"][n], gr**2, atol=1e-10, rtol=1e-4)
    assert out["sq"]["classifier.weight"].sum() > 0


def test_finish_averages_squared_gradients_over_batches():
    algo = make_algo("fedcurv")
    params = initial_params()
    sq = {k: torch.full_like(params[k], 6.0) for k in algo.forward.trainable}
    info = {"num_samples": torch.tensor(40.0), "fisher": {"sq": sq, "batches": torch.tensor(3.0)}}
    up, state, model = algo.finish({"model": params}, {}, {"s": 1}, info, RND)
    assert set(up) == set(algo.upload_spec()) == {"model", "fisher", "num_samples"}
    assert all(torch.all(v == 2.0) for v in up["fisher"].values())
    assert up["model"] is params and model is params and state == {"s": 1}


def _batch():
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 3, 28, 28, generator=g), "y": torch.tensor([0, 1, 2, 3]),
            "w": torch.full((4,), 0.25)}


def test_local_loss_is_ce_plus_lam_penalty_and_plain_ce_when_lam_is_zero():
    params = initial_params(seed=0)
    other = initial_params(seed=1)  # one other client j with model w_j and Fisher u_j
    u = {k: torch.full_like(v, 0.3) for k, v in params.items()}
    received = {"model": params, "P": u, "Q": {k: u[k] * other[k] for k in u}}
    batch = _batch()
    a0 = make_algo("fedcurv", lam=0.0)
    ce = F.cross_entropy(a0.forward(params, batch["x"]), batch["y"]).item()
    # lam = 0: FedAvg's loss, whatever P and Q
    trees, ctx = a0.begin(received, {}, {}, RND)
    assert trees["model"] is params and ctx["P"] is u
    assert a0.local_loss(trees, ctx, batch).item() == pytest.approx(ce, abs=1e-6)
    # lam = 2: ce + 2 * (u (w - w_j)^2 - u w_j^2), summed
    a2 = make_algo("fedcurv", lam=2.0)
    trees, ctx = a2.begin(received, {}, {}, RND)
    d = {k: v.double() for k, v in params.items()}
    o = {k: v.double() for k, v in other.items()}
    pen = sum(torch.sum(0.3 * (d[k] - o[k]) ** 2 - 0.3 * o[k] ** 2) for k in u).item()
    got = a2.local_loss(trees, ctx, batch).item()
    assert got - ce == pytest.approx(2.0 * pen, rel=1e-4, abs=1e-5)
    assert abs(pen) > 1.0  # about 61

