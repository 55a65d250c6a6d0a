"""pFedMe (T. Dinh et al., NeurIPS 2020, eq. 7 and Algorithm 1): the K inner steps to theta_hat,
the local model's step toward it, persistence of theta, the server's beta step with uniform
weights over the sampled clients, and every client training while only the sampled are sent."""

import numpy as np
import torch

from medpfl.config import TrainConfig
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.program import RoundInfo, phase_plan
from tests.linear_model import as_np, ce_grad, linear_algo, random_params

D_IN, C = 3 * 28 * 28, 4
B = 8
ETA = 0.05


def _setup(fed_data, **cfg):
    algo = linear_algo("pfedme", D_IN, C, **cfg)
    train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=B,
                        optimizer={"lr": ETA, "momentum": 0.0, "weight_decay": 0.0})
    ex = SequentialExecutor(fed_data, train, seed=1, eval_batch_size=64)
    rnd = RoundInfo(round=0, rounds=1, lr=ETA, num_clients=fed_data.num_clients, seed=1, base_lr=ETA, batch_size=B)
    return algo, ex, rnd


def _hand(fed_data, algo, rnd, theta0, w0, lam, plr, k, steps, client=0, per_round=False):
    """Algorithm 1 of pFedMe written out in numpy: per iteration, K steps of
    theta -= plr (grad f(theta; D) + lam (theta - w)), then w -= eta lam (w - theta);
    ``per_round`` (the pFedKD-WCL code): w stays w^t through the iterations and takes that
    update once, after them."""
    ids = fed_data.client_train[client]
    plan = phase_plan(len(ids), B, 1, 1, 0, client, algo.phases(rnd)[0])
    (tW, tb), (wW, wb) = as_np(theta0), as_np(w0)
    for s in range(steps):
        pos = plan[s][plan[s] >= 0]
        x = fed_data.x(ids[pos]).double().flatten(1).numpy()
        y = fed_data.labels[ids[pos]].numpy()
        for _ in range(k):
            gW, gb = ce_grad(tW, tb, x, y)
            tW, tb = tW - plr * (gW + lam * (tW - wW)), tb - plr * (gb + lam * (tb - wb))
        if not per_round:
            wW, wb = wW - ETA * lam * (wW - tW), wb - ETA * lam * (wb - tb)
    if per_round:
        wW, wb = wW - ETA * lam * (wW - tW), wb - ETA * lam * (wb - tb)
    return (tW, tb), (wW, wb)


def test_local_iterations_match_algorithm_1(fed_data):
    lam, plr, k = 2.0, 0.1, 3
    algo, ex, rnd = _setup(fed_data, lam=lam, personal_lr=plr, inner_steps=k, local_steps=3)
    w0, th0 = random_params(D_IN, C, seed=1), random_params(D_IN, C, seed=2)
    up, state, em = ex.run_client(algo, {"model": w0}, {}, {"theta": th0}, 0, rnd)
    (tW, tb), (wW, wb) = _hand(fed_data, algo, rnd, th0, w0, lam, plr, k, 3)
    np.testing.assert_allclose(as_np(state["theta"])[0], tW, atol=2e-6)
    np.testing.assert_allclose(as_np(state["theta"])[1], tb, atol=2e-6)
    np.testing.assert_allclose(as_np(up["model"])[0], wW, atol=2e-6)  # the local model is what is sent
    np.testing.assert_allclose(as_np(up["model"])[1], wb, atol=2e-6)
    assert set(up) == {"model", "num_samples"}  # theta never leaves the client
    assert em is not None and np.allclose(as_np(em)[0], tW, atol=2e-6)  # theta is what is scored
    assert np.abs(wW - as_np(w0)[0]).max() > 1e-4 and np.abs(tW - as_np(th0)[0]).max() > 1e-3


def test_theta_init_global_restarts_from_the_received_model(fed_data):
    lam, plr, k = 2.0, 0.1, 2
    algo, ex, rnd = _setup(fed_data, lam=lam, personal_lr=plr, inner_steps=k, local_steps=1, theta_init="global")
    w0, th0 = random_params(D_IN, C, seed=1), random_params(D_IN, C, seed=2)
    _, state, _ = ex.run_client(algo, {"model": w0}, {}, {"theta": th0}, 1, rnd)
    (tW, _), _ = _hand(fed_data, algo, rnd, w0, w0, lam, plr, k, 1, client=1)
    np.testing.assert_allclose(as_np(state["theta"])[0], tW, atol=2e-6)


