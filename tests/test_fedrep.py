"""FedRep (Collins et al., ICML 2021, Algorithm 1; official code lgcollins/FedRep): head epochs
with the body frozen, then body epochs with the head frozen; the body crosses, the head stays;
the personalized model is the global body with the client's own head."""

import pytest
import torch

from medpfl.algorithms.fedper import FedPer
from medpfl.algorithms.fedrep import FedRep
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
HEAD = ("classifier.weight", "classifier.bias")
BODY = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")


def _clone(tree):
    return {k: v.clone() for k, v in tree.items()}


def test_phases_defaults_and_the_pfllib_variant():
    head, body = make_algo("fedrep").phases(RND)
    assert [head.name, body.name] == ["head", "train"]  # head first
    assert dict(head.trainable) == {"model": "head"} and dict(body.trainable) == {"model": "body"}
    assert head.epochs == 10 and body.epochs == 1  # official scripts: 10 head epochs; --local_rep_ep 1
    assert head.optimizer == body.optimizer == RunOptimizer()  # the run's optimizer at the round's lr (official, PFLlib)
    h, b = make_algo("fedrep", head_epochs=1, body_epochs=None).phases(RND)  # PFLlib: plocal 1, then E
    assert h.epochs == 1 and b.epochs is None


@pytest.fixture(scope="module")
def ex(fed_data):
    return SequentialExecutor(fed_data, TrainConfig(batch_size=16, local_epochs=1), seed=1, eval_batch_size=256)


def test_each_phase_trains_only_what_it_names(fed_data, ex):
    algo = make_algo("fedrep", head_epochs=1)
    head, body = algo.phases(RND)
    p = initial_params()
    client = 1
    ids = fed_data.client_train[client]
    h, nh = ex._run_phase(algo, head, {"model": _clone(p)}, {}, {}, ids, client, RND)
    assert nh == -(-len(ids) // 16)
    for k in BODY:  # frozen: no gradient, no momentum, no weight decay (the optimizer has both)
        assert torch.equal(h["model"][k], p[k])
    for k in HEAD:
        assert not torch.equal(h["model"][k], p[k])
    b, nb = ex._run_phase(algo, body, {"model": _clone(p)}, {}, {}, ids, client, RND)
    assert nb == -(-len(ids) // 16)
    for k in HEAD:
        assert torch.equal(b["model"][k], p[k])
    for k in BODY:
        assert not torch.equal(b["model"][k], p[k])


def test_a_client_trains_the_head_then_the_body(fed_data, ex):
    """run_client = body phase applied to the head phase's result (not the other order)."""
    algo = make_algo("fedrep", head_epochs=2)
    head, body = algo.phases(RND)
    own, glob = initial_params(seed=1), initial_params(seed=0)
    state = algo.init_client_state(own, 3, Federation(5))
    received = {"body": {k: glob[k] for k in BODY}}
    up, new, ev = ex.run_client(algo, received, {}, state, 3, RND)
    ids = fed_data.client_train[3]
    start = {**_clone(own), **{k: glob[k].clone() for k in BODY}}
    h, _ = ex._run_phase(algo, head, {"model": _clone(start)}, {}, {}, ids, 3, RND)
    hb, _ = ex._run_phase(algo, body, {"model": _clone(h["model"])}, {}, {}, ids, 3, RND)
    for k in start:
        assert torch.equal(new["model"][k], hb["model"][k])
        assert torch.equal(ev[k], hb["model"][k])
    assert set(up) == {"body", "num_samples"} and all(torch.equal(up["body"][k], hb["model"][k]) for k in BODY)
    assert all(torch.equal(new["model"][k], h["model"][k]) for k in HEAD)  # the body phase left the head
    b, _ = ex._run_phase(algo, body, {"model": _clone(start)}, {}, {}, ids, 3, RND)
    bh, _ = ex._run_phase(algo, head, {"model": _clone(b["model"])}, {}, {}, ids, 3, RND)
    assert not torch.equal(bh["model"]["classifier.weight"], new["model"]["classifier.weight"])


@pytest.fixture(scope="module")
def run(fed_data):
    algo = make_algo("fedrep", head_epochs=2)
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")
    return algo, eng.run(), eng.initial_params()


def test_server_and_uploads_are_fedpers(run, fed_data):
    algo, res, init = run
    for hook in ("upload_spec", "init_server", "download", "finish", "aggregate", "init_client_state"):
        assert getattr(FedRep, hook) is getattr(FedPer, hook), hook
    body_bytes = 4 * sum(init[k].numel() for k in BODY)
    assert (res.rounds["bytes_up"] == 3 * (body_bytes + 4)).all() and (res.rounds["bytes_down"] == 3 * body_bytes).all()
    last = [int(c) for c in res.rounds["sampled_clients"].iloc[-1].split()]
    n = torch.tensor([float(len(fed_data.client_train[c])) for c in last], dtype=torch.float64)
    for k in BODY:
        rows = res.client_states["model"][k][last].to(torch.float64)
        torch.testing.assert_close(res.server["body"][k], torch.einsum("m,m...->...", n / n.sum(), rows).float(),
                                   atol=1e-6, rtol=0)
    assert res.global_params is None


def test_personalized_model_is_the_global_body_with_the_own_head(run, fed_data):
    algo, res, init = run
    trained = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    assert set(range(fed_data.num_clients)) - trained, "the schedule should leave a client out"
    for c in range(fed_data.num_clients):
        pm = {k: v[c] for k, v in res.personalized.items()}
        for k in BODY:
            assert torch.equal(pm[k], res.server["body"][k])
        for k in HEAD:
            own = res.client_states["model"][k][c]
            assert torch.equal(pm[k], own)
            assert torch.equal(own, init[k]) == (c not in trained)


def test_personalized_body_own_is_fedpers_reading():
    algo = make_algo("fedrep", personalized_body="own")
    p = initial_params()
    own = {k: torch.full_like(v, 1.0) for k, v in p.items()}
    server = {"body": {k: torch.full_like(p[k], 2.0) for k in BODY}}
    for trained, body_value in [(1.0, 1.0), (0.0, 2.0)]:
        out = algo.personalized_model({"model": own, "trained": torch.tensor(trained)}, server)
        assert all(torch.all(out[k] == body_value) for k in BODY) and all(torch.all(out[k] == 1.0) for k in HEAD)
    out = make_algo("fedrep").personalized_model({"model": own, "trained": torch.tensor(1.0)}, server)
    assert all(torch.all(out[k] == 2.0) for k in BODY) and all(torch.all(out[k] == 1.0) for k in HEAD)
