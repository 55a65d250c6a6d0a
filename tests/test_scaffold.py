"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II): the corrected local
gradient, the option-II control variate on a hand case and as the mean local gradient along the
path, the server update, what crosses, and the invariant c = mean of all clients' c_i on both
executors."""

import math

import pytest
import torch
import torch.nn.functional as F

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.optim import sgd
from medpfl.fl.payload import check_upload, payload_nbytes
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, initial_params, make_algo, phase_chains

RND = RoundInfo(round=0, rounds=1, lr=0.05, num_clients=5, seed=1, base_lr=0.05)


def _vec_algo(**kw):
    """SCAFFOLD on a linear model of 2 inputs, 2 classes (``mlr``): classifier.weight [2, 2],
    classifier.bias [2]."""
    return make_algo("scaffold", num_classes=2, model="mlr", in_channels=2, image_size=None, **kw)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_defaults():
    algo = make_algo("scaffold")
    cfg = algo.cfg
    assert (cfg.server_lr, cfg.weighting, cfg.momentum, cfg.weight_decay, cfg.control_variates) == \
        (1.0, "uniform", 0.0, 0.0, True)
    (ph,) = algo.phases(RND)
    assert ph.name == "train" and dict(ph.trainable) == {"model": None}
    assert phase_chains(ph, RND.lr) == {"model": sgd(RND.lr)}  # plain SGD at the round's lr on an SGD run
    run_opt = make_algo("scaffold", momentum=None, weight_decay=None).phases(RND)[0]
    assert phase_chains(run_opt, RND.lr) == {"model": sgd(RND.lr, 0.9, 1e-5)}  # None: the run's optimizer


def test_corrected_gradient_is_ce_gradient_plus_c_minus_ci():
    """d/dy [CE(y) + sum <c - c_i, y>] = grad CE(y) + (c - c_i): Alg. 1 line 10's direction (float64)."""
    algo = make_algo("scaffold")
    x = {k: v.double() for k, v in initial_params(seed=0).items()}
    gen = torch.Generator().manual_seed(5)
    c = {k: 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}
    ci = {k: 0.1 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}
    trees, ctx = algo.begin({"model": x, "c": c}, {"c": ci}, {}, RND)
    for k in x:
        torch.testing.assert_close(ctx["corr"][k], c[k] - ci[k], atol=0, rtol=0)
    y = {k: v.clone().requires_grad_() for k, v in trees["model"].items()}
    torch.manual_seed(3)
    batch = {"x": torch.randn(4, 3, 28, 28, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 3]),
             "w": torch.full((4,), 0.25, dtype=torch.float64)}
    loss = algo.local_loss({"model": y}, ctx, batch)
    g = torch.autograd.grad(loss, list(y.values()))
    ce = F.cross_entropy(algo.forward(y, batch["x"]), batch["y"])
    g_ce = torch.autograd.grad(ce, list(y.values()))
    for k, a, b in zip(y, g, g_ce):
        torch.testing.assert_close(a, b + c[k] - ci[k], atol=1e-12, rtol=1e-10)


def test_option_ii_control_update_hand_case():
    """c_i+ = c_i - c + (x - y)/(K lr); Δy = y - x; Δc = c_i+ - c_i. K = 4 steps, lr = 0.05:
    (x - y)/(K lr) = (x - y) / 0.2."""
    algo = _vec_algo()
    x = {"classifier.weight": _t([1.0, 0.0], [0.0, 1.0]), "classifier.bias": _t(0.0, 0.0)}
    y = {"classifier.weight": _t([0.6, 0.1], [0.0, 1.2]), "classifier.bias": _t(0.02, -0.04)}
    c = {"classifier.weight": _t([0.1, 0.0], [0.0, 0.0]), "classifier.bias": _t(0.0, 0.5)}
    ci = {"classifier.weight": _t([0.3, 0.0], [0.0, 0.0]), "classifier.bias": _t(0.0, 0.0)}
    info = {"num_samples": torch.tensor(7.0, dtype=torch.float64), "steps": {"train": torch.tensor(4)}}
    ctx = {"x": x, "c": c, "corr": {k: c[k] - ci[k] for k in c}}
    up, state, ev = algo.finish({"model": y}, ctx, {"c": ci}, info, RND)
    # weight[0,0]: 0.3 - 0.1 + (1 - 0.6)/0.2 = 2.2; weight[0,1]: 0 - 0 + (0 - 0.1)/0.2 = -0.5
    # weight[1,1]: (1 - 1.2)/0.2 = -1.0; bias: (0 - 0.02)/0.2 - 0 = -0.1, 0 - 0.5 + 0.04/0.2 = -0.3
    torch.testing.assert_close(state["c"]["classifier.weight"], _t([2.2, -0.5], [0.0, -1.0]))
    torch.testing.assert_close(state["c"]["classifier.bias"], _t(-0.1, -0.3))
    torch.testing.assert_close(up["dc"]["classifier.weight"], _t([1.9, -0.5], [0.0, -1.0]))
    torch.testing.assert_close(up["dc"]["classifier.bias"], _t(-0.1, -0.3))
    torch.testing.assert_close(up["delta"]["classifier.weight"], _t([-0.4, 0.1], [0.0, 0.2]))
    torch.testing.assert_close(up["delta"]["classifier.bias"], _t(0.02, -0.04))
    assert set(up) == set(algo.upload_spec()) == {"delta", "dc", "num_samples"}  # mlr: no buffers
    assert ev is y and up["num_samples"].item() == 7.0


