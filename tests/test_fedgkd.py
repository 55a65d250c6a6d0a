"""FedGKD (Yao et al., IEEE TC 2023) as the pFedKD-WCL paper runs it: the distillation loss
CE + (alpha/2) T^2 KL(teacher || student) on a tiny linear model (closed form, numpy and the
pFedKD code's plain-torch formula), the teacher buffer (mean of the last <= M global models),
its survival across a checkpoint, and the download bytes that count the teacher."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward
from medpfl.fl.payload import payload_nbytes
from medpfl.fl.program import RoundInfo
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, make_algo
from tests.linear_model import kd_hand_case

RND = RoundInfo(round=0, rounds=1, lr=0.01, num_clients=4, seed=1, base_lr=0.01)
D, C = 2, 3  # the tiny linear model: 2 inputs, 3 classes


def linear_algo(**overrides):
    """FedGKD over ``nn.Linear(2, 3)`` (logits = x W^T + b), float64 states."""
    cls, cfg = resolve_method("fedgkd", {"fedgkd": overrides} if overrides else {})
    return cls(cfg, make_forward(torch.nn.Linear(D, C).to("meta")), C)


def lin(W, b):
    return {"weight": torch.tensor(W, dtype=torch.float64), "bias": torch.tensor(b, dtype=torch.float64)}


def loss_and_grad(algo, student, teacher, x, y, w):
    """FedGKD's local loss through the method's own hooks (shared context, sample context,
    local_loss) and its gradient w.r.t. the student's weight and bias."""
    glob = {k: v + 100.0 for k, v in student.items()}  # the received model; must not be the teacher
    ctx = algo.shared_context({"model": glob, "teacher": teacher}, RND)
    batch = {"x": x, "y": y, "w": w, **algo.sample_context(ctx, x)}
    p = {k: v.clone().requires_grad_(True) for k, v in student.items()}
    loss = algo.local_loss({"model": p}, ctx, batch)
    gw, gb = torch.autograd.grad(loss, [p["weight"], p["bias"]])
    return loss.item(), gw, gb


def test_defaults():
    algo = make_algo("fedgkd")
    assert algo.cfg.kl_weight == 0.001 and algo.cfg.temperature == 1.0 and algo.cfg.buffer_size == 5


def test_zero_kl_weight_trains_as_fedavg(fed_data):
    """alpha = 0 (FedGKD's ``fedavg_when``): two engine rounds give FedAvg's records (so the same
    views: a global model, no personalized one) and global model, and no teacher is sent (FedAvg's
    download bytes)."""
    from tests.test_contract import assert_trains_as_fedavg, cached

    assert_trains_as_fedavg(fed_data, "fedgkd", kl_weight=0.0)
    _, avg = cached(fed_data, "fedavg")
    _, red = cached(fed_data, "fedgkd", kl_weight=0.0)
    assert red.rounds["bytes_down"].tolist() == avg.rounds["bytes_down"].tolist()


@pytest.mark.parametrize("alpha", [0.001, 0.5])
def test_loss_and_gradient_closed_form_uniform_student_at_t1(alpha):
    # student uniform (p_s = 1/3 each), teacher p_t = (1/2, 1/4, 1/4), two samples, labels 0
    # and 1 (kd_hand_case): CE = ln 3; KL(p_t || p_s) = 1/2 ln(9/8).
    algo = linear_algo(kl_weight=alpha)
    case = kd_hand_case()
    loss, gw, gb = loss_and_grad(algo, lin(*case["student"]), lin(*case["teacher"]), case["x"], case["y"], case["w"])
    assert loss == pytest.approx(math.log(3.0) + alpha / 2 * 0.5 * math.log(9.0 / 8.0), rel=1e-12)
    # d loss / d logits_i = w_i [(p_s - e_y) + alpha/2 (p_s - p_t)]
    kd = np.array([1 / 3 - 1 / 2, 1 / 3 - 1 / 4, 1 / 3 - 1 / 4])  # p_s - p_t
    g0 = 0.5 * (np.array([1 / 3 - 1, 1 / 3, 1 / 3]) + alpha / 2 * kd)
    g1 = 0.5 * (np.array([1 / 3, 1 / 3 - 1, 1 / 3]) + alpha / 2 * kd)
    # db = g0 + g1 = (-1/6, -1/6, 1/3) + alpha/2 (-1/6, 1/12, 1/12); dW = g0 x0^T + g1 x1^T
    np.testing.assert_allclose(gb.numpy(), [-1 / 6 - alpha / 12, -1 / 6 + alpha / 24, 1 / 3 + alpha / 24], rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), g0 + g1, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), np.outer(g0, [1.0, 2.0]) + np.outer(g1, [-1.0, 3.0]), rtol=1e-12)


