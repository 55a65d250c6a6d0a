"""FedBABU (Oh, Kim & Yun, ICLR 2022): a frozen head during federated training, body-only
communication, and personalization by fine-tuning: the final global model on every client
(the paper's evaluation, default), at every evaluation round, or each sampled client's trained
model per visit (the earlier reading)."""

import numpy as np
import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.evaluation import eval_groups
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.optim import sgd
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
HEAD = ("classifier.weight", "classifier.bias")
BODY = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias")


TRAIN = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)


def _run(fed_data, executor="sequential", **cfg):
    algo = make_algo("fedbabu", **cfg)
    eng = Engine(algo, fed_data, TRAIN, EvalConfig(), seed=1, executor_kind=executor)
    res = eng.run()
    return algo, res, eng.initial_params()


@pytest.fixture(scope="module")
def run(fed_data):
    """The per-visit reading (the head and personal-state tests below)."""
    return _run(fed_data, personalization="per_visit")


@pytest.fixture(scope="module")
def final_runs(fed_data):
    """The paper's reading (default) on both executors; 2 fine-tuning epochs at lr 0.05, so that
    the fine-tuning changes predictions on the small synthetic clients."""
    return {ex: _run(fed_data, ex, finetune_epochs=2, finetune_lr=0.05) for ex in ("sequential", "stacked")}


def _view(res, view, rnd):
    d = res.records[(res.records["view"] == view) & (res.records["round"] == rnd)]
    return d.set_index("client_id").sort_index()