def test_server_beta_step_is_uniform_over_the_sampled():
    algo = linear_algo("pfedme", 2, 2, beta=0.5)
    w = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    ups = {"model": {"fc.weight": torch.stack([torch.full((2, 2), v) for v in (3.0, 5.0, 10.0)]),
                     "fc.bias": torch.stack([torch.full((2,), v) for v in (1.0, 2.0, 6.0)])},
           "num_samples": torch.tensor([1.0, 2.0, 7.0])}  # sizes must not weigh (uniform average)
    out = algo.aggregate({"model": w}, ups, torch.tensor([0, 1, 2]), None)["model"]
    torch.testing.assert_close(out["fc.weight"], torch.full((2, 2), 0.5 * 1 + 0.5 * 6.0))
    torch.testing.assert_close(out["fc.bias"], torch.full((2,), 0.5 * 0 + 0.5 * 3.0))


def test_every_client_trains_unless_switched_off():
    sampled = np.array([1, 3])
    assert linear_algo("pfedme", 2, 2).training_clients(sampled, 5, None).tolist() == [0, 1, 2, 3, 4]
    assert linear_algo("pfedme", 2, 2, all_clients_train=False).training_clients(sampled, 5, None).tolist() == [1, 3]


def test_local_update_once_per_round_as_the_pfedkd_code(fed_data):
    """local_update: round (HengruiH/pFedKD UserpFedMe.train): theta's K steps pull towards the
    received w^t in every iteration, and w_loc = (1 - lam eta) w^t + lam eta theta once at the end."""
    lam, plr, k = 2.0, 0.1, 3
    algo, ex, rnd = _setup(fed_data, lam=lam, personal_lr=plr, inner_steps=k, local_steps=3, local_update="round")
    assert dict(algo.phases(rnd)[0].trainable) == {"theta": None}
    w0, th0 = random_params(D_IN, C, seed=1), random_params(D_IN, C, seed=2)
    up, state, _ = ex.run_client(algo, {"model": w0}, {}, {"theta": th0}, 0, rnd)
    (tW, tb), (wW, wb) = _hand(fed_data, algo, rnd, th0, w0, lam, plr, k, 3, per_round=True)
    np.testing.assert_allclose(as_np(state["theta"])[0], tW, atol=2e-6)
    np.testing.assert_allclose(as_np(state["theta"])[1], tb, atol=2e-6)
    np.testing.assert_allclose(as_np(up["model"])[0], wW, atol=2e-6)
    np.testing.assert_allclose(as_np(up["model"])[1], wb, atol=2e-6)
    # and it is not Algorithm 1's per-iteration update
    (aW, _), (bW, _) = _hand(fed_data, algo, rnd, th0, w0, lam, plr, k, 3)
    assert np.abs(aW - tW).max() > 1e-5 and np.abs(bW - wW).max() > 1e-5


def test_theta_init_random_is_per_client_and_seeded():
    """theta_init: random: every client's theta is an independent draw of the model's default
    initialisation, a function of (run seed, client id) only (the engine's seeded_client_init)."""
    from medpfl.fl.engine import Engine
    from tests.conftest import make_algo

    algo = make_algo("pfedme", theta_init="random", model="mlr", in_channels=1, image_size=None, num_classes=2)
    assert type(algo).seeded_client_init
    import torch as _t

    eng = Engine.__new__(Engine)  # only initial_client_states is exercised: no data needed
    eng.algo, eng.seed = algo, 7
    eng.data = type("D", (), {"num_clients": 3})()
    from medpfl.fl.program import Federation

    eng.federation = Federation(num_clients=3)  # what Engine.__init__ builds for the set-up hooks
    w0 = {"classifier.weight": _t.zeros(2, 1), "classifier.bias": _t.zeros(2)}
    a, b = eng.initial_client_states(w0), eng.initial_client_states(w0)
    th = a["theta"]["classifier.weight"]
    assert _t.equal(th, b["theta"]["classifier.weight"])  # reproducible
    assert not _t.equal(th[0], th[1]) and not _t.equal(th[0], _t.zeros(2, 1))  # per client, not w_0
    eng.seed = 8
    assert not _t.equal(eng.initial_client_states(w0)["theta"]["classifier.weight"], th)
    persistent = make_algo("pfedme", model="mlr", in_channels=1, image_size=None, num_classes=2)
    eng.algo, eng.seed = persistent, 7
    assert _t.equal(eng.initial_client_states(w0)["theta"]["classifier.weight"], _t.zeros(3, 2, 1))
