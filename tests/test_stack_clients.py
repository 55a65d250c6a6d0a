"""``train.stack_clients``: the stacked executor trains, adapts and evaluates a round's clients in
chunks of at most that many (bounding memory for large backbones), with the records of the
unchunked stacked run.

A client's batch plans are a function of (seed, round, client) alone, so chunking changes no
draw; only which rows share a batched kernel, i.e. fp32 reduction order at the ulp level."""

from __future__ import annotations

import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.stacked import StackedExecutor
from medpfl.models import ZOO
from tests.conftest import make_algo
from tests.test_contract import assert_runs_agree, model_for

#: one method per path through the chunking: a shared download with per-client download rows
#: (FedCurv's model and P, Q), per-client state with a personalized model (Ditto), an
#: evaluation-time fine-tune (FedBABU's adaptation phases); one round each (the chunking is per
#: round)
METHODS = ("fedcurv", "ditto", "fedbabu")


def _run(fed_data, method: str, stack_clients: int | None, calls: list | None = None):
    model = model_for(method)
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, device=fed_data.device)
    train = TrainConfig(rounds=1, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0, model=model,
                        model_args=ZOO[model].tiny_args, executor="stacked", stack_clients=stack_clients)
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="stacked", fingerprint="stack-clients")
    if calls is not None:
        ex = eng.clients.executor
        real = ex._train_stacked

        def spy(algo, down, states, clients, rnd, *rest):  # rest: the rows' seeds and context (stacked seeds)
            calls.append(len(clients))
            return real(algo, down, states, clients, rnd, *rest)

        ex._train_stacked = spy
    return eng.run()


@pytest.mark.parametrize("method", METHODS)
def test_chunked_clients_give_the_unchunked_records(fed_data, method):
    calls: list[int] = []
    whole = _run(fed_data, method, None)
    chunked = _run(fed_data, method, 2, calls)
    assert calls == [2, 1], calls  # 3 clients a round -> chunks of 2 and 1
    assert_runs_agree(whole, chunked, loss_atol=1e-5, server_atol=1e-5, state_atol=1e-5, rtol=1e-5)


def test_evaluation_is_chunked_too(fed_data):
    """Evaluating the 5 clients' own models with ``stack_clients: 2`` runs 3 vmapped evaluations
    (2, 2, 1 models) and returns the unchunked counts."""
    from medpfl.fl.tree import tree_map

    algo = make_algo("fedavg", model="cnn4", model_args=ZOO["cnn4"].tiny_args)
    cfg = dict(model="cnn4", model_args=ZOO["cnn4"].tiny_args, executor="stacked")
    eng = Engine(algo, fed_data, TrainConfig(**cfg), EvalConfig(), seed=1, executor_kind="stacked",
                 fingerprint="stack-clients")
    one = eng.initial_params()
    k = fed_data.num_clients
    gen = torch.Generator().manual_seed(0)
    models = tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape)
                      + (0.05 * torch.randn(k, *t.shape, generator=gen) if t.is_floating_point() else 0), one)
    ex = StackedExecutor(fed_data, TrainConfig(stack_clients=2, **cfg), seed=1, eval_batch_size=64)
    sizes: list[int] = []
    real = ex._evaluate_stacked

    def spy(algo, models, groups, chunk):
        sizes.append(len(groups))
        return real(algo, models, groups, chunk)

    ex._evaluate_stacked = spy
    got = ex.evaluate_models(algo, models, fed_data.client_test)
    ref = StackedExecutor(fed_data, TrainConfig(**cfg), seed=1, eval_batch_size=64).evaluate_models(
        algo, models, fed_data.client_test)
    assert sizes == [2, 2, 1]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2], atol=1e-6, rtol=1e-6)


def test_stack_clients_is_not_dumped_at_its_default():
    """Jobs written before the key existed keep their hashes; a value is dumped and validated."""
    assert "stack_clients" not in TrainConfig().model_dump()
    assert TrainConfig(stack_clients=4).model_dump()["stack_clients"] == 4
    with pytest.raises(ValueError, match="stack_clients"):
        TrainConfig(stack_clients=0)