def test_option_ii_is_the_mean_local_gradient_along_the_path():
    """Without momentum, K corrected steps y <- y - lr (g(y) + c - c_i) and option II give
    c_i+ = (1/K) sum_k g(y_k): the corrections cancel (the paper's motivation for option II)."""
    algo = _vec_algo()
    gen = torch.Generator().manual_seed(0)
    x = {"classifier.weight": torch.randn(2, 2, generator=gen, dtype=torch.float64),
         "classifier.bias": torch.randn(2, generator=gen, dtype=torch.float64)}
    c = {k: 0.3 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}
    ci = {k: 0.3 * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in x.items()}
    batches = [{"x": torch.randn(3, 2, generator=gen, dtype=torch.float64), "y": torch.tensor([0, 1, 1]),
                "w": torch.full((3,), 1 / 3, dtype=torch.float64)} for _ in range(5)]
    trees, ctx = algo.begin({"model": x, "c": c}, {"c": ci}, {}, RND)
    ctx = {**algo.shared_context({"model": x, "c": c}, RND), **ctx}
    y = {k: v.clone() for k, v in trees["model"].items()}
    opt = sgd(RND.lr)
    opt_state = opt.init(y)
    ce_grads = []
    for b in batches:
        leaves = {k: v.clone().requires_grad_() for k, v in y.items()}
        ce = F.cross_entropy(algo.forward(leaves, b["x"]), b["y"])
        ce_grads.append([t.detach() for t in torch.autograd.grad(ce, list(leaves.values()))])
        g = dict(zip(leaves, torch.autograd.grad(algo.local_loss({"model": leaves}, ctx, b), list(leaves.values()))))
        opt.step_(y, g, opt_state, count=len(ce_grads))
    info = {"num_samples": torch.tensor(15.0, dtype=torch.float64), "steps": {"train": torch.tensor(len(batches))}}
    _, state, _ = algo.finish({"model": y}, ctx, {"c": ci}, info, RND)
    for j, k in enumerate(y):
        mean_g = sum(gs[j] for gs in ce_grads) / len(batches)
        torch.testing.assert_close(state["c"][k], mean_g, atol=1e-12, rtol=1e-9)


def test_server_update_hand_case():
    """x <- x + eta_g mean(Δy) (uniform) or sum n_i/n Δy_i; c <- c + (m/N) mean(Δc) = c + sum Δc / N."""
    ups = {"delta": {"classifier.weight": torch.stack([_t([1.0, 0.0], [0.0, 0.0]), _t([3.0, 0.0], [0.0, 2.0])]),
                     "classifier.bias": torch.stack([_t(0.0, 1.0), _t(0.0, 3.0)])},
           "dc": {"classifier.weight": torch.stack([_t([1.0, 1.0], [0.0, 0.0]), _t([1.5, 0.0], [0.0, 5.0])]),
                  "classifier.bias": torch.stack([_t(2.0, 0.0), _t(0.5, 0.0)])},
           "num_samples": _t(10.0, 30.0)}
    server = {"model": {"classifier.weight": _t([1.0, 1.0], [1.0, 1.0]), "classifier.bias": _t(0.0, 0.0)},
              "c": {"classifier.weight": _t([0.0, 0.0], [0.0, 1.0]), "classifier.bias": _t(1.0, 1.0)}}
    clients = torch.tensor([0, 3])
    out = _vec_algo(server_lr=0.5).aggregate(server, ups, clients, RND)  # N = 5
    # mean Δy: W [[2, 0], [0, 1]], b [0, 2]; x + 0.5 mean
    torch.testing.assert_close(out["model"]["classifier.weight"], _t([2.0, 1.0], [1.0, 1.5]))
    torch.testing.assert_close(out["model"]["classifier.bias"], _t(0.0, 1.0))
    # sum Δc / 5: W [[0.5, 0.2], [0, 1]], b [0.5, 0]
    torch.testing.assert_close(out["c"]["classifier.weight"], _t([0.5, 0.2], [0.0, 2.0]))
    torch.testing.assert_close(out["c"]["classifier.bias"], _t(1.5, 1.0))
    # size weights 1/4, 3/4 on Δy (eta_g 1): W x + [[2.5, 0], [0, 1.5]], b [0, 2.5]; c as before
    sized = _vec_algo(weighting="num_samples").aggregate(server, ups, clients, RND)
    torch.testing.assert_close(sized["model"]["classifier.weight"], _t([3.5, 1.0], [1.0, 2.5]))
    torch.testing.assert_close(sized["model"]["classifier.bias"], _t(0.0, 2.5))
    assert_trees_close(sized["c"], out["c"], atol=0)


