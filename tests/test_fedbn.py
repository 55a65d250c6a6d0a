"""FedBN (Li et al., ICLR 2021; official code med-air/FedBN, PFLlib): the BatchNorm layers, read
from the model, never leave a client and are never overwritten; everything else is averaged."""

import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import model_state
from medpfl.fl.program import RoundInfo
from medpfl.models import build_model
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
BN = tuple(f"bn{i}.{k}" for i in (1, 2) for k in ("weight", "bias", "running_mean", "running_var",
                                                   "num_batches_tracked"))
SHARED = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias",
          "classifier.weight", "classifier.bias")


def _state(seed):
    torch.manual_seed(seed)
    m = build_model("cnn4bn", 3, 4, 28)
    with torch.no_grad():  # distinct BN entries, so that a mix-up would show
        for k, v in m.named_buffers():
            if v.is_floating_point():
                v.uniform_(0.5, 1.5)
            else:
                v.fill_(seed)
        m.bn1.weight.uniform_(0.5, 1.5)
    return model_state(m)


def test_the_split_is_read_from_the_model():
    algo = make_algo("fedbn", model="cnn4bn")
    assert algo.bn_names() == BN
    assert set(algo.shared_names()) == set(SHARED)
    spec = algo.upload_spec()
    assert set(spec) == {"model", "num_samples"} and set(spec["model"].shapes) == set(SHARED)


@pytest.mark.parametrize("model,why", [("cnn4", "its 'bn' part is empty"), ("mlp", "it declares no 'bn' part"),
                                       ("mlr", "it declares no 'bn' part")])
def test_a_model_without_batchnorm_stops_with_a_clear_error(model, why):
    algo = make_algo("fedbn", model=model)
    params = model_state(build_model(model, 3, 4, 28))
    with pytest.raises(ValueError, match=rf"train\.model={model}: FedBN keeps the model's BatchNorm layers local.*"
                                         rf"{why}.*cnn4bn"):
        algo.init_server(params, Federation(5))


def test_begin_trains_the_received_shared_part_with_the_own_bn():
    algo = make_algo("fedbn", model="cnn4bn")
    glob, own = _state(1), _state(2)
    received = {"model": {k: glob[k] for k in SHARED}}
    state = algo.init_client_state(own, 0, Federation(5))
    assert set(state) == {"bn"} and set(state["bn"]) == set(BN)
    trees, ctx = algo.begin(received, state, {}, RND)
    assert list(trees["model"]) == list(own)  # the model's own order
    for k in SHARED:
        assert trees["model"][k] is glob[k]
    for k in BN:
        assert torch.equal(trees["model"][k], own[k])


def test_finish_uploads_the_shared_part_only_and_keeps_the_bn():
    algo = make_algo("fedbn", model="cnn4bn")
    trained = _state(3)
    info = {"num_samples": torch.tensor(12.0)}
    up, state, model = algo.finish({"model": trained}, {}, {"bn": {}}, info, RND)
    assert set(up) == {"model", "num_samples"} and set(up["model"]) == set(SHARED)
    assert set(state["bn"]) == set(BN) and all(state["bn"][k] is trained[k] for k in BN)
    assert model is trained


def test_aggregate_averages_the_shared_part_by_sample_count_or_uniformly():
    uploads = {"model": {"fc.bias": torch.tensor([[0.0, 4.0], [4.0, 0.0]])}, "num_samples": torch.tensor([1.0, 3.0])}
    server = {"model": {"fc.bias": torch.zeros(2)}}
    new = make_algo("fedbn", model="cnn4bn").aggregate(server, uploads, torch.tensor([0, 1]), RND)
    torch.testing.assert_close(new["model"]["fc.bias"], torch.tensor([3.0, 1.0]))  # weights 1/4, 3/4
    new = make_algo("fedbn", model="cnn4bn", weighting="uniform").aggregate(server, uploads, torch.tensor([0, 1]), RND)
    torch.testing.assert_close(new["model"]["fc.bias"], torch.tensor([2.0, 2.0]))


