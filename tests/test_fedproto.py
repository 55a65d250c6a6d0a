"""FedProto (Tan et al., AAAI 2022; official code yuetan031/FedProto, PFLlib): local prototypes,
global aggregation, the prototype regularizer, prototype prediction and what crosses to the
server, on hand-computed cases."""

import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedproto import (aggregate_prototypes, class_prototypes, local_prototypes,
                                        prototype_logits, prototype_regularizer)
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import weighted_ce
from medpfl.fl.payload import UploadSpecError, check_upload
from medpfl.fl.program import RoundInfo
from medpfl.models import build_model
from tests.conftest import assert_trees_close, initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)


# ----------------------------------------------------------------------------- local prototypes (Eq. 2)


def test_class_prototypes_hand_case():
    # 3 classes; class 1 occurs only on a padded sample, so it has no prototype and count 0
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [100.0, 100.0]])
    y = torch.tensor([0, 0, 2, 0, 1])
    valid = torch.tensor([True, True, True, True, False])
    s = class_prototypes(z, y, valid, 3)
    torch.testing.assert_close(s["count"], torch.tensor([3.0, 0.0, 1.0]))
    torch.testing.assert_close(s["sum"], torch.tensor([[11.0, 14.0], [0.0, 0.0], [5.0, 6.0]]))
    p = local_prototypes(s["sum"], s["count"])
    torch.testing.assert_close(p, torch.tensor([[11 / 3, 14 / 3], [0.0, 0.0], [5.0, 6.0]]))


