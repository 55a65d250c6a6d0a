"""Fixed-shape local steps (issue 32): the stacked executor's steps run all m rows of the stack
with an ``active`` mask instead of the shrinking prefix of clients that still have batches; a
finished client's parameters, BatchNorm buffers and optimizer buffers are restored with
``torch.where``. The records equal the shrinking (default) path within the executors'
float tolerance (:func:`tests.test_contract.assert_runs_agree`'s defaults: the active rows see the
same arithmetic, only batched kernels of another size, i.e. fp32 summation order; the lone tail
client of the shrinking path runs unbatched).

Also the static-step layer of ``train.cuda_graphs`` (:class:`medpfl.fl.graphs._StaticStep`)
with the capture replaced by a plain call: same records over 2 rounds, buffers allocated in the
first round only."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from medpfl.config import EvalConfig, OptimizerConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.models import ZOO
from tests.conftest import make_algo
from tests.test_contract import COST, assert_runs_agree, cached, model_for
from tests.test_device_placement import emu_data  # noqa: F401  (a fixture)

#: FedAvg, a proximal term (FedProx), a shared teacher with a per-client clip (FedKPer), a
#: personal model trained in a second tree (Ditto), a contrastive loss on per-client context
#: (MOON), control variates (SCAFFOLD), BatchNorm buffers (FedBN on cnn4bn), inner steps
#: (pFedMe), a projection after each step (APFL's mixing weight)
METHODS = ("fedavg", "fedprox", "fedkper", "ditto", "moon", "scaffold", "fedbn", "pfedme", "apfl")


def _run(fed_data, method: str, mode: str, optimizer: OptimizerConfig | None = None, rounds: int = 2,
         executor_out: list | None = None):
    """One stacked run; ``mode``: "shrinking" (default), "fixed" (masked, eager) or "static"
    (masked, on the static buffers with the capture a plain call)."""
    model = model_for(method)
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, device=fed_data.device,
                     **COST.get(method, {}))
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0,
                        model=model, model_args=ZOO[model].tiny_args, executor="stacked",
                        **({"optimizer": optimizer} if optimizer is not None else {}))
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="stacked", fingerprint="fixed-shape")
    ex = eng.clients.executor
    if mode == "fixed":
        ex._fixed_shape_steps = True
    elif mode == "static":
        ex._static_steps = True
    if executor_out is not None:
        executor_out.append(ex)
    return eng.run()


def test_the_clients_have_unequal_step_counts(fed_data):
    """The comparison below exercises the masking: the clients' step counts differ."""
    sizes = {len(g) for g in fed_data.client_train}
    assert len(sizes) > 1, sizes


@pytest.mark.parametrize("method", METHODS)
def test_fixed_shape_steps_give_the_shrinking_records(fed_data, method):
    """Against the contract's own stacked run of the method (same job; cached, so a suite run
    trains the shrinking reference once)."""
    _, shrinking = cached(fed_data, method, "stacked")
    assert_runs_agree(shrinking, _run(fed_data, method, "fixed"))


def test_fixed_shape_adam_with_clipping(fed_data):
    """Adam's moments and count on the finished rows (FedKPer clips its gradients)."""
    adam = OptimizerConfig(name="adam", lr=0.01)
    assert_runs_agree(_run(fed_data, "fedkper", "shrinking", adam), _run(fed_data, "fedkper", "fixed", adam))


def test_static_steps_equal_eager_and_allocate_once(fed_data):
    """The static-step layer (capture replaced by a plain call) over 3 rounds of FedAvg: the
    records of the eager fixed-shape path within 1e-6 (the static buffers keep the layout a leaf
    took at the first step of the run, see _like_grad, where the eager path starts each phase
    from contiguous stacks: the first forward of a phase reads the weights in another layout,
    4e-8 apart here); its buffers are allocated in the first round (and re-laid out there once)
    and the same tensor objects serve every later round; the step is "captured" (a plain call
    here) after its warm-up steps."""
    eager = _run(fed_data, "fedavg", "fixed", rounds=3)
    by_round: list[dict] = []
    model = model_for("fedavg")
    algo = make_algo("fedavg", model=model, model_args=ZOO[model].tiny_args, device=fed_data.device)
    train = TrainConfig(rounds=3, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0,
                        model=model, model_args=ZOO[model].tiny_args, executor="stacked")
    eng = Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind="stacked", fingerprint="fixed-shape")
    ex = eng.clients.executor
    ex._static_steps = True
    real = ex._train_stacked

    def spy(*a, **kw):
        out = real(*a, **kw)
        by_round.append({key: ({p: id(t) for p, t in st.store.items()}, st.allocations, st.graph is not None)
                         for key, st in ex.__dict__.get("_static_cache", {}).items()})
        return out

    ex._train_stacked = spy
    static = eng.run()
    assert_runs_agree(eager, static, loss_atol=1e-6, server_atol=1e-6, state_atol=1e-6, rtol=1e-6)
    assert len(by_round) == 3
    # the same (m, B) every round here (3 of 5 clients): one static step for FedAvg's one phase
    assert len(by_round[0]) == 1, list(by_round[0])
    (key,) = by_round[0]
    first, second, third = (r[key] for r in by_round)
    assert first[1] > 0
    assert second[0] == third[0] and second[1] == third[1]  # the same buffer objects, no new allocation
    assert set(first[0]) == set(second[0])
    assert third[2], "no graph (plain call) after 3 rounds"


