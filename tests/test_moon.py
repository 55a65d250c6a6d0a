"""MOON's model-contrastive term (Li, He & Song, CVPR 2021, eq. 1-3) on hand-computed cases."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.moon import contrastive_loss
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=2, seed=1, base_lr=0.01)


def _l_con(a, b, tau):
    """-log(exp(a/tau) / (exp(a/tau) + exp(b/tau))) for cosines a (positive) and b (negative)."""
    return -math.log(math.exp(a / tau) / (math.exp(a / tau) + math.exp(b / tau)))


def _batch(n=6, pad=0, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 28, 28, generator=g)
    y = torch.arange(n) % 4
    w = torch.cat([torch.full((n - pad,), 1.0 / (n - pad)), torch.zeros(pad)])
    return {"x": x, "y": y, "w": w}


def test_contrastive_loss_hand_computed_cosines_weights_and_padding():
    # sample 0: cos(z, z_glob) = 1/sqrt(2), cos(z, z_prev) = 0
    # sample 1: z_glob parallel to z (cos 1, whatever the norm), z_prev anti-parallel (cos -1)
    # sample 2: cos(z, z_glob) = 0, cos(z, z_prev) = 3/5 (the negative is closer)
    # sample 3: padding, with features that would give a large loss
    z = torch.tensor([[1.0, 0.0], [3.0, 4.0], [2.0, 0.0], [1.0, 0.0]])
    z_glob = torch.tensor([[1.0, 1.0], [6.0, 8.0], [0.0, 5.0], [-1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 2.0], [-3.0, -4.0], [3.0, 4.0], [1.0, 0.0]])
    w = torch.tensor([0.5, 0.25, 0.25, 0.0])
    tau = 0.5
    expected = (0.5 * _l_con(1 / math.sqrt(2), 0.0, tau) + 0.25 * _l_con(1.0, -1.0, tau)
                + 0.25 * _l_con(0.0, 0.6, tau))
    got = contrastive_loss(z, z_glob, z_prev, w, tau)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # hand values of the three terms: log(1 + exp((b - a) / tau))
    assert _l_con(1.0, -1.0, tau) == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-12)
    # padding ignored: changing the padded row changes nothing
    z2, zg2, zp2 = z.clone(), z_glob.clone(), z_prev.clone()
    z2[3], zg2[3], zp2[3] = torch.tensor([0.0, 7.0]), torch.tensor([9.0, -1.0]), torch.tensor([0.0, 3.0])
    assert contrastive_loss(z2, zg2, zp2, w, tau).item() == pytest.approx(expected, rel=1e-6)
    # a different temperature gives the hand value at that temperature
    expected_1 = (0.5 * _l_con(1 / math.sqrt(2), 0.0, 1.0) + 0.25 * _l_con(1.0, -1.0, 1.0)
                  + 0.25 * _l_con(0.0, 0.6, 1.0))
    assert contrastive_loss(z, z_glob, z_prev, w, 1.0).item() == pytest.approx(expected_1, rel=1e-6)


def test_contrastive_loss_equal_positive_and_negative_is_log2():
    z = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]])
    other = torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([0.5, 0.5])
    assert contrastive_loss(z, other, other, w, 0.5).item() == pytest.approx(math.log(2), rel=1e-6)


def test_no_gradient_into_global_and_previous_features():
    z = torch.tensor([[1.0, 0.0], [3.0, 4.0]], requires_grad=True)
    z_glob = torch.tensor([[1.0, 1.0], [6.0, 8.0]], requires_grad=True)
    z_prev = torch.tensor([[0.0, 2.0], [-4.0, 3.0]], requires_grad=True)
    w = torch.tensor([0.5, 0.5])
    loss = contrastive_loss(z, z_glob, z_prev, w, 0.5)
    gz, gg, gp = torch.autograd.grad(loss, [z, z_glob, z_prev], allow_unused=True)
    assert gg is None and gp is None
    assert gz.abs().sum() > 0
    # sample 0: z = e1, z_glob = (1,1)/sqrt2, z_prev = e2. d l/d z = -(1 - p)/tau * (d pos - d neg) with
    # p = softmax([a, b]/tau)[0]; d cos(z, v)/d z at z = e1 is v_hat - cos * e1.
    tau, a, b = 0.5, 1 / math.sqrt(2), 0.0
    p = math.exp(a / tau) / (math.exp(a / tau) + math.exp(b / tau))
    d_pos = np.array([1 / math.sqrt(2), 1 / math.sqrt(2)]) - a * np.array([1.0, 0.0])
    d_neg = np.array([0.0, 1.0])
    expected = 0.5 * (-(1 - p) / tau) * (d_pos - d_neg)
    np.testing.assert_allclose(gz[0].numpy(), expected, rtol=1e-5, atol=1e-7)


def test_defaults_are_the_papers():
    algo = make_algo("moon")
    assert algo.cfg.mu == 5.0 and algo.cfg.tau == 0.5


def test_zero_mu_trains_as_fedavg(fed_data):
    """mu = 0 (the paper's knob; MOON's ``fedavg_when``): two engine rounds give FedAvg's records and
    global model."""
    from tests.test_contract import assert_trains_as_fedavg

    assert_trains_as_fedavg(fed_data, "moon", mu=0.0)


def _context(algo, glob, prev, batch):
    state = algo.init_client_state(prev, 0, Federation(5))
    trees, ctx = algo.begin({"model": glob}, state, {}, RND)
    ctx = {**algo.shared_context({"model": glob}, RND), **ctx}
    return trees, ctx, {**batch, **algo.sample_context(ctx, batch["x"])}


def test_local_loss_is_ce_when_mu_is_zero():
    algo = make_algo("moon", mu=0.0)
    p, glob, prev = initial_params(seed=0), initial_params(seed=1), initial_params(seed=2)
    batch = _batch(6, pad=2)
    _, ctx, batch = _context(algo, glob, prev, batch)
    loss = algo.local_loss({"model": p}, ctx, batch)
    ce = F.cross_entropy(algo.forward(p, batch["x"][:4]), batch["y"][:4])
    assert loss.item() == pytest.approx(ce.item(), abs=1e-6)


def test_local_loss_adds_mu_times_contrastive_term_of_penultimate_features():
    mu, tau = 2.0, 0.5
    algo = make_algo("moon", mu=mu, tau=tau)
    p, glob, prev = initial_params(seed=0), initial_params(seed=1), initial_params(seed=2)
    batch = _batch(5, pad=1)
    _, ctx, batch = _context(algo, glob, prev, batch)
    # the sample context holds the frozen global and previous models' 512-d features
    zg, _ = algo.forward.features_logits(glob, batch["x"])
    zp, _ = algo.forward.features_logits(prev, batch["x"])
    assert batch["z_glob"].shape == (5, 512)
    torch.testing.assert_close(batch["z_glob"], zg)
    torch.testing.assert_close(batch["z_prev"], zp)
    # numpy reference on the 4 valid samples: mean of log(1 + exp((cos_prev - cos_glob) / tau))
    z = algo.forward.features_logits(p, batch["x"])[0].detach().double().numpy()[:4]
    zg, zp = zg.double().numpy()[:4], zp.double().numpy()[:4]

    def cos(a, b):
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    l_con = np.mean(np.log1p(np.exp((cos(z, zp) - cos(z, zg)) / tau)))
    ce = F.cross_entropy(algo.forward(p, batch["x"][:4]), batch["y"][:4]).item()
    loss = algo.local_loss({"model": p}, ctx, batch).item()
    assert loss == pytest.approx(ce + mu * l_con, rel=1e-5)
    assert mu * l_con > 1e-3  # the term is really there


def test_first_visit_previous_model_is_initial_model_so_term_is_log2():
    algo = make_algo("moon")  # mu = 5
    p, glob = initial_params(seed=0), initial_params(seed=1)
    batch = _batch(4)
    _, ctx, batch = _context(algo, glob, glob, batch)  # prev = the initial global model
    ce = F.cross_entropy(algo.forward(p, batch["x"]), batch["y"]).item()
    assert algo.local_loss({"model": p}, ctx, batch).item() == pytest.approx(ce + 5.0 * math.log(2), rel=1e-5)


def test_init_state_begin_and_finish_keep_the_trained_model_as_prev():
    algo = make_algo("moon")
    init, glob, trained = initial_params(seed=0), initial_params(seed=1), initial_params(seed=2)
    state = algo.init_client_state(init, 3, Federation(5))
    assert_trees_close(state["prev"], init, atol=0)
    assert state["prev"]["fc.weight"] is not init["fc.weight"]  # a copy, not an alias
    trees, ctx = algo.begin({"model": glob}, state, {}, RND)
    assert trees["model"] is glob and ctx["prev"] is state["prev"]
    assert algo.shared_context({"model": glob}, RND)["global"] is glob
    info = {"num_samples": torch.tensor(12.0)}
    up, new_state, model = algo.finish({"model": trained}, ctx, state, info, RND)
    assert set(new_state) == {"prev"}
    assert_trees_close(new_state["prev"], trained, atol=0)
    assert model is trained and up["model"] is trained
    assert up["num_samples"].item() == 12.0
    assert set(up) == set(algo.upload_spec())
