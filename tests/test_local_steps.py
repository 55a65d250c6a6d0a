"""``local_steps`` of FedAvg and FedProx: exactly n mini-batch steps per round instead of
``train.local_epochs`` epochs (the pFedKD-WCL code's ``fedprox_slow.py``, whose every "epoch" is
one SGD step: issue 30)."""

from __future__ import annotations

import pytest
import torch

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.program import Phase, phase_plan
from medpfl.models import ZOO
from tests.conftest import assert_trees_close, make_algo


def _engine(fed_data, method, executor, **overrides):
    """An engine for one round; on the sequential executor ``steps`` collects each trained
    client's (id, step count) as ``finish`` receives them."""
    algo = make_algo(method, model="cnn4", model_args=ZOO["cnn4"].tiny_args, **overrides)
    steps: list[int] = []
    real = algo.finish

    def spy(trees, ctx, state, info, rnd):
        steps.append((int(info["client"]), int(info["steps"]["train"])))
        return real(trees, ctx, state, info, rnd)

    if executor == "sequential":
        algo.finish = spy
    train = TrainConfig(rounds=1, participation=0.6, local_epochs=2, batch_size=16, checkpoint_every=0, model="cnn4",
                        model_args=ZOO["cnn4"].tiny_args, executor=executor)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor, fingerprint="steps"), steps


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_each_client_takes_exactly_local_steps_steps(fed_data, method):
    """Sequential executor: a client takes ``local_steps`` steps whatever its size (3 < one
    epoch of every client here; 40 > two epochs of the smallest, whose batches are cycled);
    without it, ``local_epochs`` epochs: ceil(n / B) x E steps."""
    sizes = [len(t) for t in fed_data.client_train]
    for n_steps in (3, 40):
        eng, steps = _engine(fed_data, method, "sequential", local_steps=n_steps)
        eng.run()
        assert steps and all(s == n_steps for _, s in steps), steps
    eng, steps = _engine(fed_data, method, "sequential")
    eng.run()
    assert steps and all(s == -(-sizes[c] // 16) * 2 for c, s in steps), (steps, sizes)


def test_the_steps_are_the_first_batches_of_the_seeded_epochs():
    """The plan of ``steps=n`` is the first n rows of the epochs' plan (the same shuffles), and
    cycles into a next epoch's fresh shuffle past one epoch."""
    full = phase_plan(50, 16, 3, seed=1, round_idx=0, client=2, phase=Phase())
    assert torch.equal(phase_plan(50, 16, 3, 1, 0, 2, Phase(steps=3)), full[:3])
    assert torch.equal(phase_plan(50, 16, 3, 1, 0, 2, Phase(steps=6)), full[:6])  # 4 batches an epoch: into epoch 2


def test_stacked_equals_sequential_with_local_steps(fed_data):
    seq, _ = _engine(fed_data, "fedprox", "sequential", local_steps=5, mu=0.1)
    stk, _ = _engine(fed_data, "fedprox", "stacked", local_steps=5, mu=0.1)
    a, b = seq.run(), stk.run()
    assert a.records.drop(columns=["loss"]).equals(b.records.drop(columns=["loss"]))
    assert_trees_close(a.server, b.server, atol=2e-5, rtol=1e-4)


def test_local_steps_is_not_dumped_at_its_default():
    """Jobs written before the key existed keep their description; a value is dumped."""
    for m in ("fedavg", "fedprox"):
        _, cfg = resolve_method(m, {})
        assert "local_steps" not in cfg.model_dump()
        _, cfg = resolve_method(m, {m: {"local_steps": 20}})
        assert cfg.model_dump()["local_steps"] == 20
        with pytest.raises(ValueError):
            resolve_method(m, {m: {"local_steps": 0}})