def test_loss_and_gradient_closed_form_temperature_2():
    # same student (uniform at any T); teacher logits (ln 4, 0, 0) / T=2 -> (ln 2, 0, 0):
    # p_t^T = (1/2, 1/4, 1/4). Loss = ln 3 + alpha/2 * T^2 * 1/2 ln(9/8);
    # d/d logits of T^2 KL(p_t^T || softmax(s/T)) = T (softmax(s/T) - p_t^T).
    alpha, t = 0.3, 2.0
    algo = linear_algo(kl_weight=alpha, temperature=t)
    student = lin([[0.0, 0.0]] * 3, [0.0, 0.0, 0.0])
    teacher = lin([[0.0, 0.0]] * 3, [math.log(4.0), 0.0, 0.0])
    x = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    loss, gw, gb = loss_and_grad(algo, student, teacher, x, torch.tensor([2]), torch.tensor([1.0], dtype=torch.float64))
    assert loss == pytest.approx(math.log(3.0) + alpha / 2 * 4.0 * 0.5 * math.log(9.0 / 8.0), rel=1e-12)
    g = np.array([1 / 3, 1 / 3, 1 / 3 - 1]) + alpha / 2 * t * np.array([1 / 3 - 1 / 2, 1 / 3 - 1 / 4, 1 / 3 - 1 / 4])
    np.testing.assert_allclose(gb.numpy(), g, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), np.outer(g, [2.0, 0.0]), rtol=1e-12, atol=1e-15)


