"""An independent reference: FedAvg's local training and aggregation against a plain PyTorch
loop (an ``nn.Module``, ``torch.optim.SGD``, ``nn.CrossEntropyLoss``) on the same batches. The
two executors are checked against each other elsewhere; this checks the reference executor
against PyTorch itself."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.program import Download, RoundInfo
from medpfl.models import build_model
from tests.conftest import assert_trees_close, batch_plan, make_algo


def _plain_local_training(module: nn.Module, data, client: int, train: TrainConfig, seed: int, round_idx: int,
                          lr: float) -> dict[str, torch.Tensor]:
    ids = data.client_train[client]
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=train.optimizer.momentum,
                          weight_decay=train.optimizer.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    plan = batch_plan(len(ids), train.batch_size, train.local_epochs, seed, round_idx, client)
    module.train()
    for row in plan:
        bid = ids[row[row >= 0]]
        x = data.images[bid].float() / 127.5 - 1.0
        opt.zero_grad()
        loss_fn(module(x), data.labels[bid]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_local_training_matches_torch_sgd(fed_data):
    train = TrainConfig(local_epochs=2, batch_size=16, optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})
    torch.manual_seed(0)
    module = build_model("cnn4", 3, 4, 28)
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    client = 1
    ref = _plain_local_training(module, fed_data, client, train, seed=3, round_idx=5, lr=0.05)

    algo = make_algo("fedavg")
    ex = SequentialExecutor(fed_data, train, seed=3, eval_batch_size=256)
    rnd = RoundInfo(round=5, rounds=10, lr=0.05, num_clients=fed_data.num_clients, seed=3, base_lr=0.05)
    models, uploads, _ = ex.train_clients(algo, Download(shared={"model": start}), {}, np.array([client]), rnd)
    ours = {k: v[0] for k, v in models.items()}
    assert_trees_close(ours, ref, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(ours["fc.weight"], start["fc.weight"])  # it did train
    assert uploads["num_samples"].item() == len(fed_data.client_train[client])


def test_fedavg_round_matches_torch_loop(fed_data):
    """A whole FedAvg run: per round each sampled client trains a fresh copy from the global
    model with a fresh optimizer (lr decayed per round), then the size-weighted average."""
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16)
    res = Engine(make_algo("fedavg"), fed_data, train, EvalConfig(), seed=1, executor_kind="sequential").run()

    torch.manual_seed(1)
    g = {k: v.detach().clone() for k, v in build_model("cnn4", 3, 4, 28).state_dict().items()}
    for r, row in res.rounds.iterrows():
        lr = train.optimizer.lr * train.optimizer.lr_decay**r
        trained, sizes = [], []
        for c in map(int, row["sampled_clients"].split()):
            module = build_model("cnn4", 3, 4, 28)
            module.load_state_dict(g)
            trained.append(_plain_local_training(module, fed_data, c, train, seed=1, round_idx=r, lr=lr))
            sizes.append(len(fed_data.client_train[c]))
        w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        g = {k: sum(wi.to(v.dtype) * t[k] for wi, t in zip(w, trained)) for k, v in g.items()}
    assert_trees_close(res.global_params, g, atol=2e-6, rtol=1e-5)
