"""Per-FedAvg (FO) (Fallah et al., NeurIPS 2020, eq. 10 without the Hessian term): one local step
on a pair of batches, checked against the closed-form gradient of softmax regression; the split
of a short batch is the same in the sequential and the stacked (padded) form; the evaluation-time
adaptation is a step at alpha then a step at beta."""

import numpy as np
import torch

from medpfl.config import TrainConfig
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.optim import sgd
from medpfl.fl.program import RoundInfo, phase_plan
from medpfl.algorithms.perfedavg import first_order_maml_loss
from tests.linear_model import as_np, ce_grad, linear_algo, random_params

D_IN, C = 3 * 28 * 28, 4
B = 8


def _setup(fed_data, **cfg):
    algo = linear_algo("perfedavg", D_IN, C, **cfg)
    train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=B,
                        optimizer={"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0})
    ex = SequentialExecutor(fed_data, train, seed=1, eval_batch_size=64)
    rnd = RoundInfo(round=0, rounds=1, lr=0.05, num_clients=fed_data.num_clients, seed=1, base_lr=0.05, batch_size=B)
    return algo, ex, rnd


def _xy(fed_data, ids):
    return fed_data.x(ids).double().flatten(1).numpy(), fed_data.labels[ids].numpy()


def test_local_steps_are_first_order_maml_on_batch_pairs(fed_data):
    alpha, beta = 0.05, 0.5  # beta large enough that the step is far above float noise
    algo, ex, rnd = _setup(fed_data, beta=beta, local_steps=2)
    w0 = random_params(D_IN, C, seed=1)
    up, _, _ = ex.run_client(algo, {"model": w0}, {}, {}, 0, rnd)
    ids = fed_data.client_train[0]
    plan = phase_plan(len(ids), 2 * B, 1, 1, 0, 0, algo.phases(rnd)[0])
    W, b = as_np(w0)
    for step in range(2):
        pos = plan[step]
        x1, y1 = _xy(fed_data, ids[pos[:B]])
        x2, y2 = _xy(fed_data, ids[pos[B:]])
        gW, gb = ce_grad(W, b, x1, y1)
        Wt, bt = W - alpha * gW, b - alpha * gb
        hW, hb = ce_grad(Wt, bt, x2, y2)  # first order: the gradient at the adapted point
        W, b = W - beta * hW, b - beta * hb
    got_W, got_b = as_np(up["model"])
    np.testing.assert_allclose(got_W, W, atol=2e-6)
    np.testing.assert_allclose(got_b, b, atol=2e-6)
    assert np.abs(W - as_np(w0)[0]).max() > 1e-3  # the steps moved the model


def test_short_batch_splits_alike_exact_and_padded():
    """5 valid samples with b = 4: D = first 4, D' = the fifth, whether the batch comes exact
    (sequential executor) or padded to 2b with w = 0 (stacked executor)."""
    algo = linear_algo("perfedavg", 6, 3)
    g = torch.Generator().manual_seed(0)
    params = {k: v.double().requires_grad_() for k, v in random_params(6, 3, seed=2).items()}
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 2, 2])
    loss = first_order_maml_loss(algo, 0.3, 4)
    exact = {"x": x[:5], "y": y[:5], "w": torch.full((5,), 0.2, dtype=torch.float64)}
    w = torch.zeros(8, dtype=torch.float64)
    w[:5] = 0.2
    padded = {"x": x, "y": y, "w": w}
    le = loss({"model": params}, {}, exact)
    lp = loss({"model": params}, {}, padded)
    ge = torch.autograd.grad(le, list(params.values()))
    gp = torch.autograd.grad(lp, list(params.values()))
    torch.testing.assert_close(le, lp)
    for a, b_ in zip(ge, gp):
        torch.testing.assert_close(a, b_)
    # and equals the closed form: inner step on samples 0..3, outer gradient on sample 4
    W, bb = as_np(params)
    gW, gb = ce_grad(W, bb, x[:4].numpy(), y[:4].numpy())
    hW, hb = ce_grad(W - 0.3 * gW, bb - 0.3 * gb, x[4:5].numpy(), y[4:5].numpy())
    np.testing.assert_allclose(ge[0].numpy(), hW, atol=1e-12)
    np.testing.assert_allclose(ge[1].numpy(), hb, atol=1e-12)


def test_evaluation_adapts_with_alpha_then_beta(fed_data):
    algo, ex, rnd = _setup(fed_data, beta=0.3)
    phases = algo.adaptation_phases(rnd)
    assert [(p.steps, p.optimizer) for p in phases] == [(1, sgd(0.05)), (1, sgd(0.3))]  # plain SGD at alpha, beta
    assert phases[0].name != phases[1].name  # two different batches (orders keyed by the name)
    assert linear_algo("perfedavg", D_IN, C, adapt_at_eval=False).adaptation_phases(rnd) == []
    w = random_params(D_IN, C, seed=4)
    assert algo.personalized_model({}, {"model": w}) is w  # adapted from the global model