def test_personalized_model_is_the_global_shared_part_with_the_own_bn():
    algo = make_algo("fedbn", model="cnn4bn")
    glob, own = _state(4), _state(5)
    pm = algo.personalized_model({"bn": {k: own[k] for k in BN}}, {"model": {k: glob[k] for k in SHARED}})
    assert list(pm) == list(own)
    assert all(torch.equal(pm[k], glob[k]) for k in SHARED) and all(torch.equal(pm[k], own[k]) for k in BN)


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def traced(fed_data):
    """Two rounds on cnn4bn (sequential), recording every client's received model at ``begin``,
    its trained model at ``finish`` and every round's uploads."""
    algo = make_algo("fedbn", model="cnn4bn")
    log = {"begin": [], "finish": [], "uploads": []}
    begin, finish, aggregate = algo.begin, algo.finish, algo.aggregate

    def spy_begin(received, state, info, rnd):
        trees, ctx = begin(received, state, info, rnd)
        start = {k: v.clone() for k, v in trees["model"].items()}
        log["begin"].append((rnd.round, int(info["client"]), received, start))
        return trees, ctx

    def spy_finish(trees, ctx, state, info, rnd):
        log["finish"].append((rnd.round, int(info["client"]), {k: v.clone() for k, v in trees["model"].items()}))
        return finish(trees, ctx, state, info, rnd)

    def spy_aggregate(server, uploads, clients, rnd):
        log["uploads"].append(uploads)
        return aggregate(server, uploads, clients, rnd)

    algo.begin, algo.finish, algo.aggregate = spy_begin, spy_finish, spy_aggregate
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0, model="cnn4bn")
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")
    return algo, eng.run(), log, eng.initial_params()


def test_bn_never_crosses_and_bytes_exclude_it(traced, fed_data):
    algo, res, log, init = traced
    shared_bytes = 4 * sum(init[k].numel() for k in SHARED)
    for up in log["uploads"]:
        assert set(up["model"]) == set(SHARED)
    for _, _, received, _ in log["begin"]:
        assert set(received) == {"model"} and set(received["model"]) == set(SHARED)
    assert (res.rounds["bytes_up"] == 3 * (shared_bytes + 4)).all()  # + the float32 sample count
    assert (res.rounds["bytes_down"] == fed_data.num_clients * shared_bytes).all()  # broadcast to all K
    assert set(res.server) == {"model"} and set(res.server["model"]) == set(SHARED)


def test_each_client_keeps_exactly_its_own_bn(traced, fed_data):
    algo, res, log, init = traced
    last_trained = {}
    for rnd, c, trained in log["finish"]:
        last_trained[c] = trained
    for rnd, c, _, start in log["begin"]:
        before = [t for r, cc, t in log["finish"] if cc == c and r < rnd]
        own = before[-1] if before else init  # its BN after its last training, or the initial one
        for k in BN:
            assert torch.equal(start[k], own[k]), (rnd, c, k)
    for c in range(fed_data.num_clients):
        own = last_trained.get(c, init)
        for k in BN:
            assert torch.equal(res.client_states["bn"][k][c], own[k]), (c, k)
            assert torch.equal(res.personalized[k][c], own[k])
        for k in SHARED:
            assert torch.equal(res.personalized[k][c], res.server["model"][k])
    trained = sorted(last_trained)
    assert not torch.equal(res.client_states["bn"]["bn1.running_mean"][trained[0]],
                           res.client_states["bn"]["bn1.running_mean"][trained[1]])
    assert int(res.client_states["bn"]["bn1.num_batches_tracked"][trained[0]]) > 0


def test_the_shared_part_is_the_size_weighted_average_of_the_last_round(traced, fed_data):
    algo, res, log, init = traced
    up = log["uploads"][-1]
    last = [int(s) for s in res.rounds["sampled_clients"].iloc[-1].split()]
    n = torch.tensor([float(len(fed_data.client_train[c])) for c in last], dtype=torch.float64)
    torch.testing.assert_close(up["num_samples"].double(), n)
    for k in SHARED:
        expected = torch.einsum("m,m...->...", n / n.sum(), up["model"][k].double()).float()
        torch.testing.assert_close(res.server["model"][k], expected, atol=1e-6, rtol=0)
    finished = {c: t for r, c, t in log["finish"] if r == 1}
    for j, c in enumerate(last):  # what crossed is the trained shared part
        assert_trees_close({k: up["model"][k][j] for k in SHARED}, {k: finished[c][k] for k in SHARED}, atol=0)


def test_no_global_model(traced):
    algo, res, log, init = traced
    assert res.global_params is None
    views = set(res.records["view"])
    assert "global_test" not in views and "global_on_local" not in views
    assert {"local_after_training", "personalized_on_local"} <= views