def _np_softmax(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("alpha,t", [(0.001, 1.0), (0.8, 2.5)])
def test_loss_and_gradient_match_numpy_and_the_pfedkd_code_formula_padding_ignored(alpha, t):
    W, b = [[0.5, -1.0], [1.5, 0.25], [-0.75, 2.0]], [0.1, -0.2, 0.3]
    Wt, bt = [[-1.0, 0.5], [0.25, 1.0], [2.0, -0.5]], [0.0, 0.5, -0.5]
    x = torch.tensor([[1.0, -0.5], [0.3, 2.0], [-1.2, 0.7]], dtype=torch.float64)
    y = torch.tensor([2, 0, 1])
    w = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)  # the third sample is padding
    algo = linear_algo(kl_weight=alpha, temperature=t)
    loss, gw, gb = loss_and_grad(algo, lin(W, b), lin(Wt, bt), x, y, w)

    # numpy, by the definition, over the two real samples
    xn, yn = x.numpy()[:2], y.numpy()[:2]
    s = xn @ np.array(W).T + np.array(b)
    tl = xn @ np.array(Wt).T + np.array(bt)
    ps, qs, pt = _np_softmax(s), _np_softmax(s / t), _np_softmax(tl / t)
    ce = -np.log(ps[[0, 1], yn])
    kl = np.sum(pt * (np.log(pt) - np.log(qs)), axis=1)
    assert loss == pytest.approx(ce.mean() + alpha / 2 * t**2 * kl.mean(), rel=1e-12)
    g = 0.5 * ((ps - np.eye(C)[yn]) + alpha / 2 * t * (qs - pt))  # d loss / d logits
    np.testing.assert_allclose(gb.numpy(), g.sum(0), rtol=1e-10)
    np.testing.assert_allclose(gw.numpy(), g.T @ xn, rtol=1e-10)

    # plain torch, as the pFedKD code writes it: ce + alpha/2 * kl_div(batchmean) * T^2
    net = torch.nn.Linear(D, C).double()
    with torch.no_grad():
        net.weight.copy_(lin(W, b)["weight"]), net.bias.copy_(lin(W, b)["bias"])
    teacher = torch.nn.Linear(D, C).double()
    with torch.no_grad():
        teacher.weight.copy_(lin(Wt, bt)["weight"]), teacher.bias.copy_(lin(Wt, bt)["bias"])
        t_logits = teacher(x[:2])
    out = net(x[:2])
    ref = F.nll_loss(F.log_softmax(out, 1), y[:2]) + alpha / 2 * F.kl_div(
        F.log_softmax(out / t, 1), F.softmax(t_logits / t, 1), reduction="batchmean") * t**2
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(gw, net.weight.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(gb, net.bias.grad, rtol=1e-10, atol=1e-14)
    assert alpha / 2 * t**2 * kl.mean() > 1e-4  # the distillation term is not negligible here


def test_kl_weight_zero_is_plain_cross_entropy_and_sends_no_teacher():
    algo = linear_algo(kl_weight=0.0)
    student = lin([[0.5, -1.0], [1.5, 0.25], [-0.75, 2.0]], [0.1, -0.2, 0.3])
    x = torch.tensor([[1.0, -0.5], [0.3, 2.0]], dtype=torch.float64)
    y = torch.tensor([2, 0])
    ctx = algo.shared_context({"model": student}, RND)
    assert ctx == {} and algo.sample_context(ctx, x) == {}
    got = algo.local_loss({"model": student}, ctx, {"x": x, "y": y, "w": torch.full((2,), 0.5, dtype=torch.float64)})
    assert got.item() == pytest.approx(F.cross_entropy(algo.forward(student, x), y).item(), rel=1e-14)
    server = algo.init_server(student, Federation(4))
    assert set(algo.download(server, torch.tensor([0, 1]), RND).shared) == {"model"}


def test_teacher_logits_come_from_the_teacher_in_evaluation_mode():
    algo = linear_algo()
    model, teacher = lin([[1.0, 0.0]] * 3, [0.0, 1.0, 2.0]), lin([[0.0, 1.0]] * 3, [3.0, 0.0, 0.0])
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    ctx = algo.shared_context({"model": model, "teacher": teacher}, RND)
    assert ctx["teacher"] is teacher
    torch.testing.assert_close(algo.sample_context(ctx, x)["teacher_logits"],
                               torch.tensor([[5.0, 2.0, 2.0]], dtype=torch.float64))
    # M = 1: the teacher is the received global model, not sent separately
    one = linear_algo(buffer_size=1)
    assert one.shared_context({"model": model}, RND)["teacher"] is model


# ----- the teacher buffer -------------------------------------------------------------------
def _push_round(algo, server, w_r, r):
    """Aggregate two uploads whose FedAvg (n = 30, 10) is exactly ``w_r``: w_r + d and w_r - 3d."""
    d = {k: torch.full_like(v, 0.25 * (r % 3 + 1)) for k, v in w_r.items()}
    uploads = {"model": {k: torch.stack([w_r[k] + d[k], w_r[k] - 3 * d[k]]) for k in w_r},
               "num_samples": torch.tensor([30.0, 10.0], dtype=torch.float64)}
    return algo.aggregate(server, uploads, torch.tensor([2, 0]), RND)


def test_teacher_is_the_mean_of_the_last_five_global_models():
    # w_r = r * base: the mean of w_a .. w_r is ((a + r) / 2) * base, by hand:
    # r = 1: w1 -> 1;  2: (1+2)/2 = 1.5;  3: 2;  4: 2.5;  5: (1..5) = 3;
    # r = 6: (2..6) = 4 (all six would give 3.5);  7: (3..7) = 5.  w_0 never enters the buffer.
    algo = linear_algo()
    base = lin([[1.0, -2.0], [0.5, 4.0], [-3.0, 0.25]], [1.0, -1.0, 2.0])
    w0 = {k: torch.full_like(v, 77.0) for k, v in base.items()}
    server = algo.init_server(w0, Federation(4))
    assert int(server["buffer_count"]) == 0
    assert all(server["buffer"][k].shape == (5, *base[k].shape) for k in base)
    d = algo.download(server, torch.tensor([1, 3]), RND)
    assert d.shared["model"] is w0  # round 0: the teacher is w_0 (chosen on the device: equal values, a new tensor)
    assert all(torch.equal(d.shared["teacher"][k], w0[k]) for k in w0)
    expected = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0, 6: 4.0, 7: 5.0}
    for r in range(1, 8):
        w_r = {k: r * v for k, v in base.items()}
        before = {k: v.clone() for k, v in server["buffer"].items()}
        new = _push_round(algo, server, w_r, r)
        assert all(torch.equal(server["buffer"][k], before[k]) for k in before)  # the old state is untouched
        server = new
        assert int(server["buffer_count"]) == r
        assert_trees_close(server["model"], w_r, atol=1e-12)  # FedAvg of the uploads
        want = {k: expected[r] * v for k, v in base.items()}
        assert_trees_close(algo.teacher(server), want, atol=1e-12)
        d = algo.download(server, torch.tensor([0, 1, 2]), RND)
        assert set(d.shared) == {"model", "teacher"} and not d.per_client
        assert d.shared["model"] is server["model"]
        assert_trees_close(d.shared["teacher"], want, atol=1e-12)


@pytest.mark.parametrize("m", [1, 3])
def test_teacher_matches_the_mean_of_a_sliding_window_of_arbitrary_models(m):
    algo = linear_algo(buffer_size=m)
    g = torch.Generator().manual_seed(3)
    rand = lambda: {"weight": torch.randn(C, D, generator=g, dtype=torch.float64),  # noqa: E731
                    "bias": torch.randn(C, generator=g, dtype=torch.float64)}
    server = algo.init_server(rand(), Federation(4))
    history = []
    for r in range(1, 8):
        w_r = rand()
        history.append(w_r)
        server = _push_round(algo, server, w_r, r)
        last = history[-m:]
        assert_trees_close(algo.teacher(server), {k: torch.stack([h[k] for h in last]).mean(0) for k in w_r},
                           atol=1e-12)
    if m == 1:  # the teacher is the global model and is not sent
        assert set(algo.download(server, torch.tensor([0]), RND).shared) == {"model"}


