"""FedNTD's not-true distillation (Lee et al., NeurIPS 2022, eq. 3-4) on hand-computed cases."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedntd import not_true_logits, ntd_loss
from medpfl.fl.program import RoundInfo
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=2, seed=1, base_lr=0.01)


def test_not_true_logits_drops_exactly_the_true_column():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0],
                           [10.0, 11.0, 12.0, 13.0],
                           [20.0, 21.0, 22.0, 23.0],
                           [30.0, 31.0, 32.0, 33.0]])
    y = torch.tensor([0, 2, 3, 1])
    expected = torch.tensor([[1.0, 2.0, 3.0],
                             [10.0, 11.0, 13.0],
                             [20.0, 21.0, 22.0],
                             [30.0, 32.0, 33.0]])
    assert torch.equal(not_true_logits(logits, y), expected)


def _np_softmax(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


CASE = {
    "logits": np.array([[2.0, -1.0, 0.5, 1.0], [0.0, 3.0, -2.0, 1.0], [1.0, 1.0, 4.0, -1.0]]),
    "global": np.array([[0.0, 1.0, -1.0, 2.0], [1.0, 0.0, 0.5, -0.5], [9.0, -9.0, 0.0, 5.0]]),
    "y": np.array([0, 1, 2]),
}


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_ntd_loss_is_tau2_kl_over_not_true_softmax_with_padding_ignored(tau):
    lg, gl, y = CASE["logits"], CASE["global"], CASE["y"]
    w = np.array([0.5, 0.5, 0.0])  # third sample is padding
    keep = [[1, 2, 3], [0, 2, 3]]  # not-true columns of samples 0 and 1 (hand-chosen)
    kl = []
    for i in range(2):
        q_g = _np_softmax(gl[i, keep[i]][None] / tau)[0]
        q_l = _np_softmax(lg[i, keep[i]][None] / tau)[0]
        kl.append(np.sum(q_g * (np.log(q_g) - np.log(q_l))))
    expected = tau**2 * (0.5 * kl[0] + 0.5 * kl[1])
    got = ntd_loss(torch.tensor(lg), torch.tensor(gl), torch.tensor(y), torch.tensor(w), tau)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    assert expected > 1e-3
    # equals tau^2 * torch KLDivLoss(batchmean) on the gathered columns of the valid samples
    lt = torch.tensor(np.stack([lg[i, keep[i]] for i in range(2)]))
    gt = torch.tensor(np.stack([gl[i, keep[i]] for i in range(2)]))
    kld = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(lt / tau, 1), F.softmax(gt / tau, 1))
    assert got.item() == pytest.approx(tau**2 * kld.item(), rel=1e-9)


def test_ntd_loss_ignores_the_true_class_logit_entirely():
    logits = torch.tensor(CASE["logits"], requires_grad=True)
    glob = torch.tensor(CASE["global"], requires_grad=True)
    y = torch.tensor(CASE["y"])
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    loss = ntd_loss(logits, glob, y, w, 1.0)
    g, gg = torch.autograd.grad(loss, [logits, glob], allow_unused=True)
    assert gg is None  # no gradient into the global model's logits
    rows = torch.arange(3)
    assert torch.all(g[rows, y] == 0)
    mask = torch.ones_like(g, dtype=torch.bool)
    mask[rows, y] = False
    assert g[mask].abs().sum() > 0
    # changing the true-class logits of either model changes nothing
    l2, g2 = logits.detach().clone(), glob.detach().clone()
    l2[rows, y] += torch.tensor([5.0, -7.0, 3.0], dtype=torch.float64)
    g2[rows, y] -= 4.0
    assert ntd_loss(l2, g2, y, w, 1.0).item() == pytest.approx(loss.item(), rel=1e-12)


def test_ntd_loss_is_zero_when_global_logits_equal_local_logits():
    logits = torch.tensor(CASE["logits"])
    y = torch.tensor(CASE["y"])
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    assert ntd_loss(logits, logits.clone(), y, w, 1.0).item() == pytest.approx(0.0, abs=1e-12)
    # also when only the true-class logits differ
    other = logits.clone()
    other[torch.arange(3), y] = torch.tensor([-50.0, 50.0, 0.0], dtype=torch.float64)
    assert ntd_loss(logits, other, y, w, 2.0).item() == pytest.approx(0.0, abs=1e-12)


def test_defaults():
    algo = make_algo("fedntd")
    assert algo.cfg.tau == 1.0 and algo.cfg.beta == 1.0


def test_zero_beta_trains_as_fedavg(fed_data):
    """beta = 0 (FedNTD's ``fedavg_when``): two engine rounds give FedAvg's records and global model."""
    from tests.test_contract import assert_trains_as_fedavg

    assert_trains_as_fedavg(fed_data, "fedntd", beta=0.0)


def _batch(algo, glob, n=6, pad=2):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, 28, 28, generator=g)
    y = torch.tensor([0, 1, 2, 3, 1, 2])[:n]
    w = torch.cat([torch.full((n - pad,), 1.0 / (n - pad)), torch.zeros(pad)])
    ctx = algo.shared_context({"model": glob}, RND)
    assert ctx["global"] is glob
    return ctx, {"x": x, "y": y, "w": w, **algo.sample_context(ctx, x)}


def test_local_loss_is_plain_ce_when_beta_is_zero():
    algo = make_algo("fedntd", beta=0.0)
    p, glob = initial_params(seed=0), initial_params(seed=1)
    ctx, batch = _batch(algo, glob)
    ce = F.cross_entropy(algo.forward(p, batch["x"][:4]), batch["y"][:4])
    assert algo.local_loss({"model": p}, ctx, batch).item() == pytest.approx(ce.item(), abs=1e-6)


def test_local_loss_is_ce_plus_beta_ntd_on_global_logits():
    beta, tau = 0.5, 2.0
    algo = make_algo("fedntd", beta=beta, tau=tau)
    p, glob = initial_params(seed=0), initial_params(seed=1)
    ctx, batch = _batch(algo, glob)
    torch.testing.assert_close(batch["global_logits"], algo.forward(glob, batch["x"]))
    lg = algo.forward(p, batch["x"]).detach().double().numpy()[:4]
    gl = batch["global_logits"].double().numpy()[:4]
    y = batch["y"].numpy()[:4]
    kl = []
    for i in range(4):
        keep = [c for c in range(4) if c != y[i]]
        q_g = _np_softmax(gl[i, keep][None] / tau)[0]
        q_l = _np_softmax(lg[i, keep][None] / tau)[0]
        kl.append(np.sum(q_g * np.log(q_g / q_l)))
    ce = F.cross_entropy(algo.forward(p, batch["x"][:4]), batch["y"][:4]).item()
    loss = algo.local_loss({"model": p}, ctx, batch).item()
    assert loss == pytest.approx(ce + beta * tau**2 * np.mean(kl), rel=1e-5)
    assert loss - ce == pytest.approx(beta * tau**2 * np.mean(kl), rel=1e-3)  # the term alone, about 1.5e-3
    assert beta * tau**2 * np.mean(kl) > 1e-4
    # the local model distilled from itself: the term vanishes
    ctx_self, batch_self = _batch(algo, p)
    assert algo.local_loss({"model": p}, ctx_self, batch_self).item() == pytest.approx(ce, abs=1e-6)
