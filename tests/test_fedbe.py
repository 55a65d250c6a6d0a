"""FedBE's defining math on hand-computed cases (the Gaussians, the ensemble's pseudo-labels, the
sharpening, the distillation loss) and what the server-data hook guarantees: the server's images
reach the method's server side only, never a client, and their labels reach nothing."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from medpfl.algorithms.fedbe import (diagonal_gaussian, distill_loss, ensemble_probs, sharpen, update_gaussian)
from medpfl.config import EvalConfig, ParamsError, TrainConfig
from medpfl.fl.data import ServerData
from medpfl.fl.engine import Engine
from medpfl.fl.program import RoundInfo
from tests.conftest import assert_trees_close, make_algo, make_fed_data


def _train(**kw) -> TrainConfig:
    return TrainConfig(**{"rounds": 2, "participation": 0.6, "local_epochs": 1, "batch_size": 16, **kw})


def _rnd(r=0) -> RoundInfo:
    return RoundInfo(round=r, rounds=2, lr=0.01, num_clients=2, seed=1, base_lr=0.01, batch_size=16)


def test_paper_gaussian_is_the_weighted_mean_and_variance_of_the_clients():
    models = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0]])}
    mean, var = diagonal_gaussian(models, torch.tensor([0.25, 0.75], dtype=torch.float64), ["w"])
    # mu = 0.25 w1 + 0.75 w2; var = 0.25 (w1 - mu)^2 + 0.75 (w2 - mu)^2
    torch.testing.assert_close(mean["w"], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(var["w"], torch.tensor([0.75, 3.0]))


def test_code_gaussian_is_over_normalised_updates():
    base = {"w": torch.zeros(2)}
    models = {"w": torch.tensor([[3.0, 4.0], [0.0, 2.0]])}  # updates of norm 5 and 2
    mu, var, norm = update_gaussian(models, base, ["w"])
    # u1 = (0.6, 0.8), u2 = (0, 1): mean (0.3, 0.9); E[u^2] = (0.18, 0.82); var = (0.09, 0.01)
    torch.testing.assert_close(mu["w"], torch.tensor([0.3, 0.9]))
    torch.testing.assert_close(var["w"], torch.tensor([0.09, 0.01]))
    torch.testing.assert_close(norm["w"], torch.tensor(3.5))
    _, var0, _ = update_gaussian({"w": torch.tensor([[1.0, 0.0], [2.0, 0.0]])}, base, ["w"])
    torch.testing.assert_close(var0["w"], torch.tensor([1e-5, 1e-5]))  # clamped (the code's var_clamp)


def test_ensemble_is_the_mean_of_member_softmaxes_then_sharpened():
    p = ensemble_probs([torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0.0, 0.0]])])
    torch.testing.assert_close(p, torch.tensor([[0.375, 0.625]]))  # (0.25, 0.75) and (0.5, 0.5)
    # T = 0.5: squares 0.140625, 0.390625, renormalised
    torch.testing.assert_close(sharpen(p, 0.5), torch.tensor([[0.140625, 0.390625]]) / 0.53125)
    assert sharpen(p, 1.0) is p


def test_distillation_loss_matches_the_code_reduction():
    logits, target = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0.5, 0.5]])
    kl = 0.5 * math.log(4.0 / 3.0)  # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    torch.testing.assert_close(distill_loss(logits, target, "kl", "mean"), torch.tensor(kl / 2))  # / C
    torch.testing.assert_close(distill_loss(logits, target, "kl", "batchmean"), torch.tensor(kl))
    torch.testing.assert_close(distill_loss(logits, torch.tensor([[0.2, 0.8]]), "ce"),
                               torch.tensor(-math.log(0.75)))


class _FakeServer:
    """Two 2-feature server samples (a stand-in for ServerData: len and x)."""

    def __init__(self, x):
        self._x = x

    def __len__(self):
        return len(self._x)

    def x(self, pos=None):
        return self._x if pos is None else self._x[pos]


def test_pseudo_labels_of_a_tiny_ensemble_by_hand():
    algo = make_algo("fedbe", num_classes=2, model="mlr", in_channels=2, image_size=None, temperature=1.0,
                     num_samples=0)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    algo.server_data = _FakeServer(x)
    a = {"classifier.weight": torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]]), "classifier.bias": torch.zeros(2)}
    b = {"classifier.weight": torch.zeros(2, 2), "classifier.bias": torch.zeros(2)}
    p = algo.pseudo_labels([a, b])
    # sample 1: a -> softmax(0, ln 3) = (1/4, 3/4), b -> (1/2, 1/2); sample 2: both (1/2, 1/2)
    torch.testing.assert_close(p, torch.tensor([[0.375, 0.625], [0.5, 0.5]]))


def test_ensemble_members_and_samples():
    algo = make_algo("fedbe", num_classes=2, model="mlr", in_channels=2, image_size=None, num_samples=3)
    models = {"classifier.weight": torch.stack([torch.ones(2, 2), 3 * torch.ones(2, 2)]),
              "classifier.bias": torch.tensor([[0.0, 0.0], [2.0, 2.0]])}
    a = torch.tensor([0.5, 0.5], dtype=torch.float64)
    mean = {"classifier.weight": 2 * torch.ones(2, 2), "classifier.bias": torch.ones(2)}
    members = algo.ensemble(mean, models, a, mean, _rnd())
    assert len(members) == 1 + 2 + 3  # the mean, the clients, M samples
    assert_trees_close(members[0], mean, atol=0)
    assert_trees_close(members[2], {k: v[1] for k, v in models.items()}, atol=0)
    again = algo.ensemble(mean, models, a, mean, _rnd())
    assert_trees_close(members[3], again[3], atol=0)  # seeded from (seed, round)
    assert not torch.equal(members[3]["classifier.weight"], algo.ensemble(mean, models, a, mean, _rnd(1))[3]
                           ["classifier.weight"])
    # the samples spread around mu with sigma = 1 per entry (var = 0.5 (1-2)^2 + 0.5 (3-2)^2)
    big = make_algo("fedbe", num_classes=2, model="mlr", in_channels=2, image_size=None, num_samples=400,
                    include_mean=False, include_clients=False)
    draws = torch.stack([m["classifier.weight"] for m in big.ensemble(mean, models, a, mean, _rnd())])
    assert abs(draws.mean().item() - 2.0) < 0.1 and abs(draws.std().item() - 1.0) < 0.1
    still = make_algo("fedbe", num_classes=2, model="mlr", in_channels=2, image_size=None, num_samples=1,
                      include_mean=False, include_clients=False, var_scale=0.0)
    assert_trees_close(still.ensemble(mean, models, a, mean, _rnd())[0], mean, atol=0)


def test_distillation_moves_the_student_towards_the_pseudo_labels_and_swa_averages():
    kw = dict(num_classes=2, model="mlr", in_channels=2, image_size=None, distill_batch_size=2, distill_epochs=10)
    algo = make_algo("fedbe", swa=False, **kw)
    algo.server_data = _FakeServer(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    init = {"classifier.weight": torch.zeros(2, 2), "classifier.bias": torch.zeros(2)}
    target = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    out = algo.distill(init, target, _rnd())
    before = distill_loss(algo.forward(init, algo.server_data.x()), target)
    after = distill_loss(algo.forward(out, algo.server_data.x()), target)
    assert after < before
    assert_trees_close(init, {"classifier.weight": torch.zeros(2, 2), "classifier.bias": torch.zeros(2)}, atol=0)
    # SWA from step 4, every 2 steps: the mean of the iterates after steps 6, 8, 10
    swa = make_algo("fedbe", swa=True, swa_start=4, swa_freq=2, **kw)
    swa.server_data = algo.server_data
    iterates = [make_algo("fedbe", swa=False, **{**kw, "distill_epochs": e}) for e in (6, 8, 10)]
    for it in iterates:
        it.server_data = algo.server_data
    expect = [it.distill(init, target, _rnd()) for it in iterates]
    got = swa.distill(init, target, _rnd())
    for k in init:
        torch.testing.assert_close(got[k], sum(e[k] for e in expect) / 3)
    late = make_algo("fedbe", swa=True, swa_start=1000, **kw)
    late.server_data = algo.server_data
    assert_trees_close(late.distill(init, target, _rnd()), out, atol=0)  # no average taken: the last iterate


# ----- the server-data hook -------------------------------------------------------------------
def test_only_a_method_declaring_server_data_gets_it(fed_data):
    fedbe, fedavg = make_algo("fedbe"), make_algo("fedavg")
    Engine(fedbe, fed_data, _train(), EvalConfig(), seed=1)
    Engine(fedavg, fed_data, _train(), EvalConfig(), seed=1)
    assert fedavg.server_data is None
    assert isinstance(fedbe.server_data, ServerData) and len(fedbe.server_data) == 20
    assert not any("label" in name for name in vars(fedbe.server_data))  # images only
    torch.testing.assert_close(fedbe.server_data.x(), fed_data.x(fed_data.server_idx))


def test_fedbe_without_server_data_stops_naming_the_key(synthetic_processed):
    plain = make_fed_data(synthetic_processed)
    assert not plain.has_server_data
    with pytest.raises(ParamsError, match="server_data"):
        Engine(make_algo("fedbe"), plain, _train(), EvalConfig(), seed=1)


def test_server_samples_never_reach_a_client(fed_data):
    """Every sample a client executor reads (training batches, passes, evaluation) is recorded: no
    server sample is among them; every download is the model alone."""
    data = dataclasses.replace(fed_data)
    algo = make_algo("fedbe")
    eng = Engine(algo, data, _train(), EvalConfig(), seed=1)  # attaches the server data first
    read: list[torch.Tensor] = []
    real_x = data.x

    def spy(idx):
        read.append(idx.detach().reshape(-1).clone())
        return real_x(idx)

    data.x = spy  # what the executors read from now on (the method's ServerData keeps its own view)
    downloads = []
    real_download = algo.download

    def spy_download(server, clients, rnd):
        d = real_download(server, clients, rnd)
        downloads.append(d)
        return d

    algo.download = spy_download
    eng.run()
    assert read, "the spy saw no client data"
    seen = torch.unique(torch.cat(read))
    assert not torch.isin(fed_data.server_idx, seen).any(), "a server sample reached a client"
    for d in downloads:
        assert set(d.shared) == {"model"} and not d.per_client
        assert {k: tuple(v.shape) for k, v in d.shared["model"].items()} == algo.forward.shapes


def test_scrambled_server_labels_change_nothing(fed_data):
    c = fed_data.num_classes
    labels = fed_data.labels.clone()
    labels[fed_data.server_idx] = (labels[fed_data.server_idx] + 1 + torch.arange(20) % (c - 1)) % c
    assert not torch.equal(labels[fed_data.server_idx], fed_data.labels[fed_data.server_idx])
    scrambled = dataclasses.replace(fed_data, labels=labels)
    runs = [Engine(make_algo("fedbe"), d, _train(), EvalConfig(), seed=1).run() for d in (fed_data, scrambled)]
    assert runs[0].records.equals(runs[1].records)
    assert_trees_close(runs[0].server, runs[1].server, atol=0)
    assert_trees_close(runs[0].client_states, runs[1].client_states, atol=0)


def test_train_stage_names_the_partition_key(tmp_path):
    from medpfl.train import run_training
    from tests.conftest import prepare_train_job

    job, _ = prepare_train_job(tmp_path, method="fedbe", mlflow=False)
    with pytest.raises(ParamsError, match=r"partitions\.p\.server_data"):
        run_training(job, tmp_path / "arrays.npz", tmp_path / "samples.parquet", tmp_path / "partition.parquet",
                     tmp_path / "run")
