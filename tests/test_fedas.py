"""FedAS (Yang, Huang & Ye, CVPR 2024; official code / PFLlib): prototype alignment, Fisher-trace
aggregation and the local program, on hand-computed cases."""

import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedas import prototype_alignment_loss
from medpfl.fl.optim import sgd
from medpfl.fl.program import RoundInfo, select
from medpfl.models import build_model
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=3, seed=1, base_lr=0.01)

PROTO = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
#  sample 0 (class 0): (1, 2) vs (1, 0): ((0)^2 + (2)^2) / 2 = 2
#  sample 1 (class 0): (1, 0) vs (1, 0): 0                     -> MSE_0 = (2 + 0) / 2 = 1
#  sample 2 (class 1 or 2): (0, 4)  vs (0, 1): (0 + 9) / 2 = 4.5 -> MSE_1 = 4.5 (if class 1)
#  sample 3: padding (label 0), far from every prototype
Z = torch.tensor([[1.0, 2.0], [1.0, 0.0], [0.0, 4.0], [100.0, -100.0]])
VALID = torch.tensor([True, True, True, False])


@pytest.mark.parametrize("y2, has_proto, expected", [
    (1, [True, True, False], 1.0 + 4.5),   # classes 0 and 1 present with prototypes; 2 has none
    (1, [True, False, True], 1.0),         # class 1 present but without prototype: no term
    (2, [True, True, False], 1.0),         # class 2 present but without prototype: no term
])
def test_prototype_alignment_loss_hand_case(y2, has_proto, expected):
    y = torch.tensor([0, 0, y2, 0])
    got = prototype_alignment_loss(Z, y, VALID, PROTO, torch.tensor(has_proto))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_prototype_alignment_loss_is_sum_of_torch_mse_per_class():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 3, generator=g)
    proto = torch.randn(3, 3, generator=g)
    y = torch.tensor([2, 0, 2, 2, 0, 1])
    valid = torch.tensor([True, True, True, False, True, True])
    expected = sum(F.mse_loss(z[(y == c) & valid], proto[c].expand(int(((y == c) & valid).sum()), 3))
                   for c in (0, 2))
    got = prototype_alignment_loss(z, y, valid, proto, torch.tensor([True, False, True]))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def _uploads(traces, sizes):
    # two one-leaf models: a = (0, 4) and (4, 0)
    return {"model": {"a": torch.tensor([[0.0, 4.0], [4.0, 0.0]])},
            "fisher_trace": torch.tensor(traces), "num_samples": torch.tensor(sizes)}


def test_aggregate_weights_by_fisher_trace_not_size():
    algo = make_algo("fedas")
    server = {"model": {"a": torch.zeros(2)}, "other": 7}
    new = algo.aggregate(server, _uploads([3.0, 1.0], [10.0, 90.0]), torch.tensor([0, 1]), RND)
    # weights 3/4, 1/4: (0.25 * 4, 0.75 * 4) = (1, 3); size weights 0.1/0.9 would give (3.6, 0.4)
    torch.testing.assert_close(new["model"]["a"], torch.tensor([1.0, 3.0]))
    assert new["other"] == 7


def test_aggregate_falls_back_to_size_weights_when_traces_are_zero():
    algo = make_algo("fedas")
    server = {"model": {"a": torch.zeros(2)}}
    new = algo.aggregate(server, _uploads([0.0, 0.0], [10.0, 90.0]), torch.tensor([0, 1]), RND)
    torch.testing.assert_close(new["model"]["a"], torch.tensor([3.6, 0.4]))


def test_aggregate_without_fisher_weights_is_size_weighted():
    algo = make_algo("fedas", use_fisher_weights=False)
    server = {"model": {"a": torch.zeros(2)}}
    new = algo.aggregate(server, _uploads([3.0, 1.0], [10.0, 90.0]), torch.tensor([0, 1]), RND)
    torch.testing.assert_close(new["model"]["a"], torch.tensor([3.6, 0.4]))


def _hand_batch():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 28, 28, generator=g)
    y = torch.tensor([0, 2, 0, 2, 0])
    w = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])  # sample 4 (class 0) is padding
    return {"x": x, "y": y, "w": w}


def _module(params):
    m = build_model("cnn4", 3, 4, 28)
    m.load_state_dict(params)
    return m.eval()


