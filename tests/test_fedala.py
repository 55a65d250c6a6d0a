"""FedALA's adaptive local aggregation (Zhang et al., AAAI 2023, eq. 4-6) on hand-computed cases."""

import dataclasses

import pytest
import torch

from medpfl.algorithms.fedala import ala_mix
from medpfl.config import TrainConfig
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.functional import weighted_ce
from medpfl.fl.optim import RunOptimizer, sgd
from medpfl.fl.program import RoundInfo, Until, phase_plan
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo



RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
TOP = ("classifier.weight", "classifier.bias")


def _batch(dtype=torch.float32):
    torch.manual_seed(3)
    return {"x": torch.randn(4, 3, 28, 28, dtype=dtype), "y": torch.tensor([0, 1, 2, 3]),
            "w": torch.full((4,), 0.25, dtype=dtype)}


def test_ala_mix_hand_case():
    local = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}
    glob = {"a": torch.tensor([5.0, 6.0]), "b": torch.tensor([7.0, 8.0])}
    out = ala_mix(local, glob, {"b": torch.tensor([0.25, 1.0])})
    # 'a' is not weighted: the global value; 'b': 3 + (7-3)*0.25 = 4, 4 + (8-4)*1 = 8
    assert torch.equal(out["a"], torch.tensor([5.0, 6.0]))
    assert torch.equal(out["b"], torch.tensor([4.0, 8.0]))
    # W = 0 keeps the local value
    assert torch.equal(ala_mix(local, glob, {"b": torch.zeros(2)})["b"], torch.tensor([3.0, 4.0]))
    # the inputs are not modified
    assert torch.equal(glob["b"], torch.tensor([7.0, 8.0])) and torch.equal(local["b"], torch.tensor([3.0, 4.0]))


def test_top_layers_are_the_last_layer_idx_trainable_tensors():
    algo = make_algo("fedala")
    p = initial_params()
    assert algo.cfg.layer_idx == 2
    st = algo.init_client_state(p, 0, Federation(5))
    assert tuple(st["weights"]) == TOP
    for k in TOP:
        assert st["weights"][k].shape == p[k].shape and torch.all(st["weights"][k] == 1.0)
    assert st["first"].item() == 1.0
    assert all(torch.equal(st["model"][k], p[k]) for k in p)
    four = make_algo("fedala", layer_idx=4).init_client_state(p, 0, Federation(5))
    assert tuple(four["weights"]) == ("fc.weight", "fc.bias", *TOP)