def test_prototypes_are_sums_over_batches():
    """The pass sums per batch; the prototype is the mean over the whole train set."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 4, generator=g)
    y = torch.tensor([1, 1, 0, 1, 3, 0, 1])
    ones = torch.ones(7, dtype=torch.bool)
    a, b = class_prototypes(z[:3], y[:3], ones[:3], 4), class_prototypes(z[3:], y[3:], ones[3:], 4)
    p = local_prototypes(a["sum"] + b["sum"], a["count"] + b["count"])
    for c in (0, 1, 3):
        torch.testing.assert_close(p[c], z[y == c].mean(0))
    assert torch.all(p[2] == 0)


def _batch(y, w):
    g = torch.Generator().manual_seed(4)
    return {"x": torch.randn(len(y), 3, 28, 28, generator=g), "y": torch.tensor(y), "w": torch.tensor(w)}


def _module(params):
    m = build_model("cnn4", 3, 4, 28)
    m.load_state_dict(params)
    return m.eval()


def test_pass_uses_the_trained_models_features_and_finish_uploads_means_and_counts():
    algo = make_algo("fedproto")
    params = initial_params()
    (proto_pass,) = algo.passes(RND)
    assert proto_pass.name == "protos" and proto_pass.when == "after"
    batch = _batch([0, 2, 0, 2, 0], [0.25, 0.25, 0.25, 0.25, 0.0])  # the last sample is padding
    sums = proto_pass.fn({"model": params}, {}, batch)
    with torch.no_grad():
        z = _module(params).features(batch["x"])  # 512-d penultimate features
    torch.testing.assert_close(sums["count"], torch.tensor([2.0, 0.0, 2.0, 0.0]))
    torch.testing.assert_close(sums["sum"][0], z[0] + z[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums["sum"][2], z[1] + z[3], rtol=1e-5, atol=1e-6)
    ctx = {"global_protos": torch.zeros(4, 512), "has_proto": torch.zeros(4, dtype=torch.bool)}
    up, state, model = algo.finish({"model": params}, ctx, {"model": params}, {"protos": sums}, RND)
    assert set(up) == set(algo.upload_spec()) == {"protos", "counts"}
    assert up["protos"].shape == (4, 512) and up["counts"].shape == (4,)
    torch.testing.assert_close(up["protos"][0], (z[0] + z[2]) / 2, rtol=1e-5, atol=1e-6)
    assert torch.all(up["protos"][[1, 3]] == 0)
    torch.testing.assert_close(up["counts"], torch.tensor([2.0, 0.0, 2.0, 0.0]))
    assert state["model"] is params and model["model"] is params and model["has"] is ctx["has_proto"]


# ----------------------------------------------------------------------------- global prototypes (server)

# 3 clients, 4 classes, d = 2. Client 2 sends garbage in the row of class 0, which it does not
# hold (count 0): it must not enter. No client holds class 3.
PROTOS = torch.tensor([[[1.0, 1.0], [0.0, 0.0], [4.0, 0.0], [0.0, 0.0]],
                       [[3.0, 5.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]],
                       [[100.0, 100.0], [8.0, 8.0], [0.0, 0.0], [0.0, 0.0]]])
COUNTS = torch.tensor([[2.0, 0.0, 1.0, 0.0],
                       [6.0, 3.0, 0.0, 0.0],
                       [0.0, 1.0, 0.0, 0.0]])


def test_uniform_aggregation_is_the_mean_over_the_clients_holding_each_class():
    p, has = aggregate_prototypes(PROTOS, COUNTS, "uniform")
    # class 0: mean of (1, 1), (3, 5); class 1: mean of (2, 2), (8, 8); class 2: (4, 0) alone
    torch.testing.assert_close(p, torch.tensor([[2.0, 3.0], [5.0, 5.0], [4.0, 0.0], [0.0, 0.0]]))
    assert has.tolist() == [True, True, True, False]


def test_count_aggregation_weighs_by_class_counts():
    p, has = aggregate_prototypes(PROTOS, COUNTS, "count")
    # class 0: (2 (1, 1) + 6 (3, 5)) / 8 = (2.5, 4); class 1: (3 (2, 2) + 1 (8, 8)) / 4 = (3.5, 3.5)
    torch.testing.assert_close(p, torch.tensor([[2.5, 4.0], [3.5, 3.5], [4.0, 0.0], [0.0, 0.0]]))
    assert has.tolist() == [True, True, True, False]


@pytest.mark.parametrize("keep", [False, True])
def test_aggregate_drops_or_keeps_a_class_nobody_uploaded(keep):
    algo = make_algo("fedproto", keep_missing_classes=keep)
    old = torch.tensor([[9.0, 9.0], [9.0, 9.0], [9.0, 9.0], [7.0, 6.0]])
    server = {"protos": old, "has": torch.tensor([True, True, True, True])}
    new = algo.aggregate(server, {"protos": PROTOS, "counts": COUNTS}, torch.tensor([0, 1, 2]), RND)
    torch.testing.assert_close(new["protos"][:3], torch.tensor([[2.0, 3.0], [5.0, 5.0], [4.0, 0.0]]))
    if keep:
        torch.testing.assert_close(new["protos"][3], torch.tensor([7.0, 6.0]))
        assert new["has"].tolist() == [True] * 4
    else:  # PFLlib: the global prototypes are rebuilt from the round's uploads only
        assert torch.all(new["protos"][3] == 0) and new["has"].tolist() == [True, True, True, False]


# ----------------------------------------------------------------------------- the local loss


def test_regularizer_hand_case_equals_the_official_mse():
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0], [50.0, 50.0]])
    y = torch.tensor([0, 1, 2, 0])
    w = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0])  # the last sample is padding
    protos = torch.tensor([[0.0, 0.0], [5.0, 5.0], [1.0, 1.0]])
    has = torch.tensor([True, False, True])  # class 1 has no global prototype
    # sample 0: ((1-0)^2 + (2-0)^2) / 2 = 2.5; sample 1: no prototype, 0; sample 2: (4 + 4) / 2 = 4
    got = prototype_regularizer(z, y, w, protos, has)
    assert got.item() == pytest.approx((2.5 + 0 + 4) / 3)
    # the official code: MSELoss(proto_new, protos) with a sample's own feature where its class has no prototype
    proto_new = torch.stack([protos[0], z[1], protos[2]])
    assert got.item() == pytest.approx(F.mse_loss(proto_new, z[:3]).item())


def test_regularizer_gradient_flows_into_the_features_only():
    z = torch.tensor([[1.0, 2.0]], requires_grad=True)
    protos = torch.tensor([[0.0, 1.0]], requires_grad=True)
    prototype_regularizer(z, torch.tensor([0]), torch.tensor([1.0]), protos, torch.tensor([True])).backward()
    torch.testing.assert_close(z.grad, torch.tensor([[1.0, 1.0]]))  # d/dz mean((z - p)^2) = (z - p)
    assert protos.grad is None


def test_local_loss_is_ce_plus_lam_times_regularizer_and_plain_ce_without_prototypes():
    algo = make_algo("fedproto", lam=0.5)
    params = initial_params()
    batch = _batch([0, 1, 3, 1], [0.25] * 4)
    z, logits = algo.train_features(params, batch)
    ce = weighted_ce(logits, batch["y"], batch["w"])
    protos = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    has = torch.tensor([True, False, True, True])
    loss = algo.local_loss({"model": params}, {"global_protos": protos, "has_proto": has}, batch)
    expected = ce + 0.5 * ((z - protos[batch["y"]]) ** 2).mean(-1)[[0, 2]].sum() / 4
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    none = torch.zeros(4, dtype=torch.bool)  # before the first aggregation: plain cross-entropy
    assert algo.local_loss({"model": params}, {"global_protos": protos, "has_proto": none}, batch).item() == \
        pytest.approx(ce.item(), rel=1e-6)


# ----------------------------------------------------------------------------- prediction


def test_prototype_logits_hand_case():
    z = torch.tensor([[0.0, 0.0], [2.5, 2.5]])
    protos = torch.tensor([[1.0, 1.0], [3.0, 3.0], [0.0, 0.0]])
    has = torch.tensor([True, True, False])  # class 2 (nearest to sample 0) has no global prototype
    logits = prototype_logits(z, protos, has)
    # sample 0: distances 1, 9; absent class: 9 + 1; sample 1: 2.25, 0.25; absent: 2.25 + 1
    torch.testing.assert_close(logits, torch.tensor([[-1.0, -9.0, -10.0], [-2.25, -0.25, -3.25]]))
    assert logits.argmax(-1).tolist() == [0, 1]


def test_predict_with_prototypes_classifier_and_the_fallback():
    params = initial_params()
    x = _batch([0, 1, 2], [1 / 3] * 3)["x"]
    algo = make_algo("fedproto")
    z, logits = algo.forward.features_logits(params, x)
    protos = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).abs()
    has = torch.tensor([True, True, False, True])
    model = {"model": params, "protos": protos, "has": has}
    torch.testing.assert_close(algo.predict(model, x), prototype_logits(z, protos, has))
    torch.testing.assert_close(algo.predict({**model, "has": torch.zeros(4, dtype=torch.bool)}, x), logits)
    torch.testing.assert_close(make_algo("fedproto", predict_with="classifier").predict(model, x), logits)


# ----------------------------------------------------------------------------- the privacy boundary


def test_upload_check_accepts_exactly_prototypes_and_counts():
    algo = make_algo("fedproto")
    m, c, d = 3, 4, 512
    ok = {"protos": torch.zeros(m, c, d), "counts": torch.zeros(m, c)}
    check_upload("fedproto", algo.upload_spec(), ok, m)
    per_sample = torch.zeros(m, 20, d)  # 20 samples' features per client
    with pytest.raises(UploadSpecError, match="'protos' must be a tensor of shape \\(3, 4, 512\\)"):
        check_upload("fedproto", algo.upload_spec(), {**ok, "protos": per_sample}, m)
    with pytest.raises(UploadSpecError, match="uploaded keys"):
        check_upload("fedproto", algo.upload_spec(), {**ok, "features": per_sample}, m)
    with pytest.raises(UploadSpecError, match="uploaded keys"):
        check_upload("fedproto", algo.upload_spec(), {"protos": ok["protos"]}, m)
    with pytest.raises(UploadSpecError, match="'counts' must be a tensor"):
        check_upload("fedproto", algo.upload_spec(), {**ok, "counts": torch.zeros(m, 20)}, m)


def _engine(fed_data, method, rounds, **overrides):
    algo = make_algo(method, **overrides)
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0)
    return algo, Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")


@pytest.fixture(scope="module")
def two_rounds(fed_data):
    crossed = []
    algo, eng = _engine(fed_data, "fedproto", 2)
    real = algo.aggregate

    def spy(server, uploads, clients, rnd):
        crossed.append((uploads, server))
        return real(server, uploads, clients, rnd)

    algo.aggregate = spy
    return algo, eng.run(), crossed


def test_only_prototypes_and_counts_cross_and_bytes_count_them(two_rounds, fed_data):
    algo, res, crossed = two_rounds
    c, d, m, k = 4, 512, 3, fed_data.num_clients
    for r, (up, _) in enumerate(crossed):
        assert set(up) == {"protos", "counts"}
        assert up["protos"].shape == (m, c, d) and up["counts"].shape == (m, c)
        sampled = [int(s) for s in res.rounds["sampled_clients"].iloc[r].split()]
        hist = torch.stack([fed_data.train_hist[s] for s in sampled])
        torch.testing.assert_close(up["counts"], hist)  # |D_kj| over the local train split
        assert torch.all(up["protos"][up["counts"] == 0] == 0)
    assert (res.rounds["bytes_up"] == m * 4 * (c * d + c)).all()  # C d + C float32 numbers per client
    assert (res.rounds["bytes_down"] == k * (4 * c * d + c)).all()  # prototypes + bool mask, broadcast to K


def test_server_holds_the_aggregate_of_the_last_round_and_no_model(two_rounds):
    algo, res, crossed = two_rounds
    up, _ = crossed[-1]
    p, has = aggregate_prototypes(up["protos"], up["counts"])
    assert set(res.server) == {"protos", "has"}
    torch.testing.assert_close(res.server["protos"], p)
    assert res.server["has"].tolist() == has.tolist()
    assert res.global_params is None
    assert "global_test" not in set(res.records["view"])


def test_personalized_model_is_own_model_with_the_global_prototypes(two_rounds):
    algo, res, _ = two_rounds
    torch.testing.assert_close(res.personalized["model"]["fc.weight"], res.client_states["model"]["fc.weight"])
    for i in range(len(res.personalized["protos"])):
        torch.testing.assert_close(res.personalized["protos"][i], res.server["protos"])


def test_first_round_is_plain_local_cross_entropy(fed_data):
    """No global prototype exists in round 0: FedProto trains and scores exactly as Local."""
    _, proto = _engine(fed_data, "fedproto", 1)
    _, local = _engine(fed_data, "local", 1)
    a, b = proto.run(), local.run()
    view = "local_after_training"
    pa, pb = a.records[a.records["view"] == view], b.records[b.records["view"] == view]
    assert pa.reset_index(drop=True).equals(pb.reset_index(drop=True))
    assert_trees_close(a.client_states["model"], b.client_states["model"], atol=0)