def test_prototype_pass_sums_features_per_class():
    algo = make_algo("fedas")
    params = initial_params()
    passes = algo.passes(RND)
    assert [p.name for p in passes] == ["protos", "fisher"]
    proto = passes[0]
    assert proto.when == "before" and proto.batch_size == 16
    batch = _hand_batch()
    out = proto.fn({"model": params, "aligned": initial_params(seed=1)}, {}, batch)
    with torch.no_grad():
        z = _module(params).features(batch["x"])  # 512-d penultimate features of the client's own model
    assert out["sum"].shape == (4, 512)
    torch.testing.assert_close(out["count"], torch.tensor([2.0, 0.0, 2.0, 0.0]))
    torch.testing.assert_close(out["sum"][0], z[0] + z[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["sum"][2], z[1] + z[3], rtol=1e-5, atol=1e-6)
    assert torch.all(out["sum"][1] == 0) and torch.all(out["sum"][3] == 0)
    assert z[4].abs().sum() > 0  # the padded sample has features, it is just not counted


def test_align_loss_is_zero_at_prototypes_and_ignores_the_head():
    algo = make_algo("fedas")
    own, glob = initial_params(seed=0), initial_params(seed=1)
    batch = _hand_batch()
    batch["y"] = torch.tensor([0, 2, 1, 3, 0])  # one valid sample per class: prototype = its feature
    sums = algo.passes(RND)[0].fn({"model": own}, {}, batch)
    (align, _) = algo.phases(RND)
    assert align.loss({"model": own, "aligned": own}, {"protos": sums}, batch).item() == pytest.approx(0.0, abs=1e-9)
    aligned = {k: v.clone().requires_grad_() for k, v in glob.items()}
    loss = align.loss({"model": own, "aligned": aligned}, {"protos": sums}, batch)
    with torch.no_grad():
        zg, zo = _module(glob).features(batch["x"][:4]), _module(own).features(batch["x"][:4])
    assert loss.item() == pytest.approx(((zg - zo) ** 2).mean(1).sum().item(), rel=1e-5)
    grads = dict(zip(aligned, torch.autograd.grad(loss, list(aligned.values()), allow_unused=True)))
    assert grads["classifier.weight"] is None or torch.all(grads["classifier.weight"] == 0)
    assert grads["fc.weight"].abs().sum() > 0


def test_phases_align_body_of_aligned_then_train_the_personal_model():
    algo = make_algo("fedas")
    assert algo.cfg.align_lr == 0.01 and algo.cfg.align_epochs == 1 and algo.cfg.align_batch_size == 16
    phases = algo.phases(RND)
    assert [p.name for p in phases] == ["align", "train"]
    align, train = phases
    assert dict(align.trainable) == {"aligned": "body"}
    assert align.optimizer == sgd(0.01) and align.batch_size == 16 and align.epochs == 1  # plain SGD, not the round's lr
    params = initial_params()
    names = select(params, "body", algo.forward.parts, algo.forward.buffers, "test")
    assert sorted(names) == sorted(k for k in params if not k.startswith("classifier."))
    assert dict(train.trainable) == {"model": None}
    # the personal model starts from the aligned body and the client's own head
    own, aligned = initial_params(seed=0), initial_params(seed=1)
    start = train.init({"model": own, "aligned": aligned}, {})["model"]
    for k in params:
        src = own if k.startswith("classifier.") else aligned
        assert torch.equal(start[k], src[k])


def test_no_align_phase_nor_prototype_pass_without_alignment():
    algo = make_algo("fedas", use_alignment=False)
    assert [p.name for p in algo.phases(RND)] == ["train"]
    assert [p.name for p in algo.passes(RND)] == ["fisher"]
    assert [p.name for p in make_algo("fedas", align_epochs=0).phases(RND)] == ["train"]


def test_fisher_trace_pass_is_sum_of_squared_gradients():
    algo = make_algo("fedas")
    params = initial_params()
    fisher = algo.passes(RND)[-1]
    assert fisher.name == "fisher" and fisher.when == "after" and fisher.batch_size == "train"
    batch = _hand_batch()
    out = fisher.fn({"model": params}, {}, batch)
    m = _module(params)
    grads = torch.autograd.grad(F.cross_entropy(m(batch["x"][:4]), batch["y"][:4]), list(m.parameters()))
    expected = sum(torch.sum(g.double() ** 2) for g in grads).item()
    assert out["trace"].item() == pytest.approx(expected, rel=1e-4)
    assert expected > 0


def test_client_keeps_own_model_and_personalized_model_is_it():
    algo = make_algo("fedas")
    assert algo.personalized
    init, glob, trained = initial_params(seed=0), initial_params(seed=1), initial_params(seed=2)
    state = algo.init_client_state(init, 1, Federation(5))
    assert_trees_close(state["model"], init, atol=0)
    trees, _ = algo.begin({"model": glob}, state, {}, RND)
    assert trees["model"] is state["model"] and trees["aligned"] is glob
    info = {"num_samples": torch.tensor(20.0), "fisher": {"trace": torch.tensor(2.5, dtype=torch.float64)}}
    up, new_state, model = algo.finish({"model": trained, "aligned": glob}, {}, state, info, RND)
    assert set(up) == set(algo.upload_spec()) == {"model", "fisher_trace", "num_samples"}
    assert up["model"] is trained and model is trained
    assert up["fisher_trace"].item() == 2.5 and up["fisher_trace"].dtype == torch.float32
    assert new_state["model"] is trained
    server = {"model": glob}
    assert algo.personalized_model(new_state, server) is trained
