"""The client optimizer as a chain of transformations (``medpfl.fl.optim``): each transformation
on hand cases; SGD chains bit for bit as the hand-wired step they replace and as
``torch.optim.SGD``; Adam as ``torch.optim.Adam`` / ``AdamW``; per-client rows of a stack;
per-tree chains in one phase on both executors against a hand computation; an Adam run on both
executors; ``train.optimizer`` validation and its unchanged job description."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.algorithms import REGISTRY
from medpfl.compose import validate_params
from medpfl.config import EvalConfig, OptimizerConfig, ParamsError, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.optim import (RunOptimizer, adam, add_decayed_weights, chain, clip_by_global_norm, phase_optimizer,
                             rows, scale, scale_by_adam, sgd, trace)
from medpfl.fl.program import Phase, RoundInfo
from medpfl.fl.stacked import StackedExecutor, _pad_ids
from medpfl.models import ZOO
from tests.conftest import assert_trees_close, make_algo
from tests.test_contract import model_for


# ----- the step the executors wired by hand up to contract v2 (functional.py at ca47d0a), verbatim --------------
def _old_clip_(grads, max_norm, stacked=False):
    if stacked:
        m = next(iter(grads.values())).shape[0]
        norm = torch.sqrt(sum(torch.sum(g.float().reshape(m, -1) ** 2, dim=1) for g in grads.values()))
    else:
        norm = torch.sqrt(sum(torch.sum(g.float() ** 2) for g in grads.values()))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))) if stacked else coef)


@torch.no_grad()
def _old_sgd_step_(params, grads, momentum_buf, lr, momentum, weight_decay):
    for k, p in params.items():
        d = grads[k]
        if weight_decay:
            d.add_(p, alpha=weight_decay)
        if momentum:
            b = momentum_buf[k]
            b.mul_(momentum).add_(d)
            p.add_(b, alpha=-lr)
        else:
            p.add_(d, alpha=-lr)


def _leaves(seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(*lead, 7, 5, generator=g), "b": torch.randn(*lead, 5, generator=g)}


# ----- each transformation on a hand case ----------------------------------------------------------------------
def test_sgd_with_momentum_and_weight_decay_by_hand():
    """d = g + wd w; b = m b + d; w -= lr b (torch.optim.SGD), two steps of numbers worked out by hand."""
    w = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    opt = sgd(0.1, momentum=0.5, weight_decay=0.25)
    assert str(opt) == "add_decayed_weights(0.25) -> trace(0.5) -> scale(-0.1)"
    state = opt.init(w)
    opt.step_(w, {"w": torch.tensor([0.5, 1.0], dtype=torch.float64)}, state, count=1)
    # d = [0.5 + 0.25, 1 - 0.5] = [0.75, 0.5] = b; w = [1 - 0.075, -2 - 0.05]
    assert torch.allclose(w["w"], torch.tensor([0.925, -2.05], dtype=torch.float64), rtol=0, atol=1e-15)
    opt.step_(w, {"w": torch.tensor([0.0, 0.0], dtype=torch.float64)}, state, count=2)
    # d = 0.25 w = [0.23125, -0.5125]; b = 0.5 [0.75, 0.5] + d = [0.60625, -0.2625]
    assert torch.allclose(state[1]["trace"]["w"], torch.tensor([0.60625, -0.2625], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(w["w"], torch.tensor([0.925 - 0.060625, -2.05 + 0.02625], dtype=torch.float64), atol=1e-15)


def test_zero_momentum_and_decay_leave_their_transformations_out():
    assert sgd(0.1) == chain(scale(-0.1))  # no buffer
    assert sgd(0.1, momentum=0.9) == chain(trace(0.9), scale(-0.1))
    assert sgd(0.1, weight_decay=1e-4) == chain(add_decayed_weights(1e-4), scale(-0.1))
    assert chain(clip_by_global_norm(1.0), sgd(0.1)).transforms == (clip_by_global_norm(1.0), scale(-0.1))
    assert sgd(0.1).lr == 0.1 and chain(trace(0.9)).lr is None


def test_a_later_transformation_never_changes_the_momentum_buffer():
    """chain(trace(0.5), scale(2), scale(-0.1)): the buffer is b = 0.5 b + g, the step -0.2 b."""
    w = {"w": torch.tensor([1.0], dtype=torch.float64)}
    opt = chain(trace(0.5), scale(2.0), scale(-0.1))
    state = opt.init(w)
    for step, g in enumerate((1.0, 1.0), start=1):
        opt.step_(w, {"w": torch.tensor([g], dtype=torch.float64)}, state, count=step)
    assert float(state[0]["trace"]["w"]) == 1.5  # 0.5 * 1 + 1, not 0.5 * 2 + 1
    assert float(w["w"]) == pytest.approx(1.0 - 0.2 * 1.0 - 0.2 * 1.5, abs=1e-15)


def test_clip_by_global_norm_by_hand_and_per_client():
    """clip_grad_norm_: u * min(1, c / (||u|| + 1e-6)), the norm over the whole tree; per row of a stack."""
    u = {"a": torch.tensor([3.0]), "b": torch.tensor([0.0, 4.0])}  # ||u|| = 5
    clip_by_global_norm(1.0).update_(u, {}, {}, count=1, per_client=False)
    c = 1.0 / (5.0 + 1e-6)
    assert torch.allclose(u["a"], torch.tensor([3.0 * c])) and torch.allclose(u["b"], torch.tensor([0.0, 4.0 * c]))
    ref = torch.nn.Parameter(torch.tensor([3.0, 0.0, 4.0]))
    ref.grad = ref.detach().clone()
    torch.nn.utils.clip_grad_norm_([ref], 1.0)
    assert torch.equal(torch.cat([u["a"], u["b"]]), ref.grad)
    rows_ = {"a": torch.tensor([[3.0], [0.3]]), "b": torch.tensor([[0.0, 4.0], [0.0, 0.4]])}  # norms 5 and 0.5
    clip_by_global_norm(1.0).update_(rows_, {}, {}, count=1, per_client=True)
    assert torch.allclose(rows_["a"][:, 0], torch.tensor([3.0 * c, 0.3]))  # the small one is left alone
    assert rows_["a"][1, 0] == torch.tensor(0.3) and rows_["b"][1, 1] == torch.tensor(0.4)


def test_foreach_sgd_with_per_client_clip_by_hand():
    """clip (per client) -> add_decayed_weights -> trace -> scale(-lr) on a stack of 2 clients x 2
    leaves, two steps, with the stacked executor's device scalars (count int64, -lr float32), against
    the formulas per client: n = sqrt(sum_leaves ||g||^2); d = min(1, c / (n + 1e-6)) g + wd w;
    b = m b + d; w -= lr b."""
    lr, m, wd, c = 0.1, 0.5, 0.1, 1.0
    w0 = {"w": [[1.0, 2.0], [0.5, -1.0]], "b": [[1.0], [2.0]]}
    grads = [{"w": [[3.0, 0.0], [0.3, 0.0]], "b": [[4.0], [0.4]]},  # norms 5 (clipped) and 0.5 (not)
             {"w": [[0.0, 0.0], [1.0, 0.0]], "b": [[0.0], [0.0]]}]  # norms 0 and 1 (clipped by 1/(1+1e-6))
    opt = chain(clip_by_global_norm(c), sgd(lr, momentum=m, weight_decay=wd))
    params = {k: torch.tensor(v) for k, v in w0.items()}
    state = opt.init(params)
    count, neg_lr = torch.zeros((), dtype=torch.int64), torch.tensor(opt.final_scale)
    want = {k: [list(r) for r in v] for k, v in w0.items()}
    buf = {k: [[0.0] * len(r) for r in v] for k, v in w0.items()}
    for g in grads:
        count.add_(1)
        opt.step_(params, {k: torch.tensor(v) for k, v in g.items()}, state, count=count, per_client=True,
                  scale=neg_lr)
        for j in range(2):  # the formulas, client by client, in float64
            n = sum(x * x for k in g for x in g[k][j]) ** 0.5
            coef = min(1.0, c / (n + 1e-6))
            for k in g:
                for i, x in enumerate(g[k][j]):
                    d = coef * x + wd * want[k][j][i]
                    buf[k][j][i] = m * buf[k][j][i] + d
                    want[k][j][i] -= lr * buf[k][j][i]
    assert int(count) == 2
    for k in want:
        torch.testing.assert_close(params[k], torch.tensor(want[k]), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(state[2]["trace"][k], torch.tensor(buf[k]), rtol=1e-6, atol=1e-7)
    # worked by hand: client 0, leaf b: d1 = 4/(5+1e-6) + 0.1*1 = 0.9 = b1, w1 = 1 - 0.09 = 0.91;
    # g2 = 0: b2 = 0.5*0.9 + 0.1*0.91 = 0.541. Client 1, leaf w[0]: d1 = 0.3 + 0.1*0.5 = 0.35 = b1,
    # w1 = 0.465; d2 = 1/(1+1e-6) + 0.0465, b2 = 0.175 + d2 = 1.2214990, w2 = 0.465 - 0.1221499
    assert float(state[2]["trace"]["b"][0, 0]) == pytest.approx(0.541, rel=1e-6)
    assert float(params["w"][1, 0]) == pytest.approx(0.465 - 0.1 * (0.175 + 1 / (1 + 1e-6) + 0.0465), rel=1e-6)


@pytest.mark.parametrize("opt", [chain(clip_by_global_norm(0.5), sgd(0.05, 0.9, 1e-2)), sgd(0.05, 0.9, 1e-2),
                                 adam(1e-2, weight_decay=1e-2), adam(1e-2, 0.8, 0.99, weight_decay=1e-2,
                                                                     decoupled_weight_decay=True),
                                 chain(clip_by_global_norm(1.0), adam(1e-3))], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_device_count_and_lr_give_the_python_scalars_floats_bit_for_bit(opt, dtype):
    """The stacked executor's step: count a 0-dim int64 tensor incremented in place, -lr a 0-dim
    tensor of the leaves' dtype (``scale=``), against Python ints and the chain's float factor:
    the same floats (the final w += s u rounded once; Adam's bias corrections computed in float64
    and rounded to the leaves' dtype), on the rows of a stack that shrinks. float64 leaves: a
    float32 -lr stepped with the float32-rounded lr (1e-11 apart after 40 pFedKD-WCL steps, the
    CI failure of 2026-11-26)."""
    cast = lambda tree: {k: v.to(dtype) for k, v in tree.items()}  # noqa: E731
    a_py, a_dev = cast(_leaves(0, (3,))), cast(_leaves(0, (3,)))
    s_py, s_dev = opt.init(a_py), opt.init(a_dev)
    count, neg_lr = torch.zeros((), dtype=torch.int64), torch.tensor(opt.final_scale, dtype=dtype)
    for step in range(1, 31):
        a = 3 if step < 20 else 2
        g = cast(_leaves(100 + step, (a,)))
        opt.step_({k: v[:a] for k, v in a_py.items()}, {k: v.clone() for k, v in g.items()}, rows(s_py, a),
                  count=step, per_client=True)
        count.add_(1)
        opt.step_({k: v[:a] for k, v in a_dev.items()}, {k: v.clone() for k, v in g.items()}, rows(s_dev, a),
                  count=count, per_client=True, scale=neg_lr)
    for k in a_py:
        assert torch.equal(a_py[k], a_dev[k])


@pytest.mark.parametrize("b1, b2", [(0.9, 0.999), (0.8, 0.99), (0.95, 0.9999)])
def test_adam_bias_corrections_from_a_device_count_are_the_python_ones_in_float32(b1, b2):
    """(1 - b1^t, sqrt(1 - b2^t)) from a 0-dim int64 count (float64 on the device, then float32)
    equal the Python float64 values rounded to float32, t = 1..3000 and a few large t."""
    t_adam = scale_by_adam(b1, b2)
    for t in [*range(1, 3001), 10_000, 99_999, 1_000_000]:
        py1, py2 = t_adam.bias_corrections(t)
        dev1, dev2 = t_adam.bias_corrections(torch.tensor(t))
        assert dev1.dtype == dev2.dtype == torch.float32 and dev1.dim() == 0
        assert dev1 == torch.tensor(py1, dtype=torch.float32) and dev2 == torch.tensor(py2, dtype=torch.float32), t


def test_a_device_scale_needs_a_chain_that_ends_in_scale():
    w = {"w": torch.ones(2)}
    opt = chain(trace(0.9))
    with pytest.raises(ValueError, match="does not end in scale"):
        opt.step_(w, {"w": torch.ones(2)}, opt.init(w), count=1, scale=torch.tensor(-0.1))
    assert opt.final_scale is None and sgd(0.1).final_scale == -0.1


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that launch a kernel (not views, not allocations)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket.__name__ in ("detach", "alias", "empty", "empty_strided")):
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("opt, per_leaf", [(sgd(0.05, 0.9, 1e-2), 0), (adam(1e-3, weight_decay=1e-2), 0),
                                           (chain(clip_by_global_norm(1.0), sgd(0.05, 0.9)), 1)], ids=str)
def test_optimizer_kernels_per_step_do_not_grow_with_the_leaves(opt, per_leaf):
    """One foreach op per operation over all leaves: a step on 8 leaves launches as many kernels as
    on 2 (the per-client clip: one rescaling kernel per leaf, a per-row coefficient broadcast)."""
    def kernels(n_leaves):
        params = {f"l{i}": torch.randn(3, 4, 5) for i in range(n_leaves)}
        state = opt.init(params)
        count, s = torch.ones((), dtype=torch.int64), torch.tensor(opt.final_scale)
        grads = {k: torch.randn(3, 4, 5) for k in params}
        mode = _Kernels()
        with mode:
            opt.step_(params, grads, state, count=count, per_client=True, scale=s)
        return mode.n
    assert kernels(8) - kernels(2) == per_leaf * 6


def test_adam_first_step_by_hand():
    """m_hat = g and v_hat = g^2 at t = 1 (Kingma & Ba 2015 Alg. 1): w -= lr g / (|g| + eps)."""
    w = {"w": torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)}
    g = torch.tensor([0.5, -2.0, 1e-9], dtype=torch.float64)
    opt = adam(0.1, eps=1e-8)
    assert str(opt) == "scale_by_adam(0.9, 0.999, 1e-08) -> scale(-0.1)"
    state = opt.init(w)
    opt.step_(w, {"w": g.clone()}, state, count=1)
    want = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64) - 0.1 * g / (g.abs() + 1e-8)
    assert torch.allclose(w["w"], want, rtol=0, atol=1e-15)
    # second step with g = 0: m = 0.9 m1 (m1 = 0.1 g), v = 0.999 v1; t = 2
    m, v = 0.9 * 0.1 * g, 0.999 * 0.001 * g * g
    opt.step_(w, {"w": torch.zeros(3, dtype=torch.float64)}, state, count=2)
    want = want - 0.1 * (m / (1 - 0.9 ** 2)) / ((v / (1 - 0.999 ** 2)).sqrt() + 1e-8)
    assert torch.allclose(w["w"], want, rtol=0, atol=1e-15)


# ----- SGD: bit for bit as before and as torch ------------------------------------------------------------------
@pytest.mark.parametrize("momentum, wd, clip", [(0.0, 0.0, None), (0.9, 0.0, None), (0.0, 1e-2, None),
                                                (0.9, 1e-5, None), (0.9, 1e-5, 0.5), (0.0, 0.0, 1e3)])
def test_sgd_chain_is_the_old_hand_wired_step_bit_for_bit(momentum, wd, clip):
    """One client's leaves, and the first rows of a stack updated in place through views (the stacked
    executor's active clients; per-client clip), against the old clip_by_global_norm_ + sgd_step_."""
    opt = chain(*([clip_by_global_norm(clip)] if clip else []), sgd(0.05, momentum, wd))
    p_new, p_old = _leaves(0), _leaves(0)
    s_new, b_old = opt.init(p_new), {k: torch.zeros_like(v) for k, v in p_old.items()}
    st_new, st_old = _leaves(1, (4,)), _leaves(1, (4,))
    ss_new, sb_old = opt.init(st_new), {k: torch.zeros_like(v) for k, v in st_old.items()}
    for step in range(1, 6):
        g = _leaves(10 + step)
        opt.step_(p_new, {k: v.clone() for k, v in g.items()}, s_new, count=step)
        g_old = {k: v.clone() for k, v in g.items()}
        if clip:
            _old_clip_(g_old, clip)
        _old_sgd_step_(p_old, g_old, b_old, 0.05, momentum, wd)
        a = 3 if step < 4 else 2  # clients still training: the first a rows
        gs = _leaves(20 + step, (a,))
        opt.step_({k: v[:a] for k, v in st_new.items()}, {k: v.clone() for k, v in gs.items()}, rows(ss_new, a),
                  count=step, per_client=True)
        gs_old = {k: v.clone() for k, v in gs.items()}
        if clip:
            _old_clip_(gs_old, clip, stacked=True)
        _old_sgd_step_({k: v[:a] for k, v in st_old.items()}, gs_old, {k: v[:a] for k, v in sb_old.items()}, 0.05,
                       momentum, wd)
    for k in p_new:
        if clip is None:
            assert torch.equal(p_new[k], p_old[k]) and torch.equal(st_new[k], st_old[k])
        else:  # the clip's norm: one foreach norm per leaf (row), then their norm; summed in another order
            torch.testing.assert_close(p_new[k], p_old[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(st_new[k], st_old[k], rtol=1e-6, atol=1e-7)
    assert torch.equal(st_new["w"][3], _leaves(1, (4,))["w"][3])  # a row never active is untouched


def _lockstep(ref, torch_opt, p, opt, state, steps):
    """``steps`` steps of ``torch_opt`` on ``ref`` and of the chain ``opt`` on ``p["w"]``, fed the
    same gradients (``_leaves(step)``, step 1..steps)."""
    for step in range(1, steps + 1):
        g = _leaves(step)["w"]
        ref.grad = g.clone()
        torch_opt.step()
        opt.step_(p, {"w": g.clone()}, state, count=step)


@pytest.mark.parametrize("momentum, wd", [(0.0, 0.0), (0.0, 0.01), (0.9, 0.0), (0.9, 0.01)])
def test_sgd_chain_is_torch_sgd_bit_for_bit(momentum, wd):
    w = _leaves(0)["w"]
    ref = w.clone().requires_grad_()
    torch_opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, weight_decay=wd)
    p, opt = {"w": w.clone()}, sgd(0.1, momentum, wd)
    _lockstep(ref, torch_opt, p, opt, opt.init(p), 4)
    assert torch.equal(p["w"], ref.detach()) and not torch.equal(p["w"], w)


# ----- Adam: torch.optim.Adam / AdamW ------------------------------------------------------------------------
@pytest.mark.parametrize("wd, decoupled", [(0.0, False), (0.01, False), (0.01, True)])
def test_adam_chain_is_torch_adam(wd, decoupled):
    """Up to float32 rounding (within 1e-6 relative after 6 steps): torch folds 1/(1 - b1^t) into
    the step size and adds with addcdiv; AdamW decays w before the step, the chain adds wd w to
    the direction (the same w - lr (dir + wd w), rounded differently)."""
    w = _leaves(0)["w"]
    ref = w.clone().requires_grad_()
    torch_opt = torch.optim.Adam([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd,
                                 decoupled_weight_decay=decoupled)
    p, opt = {"w": w.clone()}, adam(1e-2, 0.8, 0.99, 1e-6, wd, decoupled)
    assert opt.transforms[-2:] == ((add_decayed_weights(wd), scale(-1e-2)) if decoupled else
                                   (scale_by_adam(0.8, 0.99, 1e-6), scale(-1e-2)))
    state = opt.init(p)
    _lockstep(ref, torch_opt, p, opt, state, 6)
    torch.testing.assert_close(p["w"], ref.detach(), rtol=1e-6, atol=1e-7)
    if wd == 0 or decoupled:  # the moments see the gradients only: torch's in-place ops, bit for bit
        assert torch.equal(state[0]["mu"]["w"], torch_opt.state[ref]["exp_avg"])
        assert torch.equal(state[0]["nu"]["w"], torch_opt.state[ref]["exp_avg_sq"])


def test_adam_on_stack_rows_is_each_clients_own_adam():
    opt = chain(clip_by_global_norm(1.0), adam(1e-2, weight_decay=0.01))
    stack = _leaves(0, (3,))
    state = opt.init(stack)
    one = [{k: v[j].clone() for k, v in stack.items()} for j in range(3)]
    s_one = [opt.init(o) for o in one]
    for step in range(1, 5):
        a = 3 if step < 3 else 2
        g = _leaves(step, (a,))
        opt.step_({k: v[:a] for k, v in stack.items()}, {k: v.clone() for k, v in g.items()}, rows(state, a),
                  count=step, per_client=True)
        for j in range(a):
            opt.step_(one[j], {k: v[j].clone() for k, v in g.items()}, s_one[j], count=step)
    for j in range(3):
        for k in stack:
            torch.testing.assert_close(stack[k][j], one[j][k], rtol=1e-6, atol=1e-7)


# ----- what a phase declares -------------------------------------------------------------------------------------
SGD_RUN = OptimizerConfig()  # lr 0.01, momentum 0.9, weight decay 1e-5
ADAM_RUN = OptimizerConfig(name="adam", lr=1e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.0)


def test_run_optimizer_builds_the_runs_chain_with_the_phases_changes():
    build = lambda spec, run=SGD_RUN: phase_optimizer(Phase(optimizer=spec), run, 0.02, ["model"])["model"]  # noqa: E731
    assert build(RunOptimizer()) == sgd(0.02, 0.9, 1e-5)  # the round's lr, the run's momentum and decay
    assert build(RunOptimizer(lr=0.5, lr_scale=0.5, momentum=0.0, weight_decay=0.0)) == sgd(0.25)
    assert build(RunOptimizer(max_grad_norm=5.0)) == chain(clip_by_global_norm(5.0), sgd(0.02, 0.9, 1e-5))
    assert build(sgd(0.3)) == sgd(0.3) and build(scale(-1.0)) == chain(scale(-1.0))  # explicit: as given
    assert build(RunOptimizer(), ADAM_RUN) == adam(0.02, 0.8, 0.99, 1e-7)
    assert build(RunOptimizer(momentum=0.0, weight_decay=0.1), ADAM_RUN) == adam(0.02, 0.8, 0.99, 1e-7, 0.1)
    decoupled = ADAM_RUN.model_copy(update={"decoupled_weight_decay": True, "weight_decay": 0.1})
    assert build(RunOptimizer(), decoupled) == adam(0.02, 0.8, 0.99, 1e-7, 0.1, decoupled_weight_decay=True)
    assert build(sgd(0.3), ADAM_RUN) == sgd(0.3)  # an explicit SGD stays SGD on an Adam run
    with pytest.raises(ValueError, match=r"where, tree 'model': momentum 0.9 is SGD's.*adam"):
        phase_optimizer(Phase(optimizer=RunOptimizer(momentum=0.9)), ADAM_RUN, 0.02, ["model"], "where")


def test_per_tree_declarations():
    ph = Phase(trainable={"a": None, "b": None}, optimizer={"b": RunOptimizer(lr_scale=2.0, momentum=0.0)})
    chains = phase_optimizer(ph, SGD_RUN, 0.01, ["a", "b"])
    assert chains == {"a": sgd(0.01, 0.9, 1e-5), "b": sgd(0.02, 0.0, 1e-5)}  # a tree not named: the run's
    with pytest.raises(ValueError, match=r"m, phase 'p': optimizer for \['c'\], which the phase does not train"):
        phase_optimizer(Phase(optimizer={"c": sgd(0.1)}), SGD_RUN, 0.01, ["a"], "m, phase 'p'")
    with pytest.raises(TypeError, match="optimizer must be a RunOptimizer, a chain or a transformation"):
        phase_optimizer(Phase(optimizer=0.1), SGD_RUN, 0.01, ["a"])


def test_the_phase_has_one_optimizer_field():
    fields = set(Phase.__dataclass_fields__)
    assert "optimizer" in fields and not fields & {"lr", "lr_scale", "momentum", "weight_decay", "max_grad_norm"}


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_declares_chains_that_build_on_sgd_and_adam_runs(method):
    algo = make_algo(method, model=model_for(method), model_args=ZOO[model_for(method)].tiny_args)
    for r in (0, 2):
        rnd = RoundInfo(round=r, rounds=3, lr=0.01, num_clients=5, seed=1, base_lr=0.01, batch_size=8)
        for ph in [*algo.phases(rnd), *algo.adaptation_phases(rnd)]:
            for run in (SGD_RUN, ADAM_RUN):
                chains = phase_optimizer(ph, run, rnd.lr, list(ph.trainable), f"{method}, phase {ph.name!r}")
                assert set(chains) == set(ph.trainable) and all(c.lr is not None for c in chains.values())


# ----- per-tree settings in one phase, both executors, against a hand computation -------------------------------
TARGET = {"a": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.25, 3.0, -1.0])}


def _quadratic(trees, ctx, batch):
    """0.5 ||w_t - target_t||^2 summed over both trees: the gradient of tree t is w_t - target_t."""
    return sum(0.5 * torch.sum((trees[t]["w"] - TARGET[t]) ** 2) for t in ("a", "b"))


def _by_hand(w0, steps, lr, momentum, wd, clip=None):
    """float64: d = g + wd w; b = m b + d; w -= lr b, g = w - target (clipped to norm ``clip``)."""
    out = {}
    for t in ("a", "b"):
        w, b = w0[t].double().clone(), torch.zeros(3, dtype=torch.float64)
        for _ in range(steps):
            g = w - TARGET[t].double()
            c = clip.get(t) if clip else None
            if c is not None:
                g = g * min(1.0, c / (float(g.norm()) + 1e-6))
            d = g + wd[t] * w
            b = momentum[t] * b + d
            w = w - lr[t] * b
        out[t] = w
    return out


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_two_trees_with_their_own_momentum_decay_lr_and_clip(fed_data, executor):
    """Tree a: the run's SGD (momentum 0.9, weight decay 1e-5) at the round's lr; tree b: momentum
    0.5, weight decay 0.1, twice the lr and clipped at norm 1. Clients with different numbers of
    steps (one epoch of batches of 16 over train sets of different sizes)."""
    ph = Phase(name="two", trainable={"a": None, "b": None}, loss=_quadratic, epochs=1, batch_size=16,
               optimizer={"b": RunOptimizer(lr_scale=2.0, momentum=0.5, weight_decay=0.1, max_grad_norm=1.0)})
    rnd = RoundInfo(round=0, rounds=1, lr=0.05, num_clients=fed_data.num_clients, seed=1, base_lr=0.05)
    algo = SimpleNamespace(name="toy", forward=SimpleNamespace(parts={}, buffers=()), local_loss=None)
    train = TrainConfig(batch_size=16, local_epochs=1)
    clients = [0, 1, 2, 3, 4]
    g = torch.Generator().manual_seed(0)
    w0 = [{t: {"w": torch.randn(3, generator=g) * 3} for t in ("a", "b")} for _ in clients]
    if executor == "sequential":
        ex = SequentialExecutor(fed_data, train, seed=1, eval_batch_size=256)
        out, steps = [], []
        for c in clients:
            trees, n = ex._run_phase(algo, ph, {t: {"w": v["w"].clone()} for t, v in w0[c].items()}, {}, {},
                                     fed_data.client_train[c], c, rnd)
            out.append(trees)
            steps.append(n)
    else:
        ex = StackedExecutor(fed_data, train, seed=1, eval_batch_size=256)
        groups = [fed_data.client_train[c] for c in clients]
        ids, _ = _pad_ids(groups)
        stacked = {t: {"w": torch.stack([w[t]["w"] for w in w0])} for t in ("a", "b")}
        plan, = ex._phase_plans(algo, [ph], {}, {}, [len(x) for x in groups], clients, rnd)
        trees, steps = ex._run_phase_stacked(algo, ph, plan, stacked, {}, {}, {}, ids, rnd), plan.steps_k
        out = [{t: {"w": trees[t]["w"][j]} for t in trees} for j in range(len(clients))]
    assert len(set(steps)) > 1  # the rows of clients that are done are left alone
    for j, c in enumerate(clients):
        want = _by_hand({t: w0[c][t]["w"] for t in ("a", "b")}, steps[j], lr={"a": 0.05, "b": 0.1},
                        momentum={"a": 0.9, "b": 0.5}, wd={"a": 1e-5, "b": 0.1}, clip={"a": None, "b": 1.0})
        for t in ("a", "b"):
            torch.testing.assert_close(out[j][t]["w"].double(), want[t], rtol=1e-5, atol=1e-5)


# ----- an Adam run ----------------------------------------------------------------------------------------------
def _run(fed_data, executor, optimizer):
    model = "cnn4"
    algo = make_algo("fedavg", model=model, model_args=ZOO[model].tiny_args)
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0, model=model,
                        model_args=ZOO[model].tiny_args, optimizer=optimizer)
    return Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor, fingerprint="optim").run()