def test_final_finetunes_the_final_global_model_on_every_client(final_runs, fed_data):
    """Each client's personalized score at the last round is the final global model fine-tuned on
    its own local train split (recomputed here client by client with the sequential executor's
    phase), sampled or not; before the last round it is the global model with the fixed head."""
    algo, res, init = final_runs["sequential"]
    last = TRAIN.rounds - 1
    g = res.server["model"]
    assert torch.equal(g["classifier.weight"], init["classifier.weight"])  # the fixed head, still
    sampled = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    assert set(range(fed_data.num_clients)) - sampled, "the schedule should leave a client out"
    rnd = RoundInfo(round=last, rounds=TRAIN.rounds, lr=TRAIN.optimizer.round_lr(last, TRAIN.rounds),
                    num_clients=fed_data.num_clients, seed=1, base_lr=TRAIN.optimizer.lr, batch_size=16)
    (ft,) = algo.adaptation_phases(rnd)
    assert ft.name == "finetune" and dict(ft.trainable) == {"model": None} and ft.epochs == 2
    ex = SequentialExecutor(fed_data, TRAIN, seed=1, eval_batch_size=256)
    pers = _view(res, "personalized_on_local", last)
    glob = _view(res, "global_on_local", last)
    moved = 0
    for c in range(fed_data.num_clients):
        tuned, steps = ex._run_phase(algo, ft, {"model": {k: v.clone() for k, v in g.items()}}, {}, {},
                                     fed_data.client_train[c], c, rnd)
        assert steps == 2 * -(-len(fed_data.client_train[c]) // 50)  # batch 50, two epochs
        correct, count, _ = eval_groups(algo.predict, tuned["model"], fed_data, [fed_data.client_test[c]], 256)
        assert pers.loc[c, "correct"] == int(correct.sum()) and pers.loc[c, "n_samples"] == int(count.sum())
        moved += not torch.allclose(tuned["model"]["classifier.weight"], g["classifier.weight"])
    assert moved == fed_data.num_clients  # every client fine-tuned, the head included
    assert not pers["correct"].equals(glob["correct"])
    # round 0: no fine-tuning, the personalized view scores the global model (fixed head)
    p0, g0 = _view(res, "personalized_on_local", 0), _view(res, "global_on_local", 0)
    assert p0["correct"].equals(g0["correct"]) and len(p0) == fed_data.num_clients
    # the run's summary counts the clients no round trained
    from medpfl.metrics import summarize_run

    _, summ = summarize_run(res.records, res.rounds, fed_data.num_clients, True, True)
    assert summ["clients_never_trained"] == fed_data.num_clients - len(sampled) > 0
    # what the run returns as personalized models is the global model, not a per-client copy
    for k in g:
        assert torch.equal(res.personalized[k][0], g[k])
    assert set(res.client_states) == {"head"}


def test_final_finetune_stacked_equals_sequential(final_runs):
    """The fine-tune of all K clients as one stacked (vmapped) program gives the sequential
    executor's scores (CPU float32: the same correct counts; accuracies within 1e-6)."""
    seq, st = final_runs["sequential"][1].records, final_runs["stacked"][1].records
    last = TRAIN.rounds - 1
    a = seq[(seq["view"] == "personalized_on_local") & (seq["round"] == last)].sort_values("client_id")
    b = st[(st["view"] == "personalized_on_local") & (st["round"] == last)].sort_values("client_id")
    assert len(a) == len(b) > 0
    np.testing.assert_array_equal(a["correct"].to_numpy(), b["correct"].to_numpy())
    np.testing.assert_allclose(a["loss"].to_numpy(), b["loss"].to_numpy(), rtol=1e-4)


def test_local_after_training_scores_the_trained_model_with_the_fixed_head():
    algo = make_algo("fedbabu")
    assert [p.name for p in algo.phases(RND)] == ["train"]
    p = initial_params()
    state = algo.init_client_state(p, 0, Federation(5))
    model = {k: v + 1 for k, v in p.items()}
    up, new, ev = algo.finish({"model": model}, {}, state, {"num_samples": torch.tensor(9.0)}, RND)
    assert ev is model and new is state and set(up["body"]) == set(BODY)


def test_when_the_finetune_runs():
    last = RoundInfo(round=4, rounds=5, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
    mid = RoundInfo(round=2, rounds=5, lr=0.01, num_clients=5, seed=1, base_lr=0.01)
    final, every, visit = (make_algo("fedbabu", personalization=p) for p in ("final", "every_eval", "per_visit"))
    assert final.cfg.personalization == "final"  # the paper's evaluation is the default
    assert final.adaptation_phases(mid) == [] and len(final.adaptation_phases(last)) == 1
    assert len(every.adaptation_phases(mid)) == 1 and len(every.adaptation_phases(last)) == 1
    assert visit.adaptation_phases(last) == [] and [p.name for p in visit.phases(mid)] == ["train", "finetune"]
    assert make_algo("fedbabu", finetune_epochs=0).adaptation_phases(last) == []


def test_parts_of_the_cnn():
    algo = make_algo("fedbabu")
    assert algo.forward.parts["head"] == HEAD and algo.forward.parts["body"] == BODY


def test_head_stays_the_initial_head_while_body_trains(run):
    algo, res, init = run
    g = res.server["model"]
    # frozen: no gradient, no momentum, no weight decay (the run's optimizer has momentum 0.9, wd 1e-5)
    for k in HEAD:
        assert torch.equal(g[k], init[k])
    for k in BODY:
        assert not torch.allclose(g[k], init[k])
    assert torch.equal(res.global_params["classifier.weight"], init["classifier.weight"])
    assert (res.records["view"] == "global_test").sum() == 2


def test_uploads_and_downloads_hold_only_the_body(run, fed_data):
    algo, res, init = run
    body_bytes = 4 * sum(init[k].numel() for k in BODY)
    assert body_bytes == 4 * sum(torch.Size(s).numel() for s in algo.forward.part_shapes("body").values())
    m = 3  # int(5 * 0.6)
    assert (res.rounds["num_sampled"] == m).all()
    assert (res.rounds["bytes_up"] == m * (body_bytes + 4)).all()  # + float32 sample count
    assert (res.rounds["bytes_down"] == m * body_bytes).all()
    assert set(algo.upload_spec()) == {"body", "num_samples"}
    assert set(algo.upload_spec()["body"].shapes) == set(BODY)


def test_personalized_models(run, fed_data):
    algo, res, init = run
    sampled = {int(c) for s in res.rounds["sampled_clients"] for c in s.split()}
    never = sorted(set(range(fed_data.num_clients)) - sampled)
    assert never, "the schedule should leave a client out"
    g = res.server["model"]
    for c in range(fed_data.num_clients):
        pm = {k: v[c] for k, v in res.personalized.items()}
        if c in never:  # a client never sampled is scored with the global model
            assert res.client_states["tuned"][c].item() == 0
            for k in g:
                assert torch.equal(pm[k], g[k])
        else:  # its fine-tuned copy: the head moved away from the frozen one
            assert res.client_states["tuned"][c].item() == 1
            for k in g:
                assert torch.equal(pm[k], res.client_states["personal"][k][c])
            assert not torch.allclose(pm["classifier.weight"], init["classifier.weight"])
        # every client keeps the shared fixed head in its state
        assert torch.equal(res.client_states["head"]["classifier.weight"][c], init["classifier.weight"])


def test_personalized_model_switches_on_tuned_flag():
    algo = make_algo("fedbabu", personalization="per_visit")
    server = {"model": {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}}
    state = {"personal": {"a": torch.tensor([5.0, 6.0]), "b": torch.tensor(7.0)}, "tuned": torch.tensor(0.0)}
    out = algo.personalized_model(state, server)
    assert torch.equal(out["a"], torch.tensor([1.0, 2.0])) and torch.equal(out["b"], torch.tensor(3.0))
    out = algo.personalized_model({**state, "tuned": torch.tensor(1.0)}, server)
    assert torch.equal(out["a"], torch.tensor([5.0, 6.0])) and torch.equal(out["b"], torch.tensor(7.0))


def test_begin_uses_the_fixed_head_with_the_received_body():
    algo = make_algo("fedbabu")
    p, q = initial_params(seed=0), initial_params(seed=1)
    state = algo.init_client_state(p, 0, Federation(5))
    down = algo.download({"model": q}, torch.tensor([0]), RND)
    assert set(down.shared["body"]) == set(BODY) and not down.per_client
    trees, _ = algo.begin(down.received(), state, {}, RND)
    for k in BODY:
        assert torch.equal(trees["model"][k], q[k])
    for k in HEAD:
        assert torch.equal(trees["model"][k], p[k])


def test_finetune_phase_defaults_and_parts():
    algo = make_algo("fedbabu", personalization="per_visit")
    phases = algo.phases(RND)
    assert [p.name for p in phases] == ["train", "finetune"]
    train, ft = phases
    assert dict(train.trainable) == {"model": "body"}
    assert dict(ft.trainable) == {"personal": None}  # the whole model
    assert ft.optimizer == sgd(1e-3, momentum=0.9, weight_decay=0.0)  # SGD whatever the run's optimizer
    assert ft.batch_size == 50 and ft.epochs == 5
    p = initial_params()
    out = ft.init({"model": p}, {})
    assert set(out) == {"model", "personal"}
    assert all(torch.equal(out["personal"][k], p[k]) and torch.equal(out["model"][k], p[k]) for k in p)
    for part in ("head", "body"):
        algo = make_algo("fedbabu", personalization="per_visit", finetune_part=part)
        assert dict(algo.phases(RND)[1].trainable) == {"personal": part}
        assert dict(make_algo("fedbabu", finetune_part=part).adaptation_phases(RND)[0].trainable) == {"model": part}
    algo = make_algo("fedbabu", personalization="per_visit", finetune_lr=None)
    assert algo.phases(RND)[1].optimizer == sgd(RND.lr, momentum=0.9)  # the round's lr


def test_no_finetuning_gives_one_phase_and_the_trained_model_as_personal():
    algo = make_algo("fedbabu", personalization="per_visit", finetune_epochs=0)
    phases = algo.phases(RND)
    assert len(phases) == 1 and dict(phases[0].trainable) == {"model": "body"}
    p = initial_params()
    state = algo.init_client_state(p, 0, Federation(5))
    model = {k: v + 1 for k, v in p.items()}
    up, new, ev = algo.finish({"model": model}, {}, state, {"num_samples": torch.tensor(9.0)}, RND)
    assert set(up) == {"body", "num_samples"} and set(up["body"]) == set(BODY)
    assert ev is model and new["personal"] is model and new["tuned"].item() == 1.0
    assert new["head"] is state["head"]


def test_head_only_finetuning_leaves_the_body(fed_data):
    algo = make_algo("fedbabu", personalization="per_visit", finetune_part="head", finetune_epochs=1)
    ft = algo.phases(RND)[1]
    ex = SequentialExecutor(fed_data, TrainConfig(batch_size=16), seed=1, eval_batch_size=256)
    client = 4
    p = initial_params()
    model = {k: v.clone() for k, v in p.items()}
    trees, steps = ex._run_phase(algo, ft, {"model": model}, {}, {}, fed_data.client_train[client], client, RND)
    n = len(fed_data.client_train[client])
    assert steps == -(-n // 50)  # batch 50, one epoch
    for k in BODY:
        assert torch.equal(trees["personal"][k], p[k])
    for k in HEAD:
        assert not torch.allclose(trees["personal"][k], p[k])
    for k in p:  # the federated model is not touched by fine-tuning
        assert torch.equal(trees["model"][k], p[k])