def test_ala_weight_gradient_is_loss_gradient_times_global_minus_local():
    """eq. 6: dL/dW = dL/dθ_mix ⊙ (θ_g − θ_local) on the weighted leaves (float64)."""
    algo = make_algo("fedala")
    local = {k: v.double() for k, v in initial_params(seed=0).items()}
    glob = {k: v.double() for k, v in initial_params(seed=1).items()}
    gen = torch.Generator().manual_seed(5)
    weights = {k: torch.rand(local[k].shape, generator=gen, dtype=torch.float64).requires_grad_() for k in TOP}
    batch = _batch(torch.float64)
    loss = algo._ala_loss({"ala": weights}, {"local": local, "global": glob}, batch)
    gw = torch.autograd.grad(loss, [weights[k] for k in TOP])

    # manual: the mixed model's leaves as independent variables
    mixed = ala_mix(local, glob, {k: w.detach() for k, w in weights.items()})
    leaves = {k: mixed[k].detach().clone().requires_grad_() for k in TOP}
    mixed = {**mixed, **leaves}
    ref_loss = weighted_ce(algo.forward(mixed, batch["x"], train=True, mask=batch["w"] > 0), batch["y"], batch["w"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    gtheta = torch.autograd.grad(ref_loss, [leaves[k] for k in TOP])
    for k, a, b in zip(TOP, gw, gtheta):
        expected = b * (glob[k] - local[k])
        assert expected.abs().max() > 1e-4  # not a vacuous comparison
        torch.testing.assert_close(a, expected, atol=1e-12, rtol=1e-9)


def test_ala_phase_settings_and_projection():
    algo = make_algo("fedala")
    phases = algo.phases(RND)
    assert [p.name for p in phases] == ["ala", "train"]
    ala = phases[0]
    assert dict(ala.trainable) == {"ala": None}
    assert algo.cfg.eta == 1.0 and ala.optimizer == sgd(1.0)  # absolute, not the round's lr; plain SGD
    assert ala.subset == pytest.approx(0.8) and ala.shuffle is False
    assert ala.until == Until(window=10, threshold=0.01, max_epochs=100)
    out = ala.project({"ala": {"classifier.bias": torch.tensor([-0.5, 0.3, 1.7, 0.0, 1.0])}})
    assert torch.equal(out["ala"]["classifier.bias"], torch.tensor([0.0, 0.3, 1.0, 0.0, 1.0]))
    other = make_algo("fedala", eta=0.5, rand_percent=50.0).phases(RND)[0]
    assert other.optimizer == sgd(0.5) and other.subset == pytest.approx(0.5)
    # the train phase trains the model at the round's lr with the configured optimizer
    train = phases[1]
    assert dict(train.trainable) == {"model": None} and train.optimizer == RunOptimizer()


def test_ala_epochs_zero_while_local_equals_global_on_first_tensor():
    algo = make_algo("fedala")
    ala = algo.phases(RND)[0]
    p = initial_params()
    same = {k: v.clone() for k, v in p.items()}
    assert int(ala.epochs({"local": p, "global": same})) == 0
    moved = dict(same, **{"conv1.weight": same["conv1.weight"] + 0.01})
    assert int(ala.epochs({"local": p, "global": moved})) == 1
    # only the first trainable tensor is compared (the official code's check)
    only_head = dict(same, **{"classifier.weight": same["classifier.weight"] + 0.01})
    assert int(ala.epochs({"local": p, "global": only_head})) == 0


def test_until_applies_follows_first_flag():
    ala = make_algo("fedala").phases(RND)[0]
    assert bool(ala.until_applies({"first": torch.tensor(1.0)})) is True
    assert bool(ala.until_applies({"first": torch.tensor(0.0)})) is False


@pytest.mark.parametrize("first,ala_steps,expected", [(1.0, 0, 1.0), (1.0, 7, 0.0), (0.0, 3, 0.0), (0.0, 0, 0.0)])
def test_finish_clears_first_only_when_ala_ran(first, ala_steps, expected):
    algo = make_algo("fedala")
    p = initial_params()
    state = algo.init_client_state(p, 0, Federation(5))
    state["first"] = torch.tensor(first)
    model = {k: v + 1.0 for k, v in p.items()}
    w = {k: torch.full_like(p[k], 0.5) for k in TOP}
    info = {"num_samples": torch.tensor(12.0), "steps": {"ala": torch.tensor(ala_steps), "train": torch.tensor(4)}}
    up, new, ev = algo.finish({"ala": w, "model": model}, {}, state, info, RND)
    assert new["first"].item() == expected
    assert set(up) == {"model", "num_samples"} and up["model"] is model and up["num_samples"].item() == 12.0
    assert new["model"] is model and new["weights"] is w and ev is model
    assert algo.personalized_model(new, {}) is model


def test_train_phase_starts_from_the_mixed_model():
    algo = make_algo("fedala")
    local, glob = initial_params(seed=0), initial_params(seed=1)
    w = {k: torch.full_like(local[k], 0.25) for k in TOP}
    train = algo.phases(RND)[1]
    out = train.init({"ala": w}, {"local": local, "global": glob})
    assert out["ala"] is w
    for k in local:
        exp = local[k] + 0.25 * (glob[k] - local[k]) if k in TOP else glob[k]
        torch.testing.assert_close(out["model"][k], exp, atol=1e-7, rtol=0)


def test_one_ala_step_through_the_executor_is_eq6(fed_data):
    """One step of the ALA phase: W <- clip(W - eta * dL/dθ_mix ⊙ (θ_g - θ_local), 0, 1) on the
    first batch of the phase's (unshuffled, 80 % window) plan."""
    eta = 200.0  # large enough that the clip acts at both ends
    algo = make_algo("fedala", eta=eta)
    ph = dataclasses.replace(algo.phases(RND)[0], steps=1, until=None)
    local, glob = initial_params(seed=0), initial_params(seed=1)
    w0 = {k: torch.full_like(local[k], 0.5) for k in TOP}
    ctx = {"local": local, "global": glob, "first": torch.tensor(1.0)}
    ex = SequentialExecutor(fed_data, TrainConfig(batch_size=16), seed=1, eval_batch_size=256)
    client = 0
    trees, steps = ex._run_phase(algo, ph, {"ala": {k: v.clone() for k, v in w0.items()}}, ctx, {},
                                 fed_data.client_train[client], client, RND)
    assert steps == 1

    ids = fed_data.client_train[client]
    plan = phase_plan(len(ids), 16, 1, 1, RND.round, client, ph)
    pos = plan[0][plan[0] >= 0]
    assert len(pos) == 16 and torch.equal(pos, torch.arange(int(pos[0]), int(pos[0]) + 16))  # a window, in order
    batch = {"x": fed_data.x(ids[pos]), "y": fed_data.labels[ids[pos]], "w": torch.full((16,), 1 / 16)}
    mixed = ala_mix(local, glob, w0)
    leaves = {k: mixed[k].detach().clone().requires_grad_() for k in TOP}
    loss = weighted_ce(algo.forward({**mixed, **leaves}, batch["x"], train=True), batch["y"], batch["w"])
    g = dict(zip(TOP, torch.autograd.grad(loss, [leaves[k] for k in TOP])))
    for k in TOP:
        expected = torch.clamp(w0[k] - eta * g[k] * (glob[k] - local[k]), 0.0, 1.0)
        torch.testing.assert_close(trees["ala"][k], expected, atol=1e-6, rtol=1e-5)
    wt = trees["ala"]["classifier.weight"]
    assert (wt == 0).any() and (wt == 1).any() and ((wt > 0) & (wt < 1) & (wt != 0.5)).any()