def test_fedavg_with_adam_agrees_on_both_executors(fed_data):
    """Records as in ``test_contract.test_stacked_equals_sequential``; the global model within 2e-5
    except a handful of entries (6 of 1.6M on an AMD EPYC) within a tenth of one step (lr 1e-3):
    Adam divides each gradient by its running RMS, so an entry whose gradient is at rounding-noise
    level (an fc input that is almost never active) steps by an amount set by that noise, which
    the executors' different summation orders change. SGD scales such noise by lr instead."""
    opt = OptimizerConfig(name="adam", lr=1e-3, momentum=None)
    seq, stk = _run(fed_data, "sequential", opt), _run(fed_data, "stacked", opt)
    pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]), stk.records.drop(columns=["loss"]))
    np.testing.assert_allclose(seq.records["loss"].to_numpy(), stk.records["loss"].to_numpy(), rtol=1e-4, atol=1e-4)
    assert_trees_close(seq.server, stk.server, atol=1e-4)  # a tenth of lr
    diff = torch.cat([(seq.server["model"][k] - stk.server["model"][k]).abs().reshape(-1) for k in seq.server["model"]])
    assert int((diff > 2e-5).sum()) <= 1e-5 * diff.numel()
    sgd_run = _run(fed_data, "sequential", OptimizerConfig(lr=1e-3))
    assert not torch.allclose(sgd_run.server["model"]["fc.weight"], seq.server["model"]["fc.weight"], atol=1e-6)


