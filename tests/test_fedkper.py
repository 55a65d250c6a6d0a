"""FedKPer's defining math (Fowler & AlRegib, ICIP 2026, eq. 3-6) on hand-computed cases."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedkper import adaptive_kd_loss, aggregation_scores, aggregation_weights, diversity_score
from medpfl.fl.functional import weighted_average
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import RoundInfo
from tests.conftest import initial_params, make_algo


def test_diversity_score_known_histograms():
    assert diversity_score(torch.tensor([5.0, 5, 5, 5])).item() == pytest.approx(1.0, abs=1e-6)
    assert diversity_score(torch.tensor([10.0, 0, 0, 0])).item() == pytest.approx(0.0, abs=1e-9)
    # two of four classes, equal: H = log 2, normalised by log 4
    assert diversity_score(torch.tensor([3.0, 3, 0, 0])).item() == pytest.approx(0.5, abs=1e-6)
    # 3:1 over two of four classes
    p = np.array([0.75, 0.25])
    expected = -(p * np.log(p)).sum() / math.log(4)
    assert diversity_score(torch.tensor([3.0, 1, 0, 0])).item() == pytest.approx(expected, abs=1e-6)


def test_aggregation_weights_known_case():
    # accuracies 0.8 and 0.6; diversity 0.5 and 1.0 -> scores 0.4 and 0.6 -> weights 0.4, 0.6
    acc = torch.tensor([0.8, 0.6])
    hist = torch.tensor([[4.0, 4, 0, 0], [2.0, 2, 2, 2]])
    scores = aggregation_scores(acc, hist, eps=1e-12)
    np.testing.assert_allclose(scores.numpy(), [0.4, 0.6], atol=1e-6)
    w = aggregation_weights(scores, torch.tensor([100.0, 10.0]))
    np.testing.assert_allclose(w.numpy(), [0.4, 0.6], atol=1e-6)
    # not size weighting: sizes 100 vs 10 would give 0.909 / 0.091
    assert abs(w[0].item() - 100 / 110) > 0.4


def test_single_class_client_gets_almost_no_weight():
    acc = torch.tensor([0.99, 0.5])
    hist = torch.tensor([[50.0, 0, 0, 0], [5.0, 5, 5, 5]])
    w = aggregation_weights(aggregation_scores(acc, hist, eps=1e-6), torch.tensor([50.0, 20.0]))
    assert w[0].item() == pytest.approx(0.99e-6 / (0.99e-6 + 0.5 * (1 + 1e-6)), rel=1e-4)
    assert w[1].item() > 0.999


@pytest.mark.parametrize("acc", [[0.0, 0.0], [float("nan"), 0.5]])
def test_undefined_scores_fall_back_to_size_weights(acc):
    hist = torch.tensor([[1.0, 1, 1, 1], [1.0, 1, 1, 1]])
    scores = aggregation_scores(torch.tensor(acc), hist)
    w = aggregation_weights(scores, torch.tensor([30.0, 10.0]))
    np.testing.assert_allclose(w.numpy(), [0.75, 0.25], atol=1e-9)


def test_kd_loss_hand_computed():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    teacher = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([0, 1])
    w = torch.tensor([0.5, 0.5])
    loss, ce, lam = adaptive_kd_loss(logits, teacher, y, w, lambda_cap=10.0, tau=1.0)
    ce_ref = F.cross_entropy(logits, y).item()
    g = F.cross_entropy(teacher, y).item()
    qg = F.softmax(teacher, -1).numpy()
    qk = F.softmax(logits, -1).numpy()
    kl = np.mean(np.sum(qg * (np.log(qg) - np.log(qk)), axis=1))
    assert ce.item() == pytest.approx(ce_ref, rel=1e-6)
    assert lam.item() == pytest.approx(1.0 / (g + 1e-8), rel=1e-6)
    assert loss.item() == pytest.approx(ce_ref + kl / g, rel=1e-5)
    # the same as torch's KLDivLoss(batchmean) the authors use
    kld = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(logits, -1), F.softmax(teacher, -1))
    assert loss.item() == pytest.approx(ce_ref + kld.item() / g, rel=1e-5)


def test_lambda_is_capped():
    # a near-perfect teacher: CE -> 0, 1/CE -> huge, capped at lambda_cap
    teacher = torch.tensor([[30.0, 0.0], [0.0, 30.0]])
    logits = torch.zeros(2, 2)
    y = torch.tensor([0, 1])
    w = torch.full((2,), 0.5)
    _, _, lam = adaptive_kd_loss(logits, teacher, y, w, lambda_cap=10.0, tau=1.0)
    assert lam.item() == 10.0
    _, _, lam = adaptive_kd_loss(logits, teacher, y, w, lambda_cap=3.0, tau=1.0)
    assert lam.item() == 3.0


def test_lambda_has_no_gradient_and_padding_is_ignored():
    logits = torch.randn(3, 4, requires_grad=True)
    teacher = torch.randn(3, 4)
    y = torch.tensor([1, 2, 0])
    w = torch.tensor([0.5, 0.5, 0.0])  # third sample is padding
    loss, _, _ = adaptive_kd_loss(logits, teacher, y, w, 10.0, 1.0)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.all(g[2] == 0)
    ref, _, _ = adaptive_kd_loss(logits[:2], teacher[:2], y[:2], torch.full((2,), 0.5), 10.0, 1.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_loss_equals_ce_when_global_model_is_local_model():
    algo = make_algo("fedkper")
    p = initial_params()
    x = torch.randn(6, 3, 28, 28)
    y = torch.randint(0, 4, (6,))
    w = torch.full((6,), 1 / 6)
    teacher_logits = algo.sample_context({"teacher": p}, x)["teacher_logits"]
    kd = algo.local_loss({"model": p}, {"teacher": p}, {"x": x, "y": y, "w": w, "teacher_logits": teacher_logits})
    ce = F.cross_entropy(algo.forward(p, x), y)
    assert kd.item() == pytest.approx(ce.item(), abs=1e-6)


def test_loss_differs_from_ce_when_teacher_differs():
    algo = make_algo("fedkper")
    p, q = initial_params(seed=0), initial_params(seed=1)
    x = torch.randn(6, 3, 28, 28)
    y = torch.randint(0, 4, (6,))
    w = torch.full((6,), 1 / 6)
    tl = algo.forward(q, x).detach()
    kd = algo.local_loss({"model": p}, {"teacher": q}, {"x": x, "y": y, "w": w, "teacher_logits": tl})
    ce = F.cross_entropy(algo.forward(p, x), y)
    assert kd.item() > ce.item() + 1e-4


def test_paper_defaults_and_knobs():
    algo = make_algo("fedkper")
    assert algo.cfg.lambda_cap == 10.0 and algo.cfg.clip_grad_norm == 5.0 and algo.cfg.score_eps == 1e-12
    rnd = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=2)
    assert [ph.optimizer for ph in algo.phases(rnd)] == [RunOptimizer(max_grad_norm=5.0)]
    assert [ph.optimizer for ph in make_algo("fedkper", clip_grad_norm=None).phases(rnd)] == [RunOptimizer()]


def test_aggregation_is_not_fedavg_unless_switched_off():
    p0, p1 = initial_params(seed=0), initial_params(seed=1)
    stacked = {k: torch.stack([p0[k], p1[k]]) for k in p0}
    uploads = {"model": stacked, "num_samples": torch.tensor([90.0, 10.0]),
               "score": aggregation_scores(torch.tensor([0.5, 0.9]), torch.tensor([[9.0, 0, 0, 0], [3.0, 3, 2, 2]]))}
    rnd = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=2)
    clients = torch.tensor([0, 1])
    fedavg = make_algo("fedavg").aggregate({"model": p0}, uploads, clients, rnd)["model"]
    kper = make_algo("fedkper").aggregate({"model": p0}, uploads, clients, rnd)["model"]
    off = make_algo("fedkper", use_score_aggregation=False).aggregate({"model": p0}, uploads, clients, rnd)["model"]
    assert not torch.allclose(kper["fc.weight"], fedavg["fc.weight"])
    torch.testing.assert_close(off["fc.weight"], fedavg["fc.weight"])
    expected = weighted_average(stacked, aggregation_weights(uploads["score"], uploads["num_samples"]))
    torch.testing.assert_close(kper["fc.weight"], expected["fc.weight"])


def test_finish_uploads_score_from_train_accuracy_and_histogram():
    algo = make_algo("fedkper")
    p = initial_params()
    info = {"num_samples": torch.tensor(8.0), "label_hist": torch.tensor([2.0, 2, 2, 2]),
            "train_acc": {"correct": torch.tensor(6.0, dtype=torch.float64), "count": torch.tensor(8.0, dtype=torch.float64)}}
    up, state, model = algo.finish({"model": p}, {}, {}, info, RoundInfo(round=0, rounds=1, lr=0.01, num_clients=2))
    assert set(up) == set(algo.upload_spec()) == {"model", "num_samples", "score"}
    assert up["score"].item() == pytest.approx(0.75, rel=1e-6)  # uniform histogram: d_k = 1
    assert state == {} and model is p