# ----- the pieces, without a run --------------------------------------------------------------
def _masked_step_on(w0: torch.Tensor, active: torch.Tensor, sample_w: torch.Tensor):
    """One ``_masked_step`` of SGD with momentum on the loss ``sum(w^2) * sum(b) / sum(b)`` (0/0,
    i.e. NaN, on a row whose batch weights are all 0)."""
    from types import SimpleNamespace

    from torch.func import vmap

    from medpfl.fl.optim import sgd
    from medpfl.fl.stacked import StackedExecutor

    ex = StackedExecutor.__new__(StackedExecutor)
    ex.train = TrainConfig()
    t = {"model": {"w": w0.clone()}}
    opts = {"model": sgd(0.1, momentum=0.9)}
    states = {"model": opts["model"].init(t["model"])}
    loss_fn = vmap(lambda tr, c, b: (tr["model"]["w"] ** 2).sum() * b["w"].sum() / b["w"].sum(), in_dims=(0, None, 0))
    count = torch.zeros((), dtype=torch.int64)
    ex._masked_step(SimpleNamespace(name="toy"), SimpleNamespace(name="local", trainable={"model": "all"}), t, {},
                    states, {"w": sample_w}, active, {"model": ["w"]}, [("model", "w")], {"model": ["w"]}, opts, count,
                    {}, loss_fn, None)
    return t["model"]["w"], states["model"], count


def test_a_finished_row_is_restored_even_when_its_loss_is_nan():
    """The finished row (weights 0: its loss 0/0) keeps its parameters and its momentum buffer
    bit for bit; the active rows take the SGD step; a mask multiplied in would spread the NaN."""
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    active = torch.tensor([True, False, True])
    sample_w = torch.tensor([[0.5, 0.5], [0.0, 0.0], [1.0, 0.0]])
    w, state, count = _masked_step_on(w0, active, sample_w)
    assert torch.equal(w[1], w0[1])
    trace = state[0]["trace"]["w"]
    assert torch.equal(trace[1], torch.zeros(2))
    torch.testing.assert_close(w[[0, 2]], w0[[0, 2]] - 0.1 * 2 * w0[[0, 2]])
    assert torch.isfinite(w).all() and torch.isfinite(trace).all()
    assert int(count) == 1


def test_static_step_buffers_warm_up_capture_and_replay():
    """_StaticStep on the CPU: buffers allocated on the first load only (a new shape reallocates
    and drops the graph), 2 eager warm-up steps then the (plain-call) graph replayed, and a
    change of the phase's baked-in constants drops the graph."""
    from types import SimpleNamespace

    from medpfl.fl.graphs import _PlainCall, _StaticStep

    st = _StaticStep(("toy", "local", 3, 4), torch.device("cpu"), capture=False)
    a = st.load("trees", {"m": {"w": torch.ones(3, 2)}, "x": [torch.zeros(3)]})
    b = st.load("trees", {"m": {"w": torch.full((3, 2), 2.0)}, "x": [torch.ones(3)]})
    assert a["m"]["w"] is b["m"]["w"] and a["x"][0] is b["x"][0] and st.allocations == 2
    assert torch.equal(b["m"]["w"], torch.full((3, 2), 2.0))
    calls, eager = [], []
    st.check_signature(("sgd", 0.9))
    for _ in range(4):
        st.run(lambda: calls.append(1), SimpleNamespace(name="toy"), SimpleNamespace(name="local"),
               lambda: eager.append(1))
    assert len(calls) == 4 and len(eager) == 2 and isinstance(st.graph, _PlainCall)
    st.check_signature(("sgd", 0.9))
    assert st.graph is not None
    st.check_signature(("sgd", 0.5))
    assert st.graph is None and st.warmed == 0
    st.run(lambda: None, SimpleNamespace(name="toy"), SimpleNamespace(name="local"), lambda: None)
    st.run(lambda: None, SimpleNamespace(name="toy"), SimpleNamespace(name="local"), lambda: None)
    st.run(lambda: None, SimpleNamespace(name="toy"), SimpleNamespace(name="local"), lambda: None)
    assert st.graph is not None
    st.begin_phase()
    st.load("trees", {"m": {"w": torch.ones(3, 2)}})  # an entry less: the graph read "x" too
    st.run(lambda: None, SimpleNamespace(name="toy"), SimpleNamespace(name="local"), lambda: None)
    assert st.graph is None and st.warmed == 1
    st.load("trees", {"m": {"w": torch.ones(4, 2)}, "x": [torch.zeros(3)]})  # another shape
    assert st.graph is None and st.allocations == 3


@pytest.mark.parametrize("flag", ["_fixed_shape_steps", "_static_steps"])
@pytest.mark.parametrize("method", ["fedavg", "fedbn"])
def test_fixed_shape_steps_on_the_emulated_device(emu_data, fed_data, method, flag, monkeypatch):
    """The fixed-shape steps (eager, and on the static buffers) keep every tensor on the
    accelerator and make no host synchronisation inside the local steps (the placement test's
    emulated device, ``tests/test_device_placement.py``); the records are the CPU's in the same
    mode."""
    from medpfl.fl.stacked import StackedExecutor
    from tests.test_device_placement import _emulated_round, _round, host_tensors

    monkeypatch.setattr(StackedExecutor, flag, True)
    res, mode = _emulated_round(emu_data, method, "stacked", monkeypatch)
    left = host_tensors(res.server, "server") + host_tensors(res.client_states, "client_states")
    assert not left, f"tensors on the CPU after the round: {left[:5]}"
    assert mode.ops["local steps"] > 0
    pd.testing.assert_frame_equal(res.records, _round(fed_data, method, "stacked", "cpu").records)