def test_buffer_survives_a_checkpoint_round_trip(tmp_path):
    algo = linear_algo(buffer_size=3)
    base = lin([[1.0, -2.0], [0.5, 4.0], [-3.0, 0.25]], [1.0, -1.0, 2.0])
    server = algo.init_server({k: 0 * v for k, v in base.items()}, Federation(4))
    for r in range(1, 5):  # 4 aggregations: the ring of 3 has wrapped
        server = _push_round(algo, server, {k: r * v for k, v in base.items()}, r)
    torch.save({"server": server}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)["server"]
    assert_trees_close(loaded, server, atol=0)
    assert_trees_close(algo.teacher(loaded), {k: 3.0 * v for k, v in base.items()}, atol=1e-12)  # (2+3+4)/3
    for r in range(5, 8):  # both continue alike: after 7 the teacher is (5+6+7)/3 = 6
        server = _push_round(algo, server, {k: r * v for k, v in base.items()}, r)
        loaded = _push_round(algo, loaded, {k: r * v for k, v in base.items()}, r)
        assert_trees_close(loaded, server, atol=0)
    assert_trees_close(algo.teacher(loaded), {k: 6.0 * v for k, v in base.items()}, atol=1e-12)


# ----- through the engine ---------------------------------------------------------------------
def _engine(fed_data, rounds, checkpoint=None, callbacks=(), **overrides):
    algo = make_algo("fedgkd", **overrides)
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="sequential", checkpoint=checkpoint,
                  callbacks=list(callbacks), fingerprint="gkd")


class _Kill(Exception):
    pass


_FULL: dict = {}


def _full_run(fed_data):
    """3 rounds, M = 2 (cached: the resume and the bytes checks share it)."""
    if "run" not in _FULL:
        _FULL["run"] = _engine(fed_data, 3, buffer_size=2).run()
    return _FULL["run"]


def test_engine_resumes_with_the_buffer_and_equals_an_uninterrupted_run(fed_data, tmp_path):
    full = _full_run(fed_data)
    assert int(full.server["buffer_count"]) == 3

    def die(r, row, recs):  # rounds 0-1 are checkpointed (the ring of 2 is full); die in round 2
        if r == 2:
            raise _Kill()

    ckpt = tmp_path / "checkpoint.pt"
    with pytest.raises(_Kill):
        _engine(fed_data, 3, checkpoint=ckpt, callbacks=[die], buffer_size=2).run()
    saved = torch.load(ckpt, weights_only=False)["server"]
    assert int(saved["buffer_count"]) == 2
    resumed = _engine(fed_data, 3, checkpoint=ckpt, buffer_size=2).run()  # round 2 wraps the ring
    assert resumed.resumed_from == 2
    assert_trees_close(full.server, resumed.server, atol=0)
    assert full.records.equals(resumed.records)
    # the resumed run's ring holds w_3 (slot 0) and w_2 (slot 1): the teacher is their mean
    algo = make_algo("fedgkd", buffer_size=2)
    assert_trees_close(resumed.server["buffer"], {k: torch.stack([full.server["model"][k], saved["model"][k]])
                                                  for k in saved["model"]}, atol=0)
    assert_trees_close(algo.teacher(resumed.server), {k: (full.server["model"][k] + saved["model"][k]) / 2
                                                      for k in saved["model"]}, atol=1e-6)


def test_bytes_down_counts_the_teacher(fed_data):
    res = _full_run(fed_data)
    model_bytes = sum(math.prod(s) * 4 for s in make_algo("fedgkd").forward.shapes.values())
    assert res.rounds["num_sampled"].tolist() == [3, 3, 3]
    # two float32 models per sampled client: the global model and the teacher
    assert res.rounds["bytes_down"].tolist() == [3 * 2 * model_bytes] * 3
    assert res.rounds["bytes_up"].tolist() == [3 * (model_bytes + 4)] * 3
    # no teacher sent when it is the global model (M = 1) or unused (alpha = 0): FedAvg's bytes
    for kw in ({"buffer_size": 1}, {"kl_weight": 0.0}):
        algo = make_algo("fedgkd", **kw)
        server = algo.init_server(res.server["model"], Federation(5))
        assert 3 * payload_nbytes(algo.download(server, torch.tensor([0, 1, 2]), RND).shared) == 3 * model_bytes