def test_batchnorm_buffers_are_averaged_not_stepped():
    """Buffers cross as they are and the server takes their a_i-weighted mean; eta_g and the
    control variates apply to the parameters only."""
    algo = make_algo("scaffold", model="simplecnn", model_args={"batch_norm": True}, server_lr=2.0)
    bufs = algo.forward.buffers
    assert bufs and "buffers" in algo.upload_spec() and set(algo.upload_spec()["buffers"].shapes) == set(bufs)
    assert not set(bufs) & set(algo.upload_spec()["dc"].shapes)
    torch.manual_seed(0)
    x = {k: torch.randn(s) if k not in bufs or "num_batches" not in k else torch.tensor(3)
         for k, s in algo.forward.shapes.items()}
    server = algo.init_server(x, Federation(5))
    assert set(server["c"]) == set(algo.forward.trainable)
    up = {"delta": {k: torch.ones(2, *algo.forward.shapes[k]) for k in algo.forward.trainable},
          "dc": {k: torch.zeros(2, *algo.forward.shapes[k]) for k in algo.forward.trainable},
          "buffers": {k: (torch.stack([torch.full(algo.forward.shapes[k], 1.0), torch.full(algo.forward.shapes[k], 4.0)])
                          if "num_batches" not in k else torch.tensor([4, 8])) for k in bufs},
          "num_samples": torch.tensor([1.0, 1.0])}
    out = algo.aggregate(server, up, torch.tensor([1, 2]), RND)
    for k in bufs:
        want = torch.tensor(6) if "num_batches" in k else torch.full(algo.forward.shapes[k], 2.5)
        torch.testing.assert_close(out["model"][k], want)
    for k in algo.forward.trainable:
        torch.testing.assert_close(out["model"][k], x[k] + 2.0)


def test_without_control_variates_nothing_extra_is_kept_or_sent():
    algo = make_algo("scaffold", control_variates=False)
    p = initial_params(seed=0)
    assert set(algo.init_server(p, Federation(5))) == {"model"} and algo.init_client_state(p, 0, Federation(5)) == {}
    assert set(algo.upload_spec()) == {"delta", "num_samples"}
    assert set(algo.download(algo.init_server(p, Federation(5)), torch.tensor([0]), RND).shared) == {"model"}


def _engine(algo, fed_data, executor, rounds=3):
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor).run()


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_engine_keeps_c_the_mean_of_all_clients_variates(fed_data, executor):
    """c starts at 0 = mean c_i and each round adds sum_S Δc_i / N, so c = (1/N) sum_i c_i
    every round (the paper's invariant); the sampled clients' c_i moved, the others' are 0. The
    bytes: up Δy + Δc + n per sampled client, down x + c."""
    algo = make_algo("scaffold")
    res = _engine(algo, fed_data, executor)
    cs = res.client_states["c"]
    k_all = fed_data.num_clients
    for name, c in res.server["c"].items():
        assert c.abs().max() > 0
        torch.testing.assert_close(c, cs[name].mean(0), atol=1e-6, rtol=1e-5)
    trained = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    w = cs["classifier.weight"]
    for c in range(k_all):
        assert (w[c].abs().max() > 0) == (c in trained)
    nparam = sum(math.prod(algo.forward.shapes[k]) for k in algo.forward.trainable)
    nmodel = sum(math.prod(s) for s in algo.forward.shapes.values())
    m = res.rounds["num_sampled"]
    assert res.rounds["bytes_up"].tolist() == (m * (2 * nparam * 4 + 4)).tolist()  # float32 Δy, Δc; n
    assert res.rounds["bytes_down"].tolist() == (m * (nmodel + nparam) * 4).tolist()


def test_uploads_pass_the_check_and_match_the_byte_count(fed_data):
    algo = make_algo("scaffold")
    crossed = []
    real = algo.aggregate

    def spy(server, uploads, clients, rnd):
        crossed.append(uploads)
        return real(server, uploads, clients, rnd)

    algo.aggregate = spy
    res = _engine(algo, fed_data, "sequential", rounds=2)
    for r, up in enumerate(crossed):
        check_upload("scaffold", algo.upload_spec(), up, 3)
        assert payload_nbytes(up) == res.rounds["bytes_up"].iloc[r]
