"""FedPer (Arivazhagan et al., 2019): a shared body averaged by the server, a personal head per
client, no global model."""

import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
HEAD = ("classifier.weight", "classifier.bias")
BODY = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")


@pytest.fixture(scope="module")
def run(fed_data):
    algo = make_algo("fedper")
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")
    res = eng.run()
    return algo, res, eng.initial_params()


def _sampled(res):
    return [[int(c) for c in s.split()] for s in res.rounds["sampled_clients"]]


def test_only_the_body_crosses(run):
    algo, res, init = run
    shapes = algo.forward.part_shapes("body")
    assert tuple(shapes) == BODY
    body_bytes = 4 * sum(torch.Size(s).numel() for s in shapes.values())
    # conv1 32*3*5*5+32, conv2 64*32*5*5+64, fc 3136*512+512
    assert body_bytes == 4 * (2432 + 51264 + 1606144)
    m = 3
    assert (res.rounds["bytes_up"] == m * (body_bytes + 4)).all()  # + float32 sample count
    assert (res.rounds["bytes_down"] == m * body_bytes).all()
    assert set(res.server) == {"body"} and set(res.server["body"]) == set(BODY)
    assert set(algo.upload_spec()) == {"body", "num_samples"} and set(algo.upload_spec()["body"].shapes) == set(BODY)


def test_no_global_model(run, fed_data):
    algo, res, init = run
    assert res.global_params is None and algo.global_model(res.server) is None
    views = set(res.records["view"])
    assert "global_test" not in views and "global_on_local" not in views
    assert {"local_after_training", "personalized_on_local", "local_on_global_test"} <= views
    assert (res.records["view"] == "local_on_global_test").sum() == fed_data.num_clients


def test_server_body_is_the_size_weighted_average_of_the_last_round(run, fed_data):
    algo, res, init = run
    last = _sampled(res)[-1]
    n = torch.tensor([float(len(fed_data.client_train[c])) for c in last], dtype=torch.float64)
    wts = n / n.sum()
    for k in BODY:
        rows = res.client_states["model"][k][last].to(torch.float64)
        expected = torch.einsum("m,m...->...", wts, rows).float()
        torch.testing.assert_close(res.server["body"][k], expected, atol=1e-6, rtol=0)
        assert not torch.equal(res.server["body"][k], init[k])


def test_heads_stay_personal(run, fed_data):
    algo, res, init = run
    sampled = _sampled(res)
    trained = sorted({c for r in sampled for c in r})
    heads = res.client_states["model"]["classifier.weight"]
    a, b = trained[0], trained[1]
    assert not torch.allclose(heads[a], heads[b], atol=1e-6)
    for c in trained:
        assert res.client_states["trained"][c].item() == 1
        assert not torch.allclose(heads[c], init["classifier.weight"])
    # a client trained only in round 0 keeps its own body too, not the server's
    only_first = sorted(set(sampled[0]) - set(sampled[1]))
    assert only_first
    c = only_first[0]
    assert not torch.allclose(res.client_states["model"]["fc.weight"][c], res.server["body"]["fc.weight"])
    never = sorted(set(range(fed_data.num_clients)) - set(trained))
    assert never
    for c in never:
        assert res.client_states["trained"][c].item() == 0
        assert torch.equal(heads[c], init["classifier.weight"])


def test_personalized_models_of_the_run(run, fed_data):
    algo, res, init = run
    trained = {c for r in _sampled(res) for c in r}
    for c in range(fed_data.num_clients):
        pm = {k: v[c] for k, v in res.personalized.items()}
        own = {k: v[c] for k, v in res.client_states["model"].items()}
        for k in HEAD:
            assert torch.equal(pm[k], own[k])
        for k in BODY:
            assert torch.equal(pm[k], own[k] if c in trained else res.server["body"][k])


def test_personalized_model_hand_case():
    algo = make_algo("fedper")
    p = initial_params()
    own = {k: torch.full_like(v, 1.0) for k, v in p.items()}
    server = {"body": {k: torch.full_like(p[k], 2.0) for k in BODY}}
    for trained, body_value in [(1.0, 1.0), (0.0, 2.0)]:
        out = algo.personalized_model({"model": own, "trained": torch.tensor(trained)}, server)
        assert set(out) == set(p)
        for k in BODY:
            assert torch.all(out[k] == body_value)
        for k in HEAD:
            assert torch.all(out[k] == 1.0)  # always the client's own head


def test_begin_and_finish():
    algo = make_algo("fedper")
    p, q = initial_params(seed=0), initial_params(seed=1)
    server = algo.init_server(p, Federation(5))
    assert set(server) == {"body"} and set(server["body"]) == set(BODY)
    state = algo.init_client_state(q, 0, Federation(5))
    down = algo.download({"body": {k: p[k] for k in BODY}}, torch.tensor([0]), RND)
    assert set(down.shared) == {"body"}
    trees, _ = algo.begin(down.received(), state, {}, RND)
    for k in BODY:
        assert torch.equal(trees["model"][k], p[k])
    for k in HEAD:
        assert torch.equal(trees["model"][k], q[k])
    model = {k: v + 1 for k, v in q.items()}
    up, new, ev = algo.finish({"model": model}, {}, state, {"num_samples": torch.tensor(7.0)}, RND)
    assert set(up) == {"body", "num_samples"} and set(up["body"]) == set(BODY)
    assert new["model"] is model and new["trained"].item() == 1.0 and ev is model