# ----- train.optimizer ------------------------------------------------------------------------------------------
def _params(optimizer: dict):
    return validate_params({"train": {"optimizer": optimizer}}, "overlay.yaml")


def test_adam_is_a_valid_run_optimizer_and_its_defaults_are_kingma_and_ba():
    o = _params({"name": "adam", "lr": 1e-3}).train.optimizer
    assert (o.name, o.momentum, o.betas, o.eps, o.decoupled_weight_decay) == ("adam", None, (0.9, 0.999), 1e-8, False)
    dumped = o.model_dump(mode="json")
    assert dumped == {"name": "adam", "lr": 1e-3, "weight_decay": 1e-5, "lr_decay": 0.99}  # defaults not dumped
    assert OptimizerConfig.model_validate(dumped) == o
    w = _params({"name": "adam", "lr": 1e-3, "betas": [0.5, 0.9], "decoupled_weight_decay": True}).train.optimizer
    assert w.model_dump(mode="json")["betas"] == [0.5, 0.9] and w.model_dump()["decoupled_weight_decay"] is True


@pytest.mark.parametrize("optimizer, key, message", [
    ({"name": "adam", "momentum": 0.9}, "train.optimizer.momentum", "applies to name: sgd only.*momentum: null"),
    ({"name": "sgd", "momentum": None}, "train.optimizer.momentum", "sgd needs a number"),
    ({"betas": [0.9, 0.99]}, "train.optimizer.betas", "applies to name: adam only"),
    ({"eps": 1e-6}, "train.optimizer.eps", "applies to name: adam only"),
    ({"decoupled_weight_decay": True}, "train.optimizer.decoupled_weight_decay", "applies to name: adam only"),
    ({"name": "adam", "betas": [0.9, 1.0]}, "train.optimizer.betas", r"in \[0, 1\)"),
    ({"name": "rmsprop"}, "train.optimizer.name", "sgd.*adam"),
])
def test_optimizer_keys_that_do_not_apply_are_errors_naming_the_key(optimizer, key, message):
    with pytest.raises(ParamsError, match=rf"{key}: .*{message}"):
        _params(optimizer)


def test_the_sgd_job_description_is_unchanged():
    """Existing configs dump exactly the keys they dumped before Adam existed (train_job's train)."""
    assert OptimizerConfig().model_dump(mode="json") == {"name": "sgd", "lr": 0.01, "momentum": 0.9,
                                                         "weight_decay": 1e-5, "lr_decay": 0.99}
    assert set(TrainConfig().model_dump()["optimizer"]) == {"name", "lr", "momentum", "weight_decay", "lr_decay"}
