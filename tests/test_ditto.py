"""Ditto (Li et al., ICML 2021, eq. 2 and Algorithm 1): the personal objective, the local
program, what crosses to the server, and its global part reducing to FedAvg."""

import pytest
import torch
import torch.nn.functional as F

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import RoundInfo
from tests.conftest import assert_trees_close, initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)


def _batch(dtype=torch.float32):
    torch.manual_seed(3)
    return {"x": torch.randn(4, 3, 28, 28, dtype=dtype), "y": torch.tensor([0, 1, 2, 3]),
            "w": torch.full((4,), 0.25, dtype=dtype)}


def _double(p):
    return {k: v.double() for k, v in p.items()}


def test_personal_loss_value_hand_computed():
    lam = 0.5
    algo = make_algo("ditto", lam=lam)
    w = initial_params(seed=0)
    v = {k: t + 0.01 for k, t in w.items()}  # every weight 0.01 away from the global model
    batch = _batch()
    n = sum(t.numel() for t in v.values())
    ce = F.cross_entropy(algo.forward(v, batch["x"]), batch["y"]).item()
    loss = algo.personal_loss({"personal": v}, {"global": w}, batch).item()
    assert loss - ce == pytest.approx(0.5 * lam * n * 0.01**2, rel=1e-4)


def test_personal_gradient_is_ce_gradient_plus_lam_times_distance():
    """d/dv [CE(v) + lam/2 ||v - w^t||^2] = grad CE(v) + lam (v - w^t) (eq. 2's step), float64;
    no gradient reaches the global model."""
    lam = 0.7
    algo = make_algo("ditto", lam=lam)
    w = _double(initial_params(seed=0))
    gen = torch.Generator().manual_seed(4)
    v = {k: (t + 0.05 * torch.randn(t.shape, generator=gen, dtype=torch.float64)).requires_grad_()
         for k, t in w.items()}
    w_leaves = {k: t.clone().requires_grad_() for k, t in w.items()}
    batch = _batch(torch.float64)
    loss = algo.personal_loss({"personal": v}, {"global": w_leaves}, batch)
    gv = torch.autograd.grad(loss, list(v.values()), retain_graph=True)
    assert all(g is None for g in torch.autograd.grad(loss, list(w_leaves.values()), allow_unused=True))
    ce = F.cross_entropy(algo.forward(v, batch["x"]), batch["y"])
    gce = torch.autograd.grad(ce, list(v.values()))
    for (k, vk), a, b in zip(v.items(), gv, gce):
        prox = lam * (vk.detach() - w[k])
        assert prox.abs().max() > 0.01  # the proximal part is not negligible
        torch.testing.assert_close(a, b + prox, atol=1e-10, rtol=1e-8)


def test_joint_loss_trains_global_copy_on_plain_cross_entropy():
    """In the default phase the global copy's gradient is FedAvg's (no proximal pull), the
    personal model's is the personal objective's."""
    algo = make_algo("ditto", lam=2.0)
    (ph,) = algo.phases(RND)
    w = _double(initial_params(seed=0))
    model = {k: t.clone().requires_grad_() for k, t in _double(initial_params(seed=1)).items()}
    personal = {k: (t + 0.03).requires_grad_() for k, t in w.items()}
    batch = _batch(torch.float64)
    ctx = {"global": w}
    loss = ph.loss({"model": model, "personal": personal}, ctx, batch)
    ref_model = F.cross_entropy(algo.forward(model, batch["x"]), batch["y"])
    ref_personal = algo.personal_loss({"personal": personal}, ctx, batch)
    assert loss.item() == pytest.approx(ref_model.item() + ref_personal.item(), rel=1e-12)
    g_joint = torch.autograd.grad(loss, list(model.values()))
    g_ce = torch.autograd.grad(ref_model, list(model.values()))
    for a, b in zip(g_joint, g_ce):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_default_program_is_one_phase_training_both_models():
    algo = make_algo("ditto")
    assert algo.cfg.lam == 1.0 and algo.cfg.personal_epochs is None
    phases = algo.phases(RND)
    assert len(phases) == 1
    ph = phases[0]
    assert ph.name == "train" and dict(ph.trainable) == {"model": None, "personal": None}
    assert ph.epochs is None and ph.optimizer == RunOptimizer()  # the run's training settings


def test_personal_epochs_gives_a_second_phase_on_the_personal_model_only():
    algo = make_algo("ditto", personal_epochs=2)
    phases = algo.phases(RND)
    assert [p.name for p in phases] == ["train", "personal"]
    first, second = phases
    assert dict(first.trainable) == {"model": None} and first.loss is None and first.epochs is None
    assert dict(second.trainable) == {"personal": None} and second.epochs == 2
    # its objective is the personal one (CE + lam/2 distance), reading only the personal tree
    w = initial_params(seed=0)
    v = {k: t + 0.01 for k, t in w.items()}
    batch = _batch()
    got = second.loss({"personal": v}, {"global": w}, batch)
    assert got.item() == pytest.approx(algo.personal_loss({"personal": v}, {"global": w}, batch).item(), rel=1e-7)


def test_begin_and_finish():
    algo = make_algo("ditto")
    g, own = initial_params(seed=0), initial_params(seed=1)
    state = {"personal": own}
    trees, ctx = algo.begin({"model": g}, state, {}, RND)
    assert trees["model"] is g and trees["personal"] is own and ctx == {}
    assert algo.shared_context({"model": g}, RND)["global"] is g
    trained = {"model": {k: v + 1 for k, v in g.items()}, "personal": {k: v - 1 for k, v in own.items()}}
    info = {"num_samples": torch.tensor(42.0), "steps": {"train": torch.tensor(3)}}
    up, new, ev = algo.finish(trained, {}, state, info, RND)
    assert set(up) == set(algo.upload_spec()) == {"model", "num_samples"}
    assert up["model"] is trained["model"] and up["num_samples"].item() == 42.0
    assert new == {"personal": trained["personal"]} and ev is trained["personal"]
    assert algo.personalized_model(new, {"model": g}) is trained["personal"]


def _engine_run(algo, fed_data):
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential").run()


def test_global_part_is_fedavg(fed_data):
    avg = _engine_run(make_algo("fedavg"), fed_data)
    ditto = _engine_run(make_algo("ditto"), fed_data)
    assert_trees_close(ditto.server["model"], avg.server["model"], atol=1e-6)
    assert ditto.rounds["bytes_up"].tolist() == avg.rounds["bytes_up"].tolist()
    # and the personal models are not the global one: the sampled clients' personal models moved
    trained = {int(c) for s in ditto.rounds["sampled_clients"] for c in s.split()}
    init = Engine(make_algo("ditto"), fed_data, TrainConfig(rounds=2, participation=0.6), EvalConfig(), seed=1,
                  executor_kind="sequential").initial_params()
    pw = ditto.client_states["personal"]["classifier.weight"]
    for c in range(fed_data.num_clients):
        if c in trained:
            assert not torch.allclose(pw[c], ditto.server["model"]["classifier.weight"], atol=1e-4)
            assert not torch.equal(pw[c], init["classifier.weight"])
        else:
            assert torch.equal(pw[c], init["classifier.weight"])
    assert (ditto.records["view"] == "personalized_on_local").any()
