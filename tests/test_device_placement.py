"""The GPU path proven on a CPU (issue 32): one round of every registered method, on both
executors, with every tensor on an accelerator.

Without a GPU the accelerator is emulated (:mod:`medpfl.fl.emulated_device`): the data set,
the model, the optimizer buffers, the masks and the records' counts live on the ``emu`` device
(values held on the CPU), and the run fails

* on any op that mixes a tensor on the device with one left on the CPU
  (:class:`~medpfl.fl.emulated_device.DevicePlacementError`: what CUDA reports as "Expected all
  tensors to be on the same device"; a 0-dim CPU tensor too, which CUDA would accept);
* on the stacked executor, on any host synchronisation between the round's first and last local
  step (:func:`medpfl.fl.stacked.local_steps`): a value read on the host (``.item()``,
  ``int(t)``, ``bool(t)``, ``.tolist()``), a value-dependent shape (``nonzero``, boolean
  indexing), a copy to or from the host (:class:`~medpfl.fl.emulated_device.HostSyncError`).

The round is the contract test's (``tests/test_contract.py``: 5 synthetic clients, 3 sampled, 1
local epoch, the method's contract model), one round with evaluation; its records equal the CPU
run's exactly (the emulation computes with the CPU kernels), and every tensor of the server
state, the client states and the personalized models is still on the device after it. Two
deliberately broken variants (a method that builds a CPU tensor in its objective; a host read
in the stacked step loop) must fail, so the test can fail.

On a CUDA GPU (``gpu`` marker, skipped without one) the same rounds run on ``cuda`` with
``torch.cuda.set_sync_debug_mode("error")`` around the stacked executor's local steps.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd
import pytest
import torch

import medpfl.fl.stacked as stacked
from medpfl.algorithms import REGISTRY
from medpfl.config import EvalConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.emulated_device import (DevicePlacementError, EmulatedDevice, HostSyncError, host_tensors,
                                       register_device)
from medpfl.fl.engine import Engine
from medpfl.models import ZOO
from tests.conftest import cuda_sync_errors, make_algo
from tests.test_contract import _train, model_for

#: fewer local iterations for the methods whose defaults run 20 (x 5) steps per client and round:
#: the same code paths (placement does not depend on how many times a step runs), a fraction of
#: the cost under the emulator's Python dispatch (pFedMe took 37 s per executor at its defaults)
COST = {"pfedme": {"local_steps": 2, "inner_steps": 2}, "perfedavg": {"local_steps": 2},
        "pfedkdwcl": {"local_steps": 2}}

# Registered when this module is collected, i.e. before any test of the session runs a backward
# pass: autograd's engine sizes its per-device ready queues when it first starts, and a device
# type registered after that has none ("device_ready_queues_ ... INTERNAL ASSERT FAILED" in a full
# suite run, where other tests train first).
register_device()

METHODS = sorted(REGISTRY)
STACKABLE = [m for m in METHODS if REGISTRY[m].not_stackable_because is None]

#: methods whose round cannot run with every tensor on the device, with the reason (none today)
XFAIL: dict[tuple[str, str], str] = {}


def _table(processed):
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition

    pool = processed.samples[processed.samples["split"] == "train"]
    val = processed.samples[processed.samples["split"] == "val"]
    cfg = partition_config(num_clients=5, alpha=0.5, seed=1, min_samples=20, server_data={"count": 20})
    return build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "t",
                           val=(val["sample_id"].to_numpy(), val["label"].to_numpy()))


@pytest.fixture(scope="module")
def emu_data(synthetic_processed):
    """``tests/conftest.py``'s ``fed_data`` built directly on the emulated device."""
    with EmulatedDevice():
        return FederatedData.build(synthetic_processed, _table(synthetic_processed), register_device())


def _round(data, method, executor, device):
    """One engine round (evaluated) of ``method`` on ``executor`` with the data on ``device``."""
    model = model_for(method)
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, device=device, **COST.get(method, {}))
    train = _train(model=model, model_args=ZOO[model].tiny_args, rounds=1, checkpoint_every=0)
    return Engine(algo, data, train, EvalConfig(every=1), seed=1, executor_kind=executor,
                  fingerprint="placement").run()


def _emulated_round(emu_data, method, executor, monkeypatch):
    """The round under :class:`EmulatedDevice`, host syncs forbidden in the stacked local steps;
    returns ``(result, mode)``."""
    mode = EmulatedDevice()
    monkeypatch.setattr(stacked, "local_steps", lambda: mode.no_sync("local steps"))
    with mode:
        res = _round(emu_data, method, executor, emu_data.device)
    return res, mode


def _cases():
    for m in METHODS:
        for ex in ("sequential", "stacked"):
            if ex == "stacked" and m not in STACKABLE:
                continue
            marks = [pytest.mark.xfail(reason=XFAIL[(m, ex)], strict=True)] if (m, ex) in XFAIL else []
            yield pytest.param(m, ex, marks=marks, id=f"{m}-{ex}")


@pytest.mark.parametrize("method, executor", list(_cases()))
def test_round_keeps_every_tensor_on_the_device(emu_data, fed_data, method, executor, monkeypatch):
    res, mode = _emulated_round(emu_data, method, executor, monkeypatch)
    left = (host_tensors(res.server, "server") + host_tensors(res.client_states, "client_states")
            + host_tensors(res.personalized, "personalized") + host_tensors(res.global_params, "global"))
    assert not left, f"tensors on the CPU after the round: {left[:5]}"
    assert mode.ops["local steps"] > 0 or executor == "sequential", "the stacked local steps did not run in the hook"
    ref = _round(fed_data, method, executor, "cpu")  # the same round on the CPU: the same records
    pd.testing.assert_frame_equal(res.records, ref.records)


def test_a_cpu_tensor_in_the_objective_fails(emu_data, monkeypatch):
    """A method whose objective builds a tensor on the CPU (here: a constant [1] added to the
    loss) fails on both executors."""
    real = REGISTRY["fedavg"].local_loss

    def leaky(self, trees, ctx, batch):
        return (real(self, trees, ctx, batch) + torch.zeros(1)).sum()

    monkeypatch.setattr(REGISTRY["fedavg"], "local_loss", leaky)
    for executor in ("sequential", "stacked"):
        with pytest.raises(DevicePlacementError, match="CPU tensor"):
            _emulated_round(emu_data, "fedavg", executor, monkeypatch)


def test_a_cpu_batch_plan_fails(emu_data, monkeypatch):
    """Mini-batch positions left on the CPU (the plan not moved to the device) fail."""
    monkeypatch.setattr(stacked, "_to_device", lambda plans, device: [
        p.place(*(t.view(t.shape) for t in p.host_parts())) for p in plans])
    with pytest.raises(DevicePlacementError):
        _emulated_round(emu_data, "fedavg", "stacked", monkeypatch)


def test_a_host_read_in_the_stacked_step_loop_fails(emu_data, monkeypatch):
    """A value read on the host inside the stacked local steps (here: the batch's sample count)
    fails; the same read outside them does not."""
    real = stacked.StackedExecutor._gather_sctx

    def reads(self, sctx, pos, a):
        int(pos.sum())
        return real(self, sctx, pos, a)

    monkeypatch.setattr(stacked.StackedExecutor, "_gather_sctx", reads)
    with pytest.raises(HostSyncError, match="value read on the host"):
        _emulated_round(emu_data, "fedavg", "stacked", monkeypatch)
    monkeypatch.setattr(stacked.StackedExecutor, "_gather_sctx", real)
    plans = stacked.StackedExecutor._phase_plans

    def reads_before(self, *args):  # after the plans' one copy, before the first local step
        out = plans(self, *args)
        int(out[0].pos.sum())
        return out

    monkeypatch.setattr(stacked.StackedExecutor, "_phase_plans", reads_before)
    _, mode = _emulated_round(emu_data, "fedavg", "stacked", monkeypatch)
    assert mode.syncs[("outside", "value read on the host")] >= 1


# ----- host synchronisations of a round outside local training --------------------------------
def _syncs_per_round(emu_data, method, executor, monkeypatch, rounds=2):
    """Host syncs of each round of a ``rounds``-round run on the emulated device outside the
    executor's local training (the server side, the divergence guard, the evaluation and its
    records, the byte counts): a list per round of Counter ``{(kind, file): n}``. The run's
    set-up (initial model, schedule on the device) is not in any round: a round's count is the
    difference between two of the engine's end-of-round callbacks."""
    from medpfl.fl.executors import SequentialExecutor

    mode = EmulatedDevice(record_sites=True)
    monkeypatch.setattr(stacked, "local_steps", lambda: mode.no_sync("local steps"))
    for cls in (SequentialExecutor, stacked.StackedExecutor):
        real = cls.__dict__["train_clients"]

        def wrapped(*a, _real=real, **kw):
            with mode.region("local training"):
                return _real(*a, **kw)

        monkeypatch.setattr(cls, "train_clients", wrapped)
    marks: list[Counter] = []
    model = model_for(method)
    with mode:
        algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, device=emu_data.device,
                         **COST.get(method, {}))
        train = _train(model=model, model_args=ZOO[model].tiny_args, rounds=rounds, checkpoint_every=0)
        eng = Engine(algo, emu_data, train, EvalConfig(every=1), seed=1, executor_kind=executor, fingerprint="syncs",
                     callbacks=[lambda r, row, recs: marks.append(Counter(mode.sites))])
        eng.run()
    per_round = []
    for a, b in zip(marks, marks[1:]):
        c: Counter = Counter()
        for (region, kind, site), n in (b - a).items():
            if region == "outside":
                c[(kind, site.split(":")[0])] += n  # by file: several lines of one file add up
        per_round.append(c)
    return per_round


#: what a round may synchronise outside local training: the one host copy of its records, the
#: divergence guard's flags and the low-rank byte counts (fl/tree.py to_host)
ONE_COPY = Counter({("device-to-host copy", "src/medpfl/fl/tree.py"): 1})


@pytest.mark.parametrize("method, executor", [("fedavg", "stacked"), ("fedavg", "sequential"), ("fedmic", "stacked"),
                                              ("ditto", "stacked")])
def test_a_round_copies_its_records_to_the_host_once(emu_data, method, executor, monkeypatch):
    """Outside local training a round (the second of the run: no set-up in it; evaluated, with
    val splits) makes one host synchronisation: one device-to-host copy of every record count,
    the guard's flags and (FedMIC) the ranks its bytes_up and bytes_down depend on. A per-view
    ``.cpu()`` of the counts, a read of the guard's flags, an ``int()`` of a rank, a
    ``repeat_interleave`` without ``output_size`` or an index tensor copied per round fails here."""
    per_round = _syncs_per_round(emu_data, method, executor, monkeypatch)
    assert per_round and all(c == ONE_COPY for c in per_round), per_round


def test_a_guard_read_in_the_round_is_counted(emu_data, monkeypatch):
    """The count above sees an immediate read of the guard's flags (the defect it guards
    against): the check's reads come back, each a value read on the host."""
    import medpfl.fl.engine as engine
    from medpfl.fl.tree import first_false

    real = engine.DivergenceFlags.check

    def read_now(self, when, trees):
        real(self, when, trees)
        first_false(*self._checks[-1][1:])

    monkeypatch.setattr(engine.DivergenceFlags, "check", read_now)
    per_round = _syncs_per_round(emu_data, "fedavg", "stacked", monkeypatch)
    assert per_round[0][("value read on the host", "src/medpfl/fl/tree.py")] == 2, per_round


def test_to_host_copies_every_tensor_bit_for_bit_in_one_copy():
    """:func:`medpfl.fl.tree.to_host`: one device-to-host copy for tensors of several dtypes and
    shapes (a NaN with a payload, -0.0, bools, int64 beyond 2**53, a 0-dim tensor, an empty
    one); CPU tensors pass through without a copy."""
    from medpfl.fl.tree import to_host

    nan = torch.tensor([0x7FF8_0000_DEAD_BEEF], dtype=torch.int64).view(torch.float64)
    host = [torch.cat([nan, torch.tensor([-0.0, 1.5])]), torch.tensor([True, False, True]),
            torch.tensor([2**60 + 1, -3]), torch.tensor(7.25, dtype=torch.float32), torch.zeros(0, 4),
            torch.arange(6, dtype=torch.int16).view(2, 3)]
    cpu_one = torch.ones(2)
    mode = EmulatedDevice()
    with mode:
        dev = [t.to(register_device()) for t in host]
        mode.syncs.clear()
        out = to_host(dev + [cpu_one])
    assert sum(mode.syncs.values()) == 1 and mode.syncs[("outside", "device-to-host copy")] == 1
    assert out[-1] is cpu_one
    for got, want in zip(out, host):
        assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
def test_the_stacked_step_count_and_lr_are_device_tensors(emu_data, monkeypatch):
    """The stacked step loop hands every optimizer step its step number as a 0-dim int64 tensor and
    its -lr as a 0-dim float32 tensor on the accelerator, the same tensors at every step, the count
    incremented in place (no Python number that changes per step; CUDA-graph capture). The
    sequential executor keeps Python scalars."""
    from medpfl.fl.optim import Chain

    seen = []
    real = Chain.step_

    def spy(self, params, grads, state, count, per_client=False, scale=None):
        seen.append((count, scale))
        return real(self, params, grads, state, count, per_client, scale)

    monkeypatch.setattr(Chain, "step_", spy)
    _emulated_round(emu_data, "fedavg", "stacked", monkeypatch)
    assert len(seen) > 1 and all(isinstance(c, torch.Tensor) and isinstance(s, torch.Tensor) for c, s in seen)
    assert len({id(c) for c, _ in seen}) == 1 and len({id(s) for _, s in seen}) == 1, "new tensors per step"
    c, s = seen[0]
    assert c.device.type == s.device.type == emu_data.device.type
    assert c.dim() == s.dim() == 0 and c.dtype == torch.int64 and s.dtype == torch.float32
    seen.clear()
    _emulated_round(emu_data, "fedavg", "sequential", monkeypatch)
    assert seen and all(isinstance(c, int) and s is None for c, s in seen)


# ----- on a real GPU ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_data(synthetic_processed):
    return FederatedData.build(synthetic_processed, _table(synthetic_processed), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method, executor", list(_cases()))
def test_round_on_cuda_without_host_syncs_in_the_local_steps(cuda_data, method, executor, monkeypatch):
    monkeypatch.setattr(stacked, "local_steps", cuda_sync_errors)
    res = _round(cuda_data, method, executor, torch.device("cuda"))
    leaves = [t for tree in (res.server, res.client_states) for t in torch.utils._pytree.tree_leaves(tree)
              if isinstance(t, torch.Tensor)]
    assert all(t.device.type == "cuda" for t in leaves)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_clock_times_cuda_work_without_a_synchronize():
    """The engine's round timing on CUDA: events recorded with no host sync in between (the
    sync debug mode raises on one), read after the work."""
    from medpfl.fl.engine import RoundClock

    clock = RoundClock(torch.device("cuda"))
    with cuda_sync_errors():
        a = clock.mark()
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            x = torch.tanh(x @ x)
        b = clock.mark()
    assert 0.0 < clock.seconds(a, b) < 60.0


@pytest.mark.parametrize("plans", ["host", "device"])
def test_batch_plans_reach_the_device_in_one_copy(emu_data, fed_data, plans, monkeypatch):
    """A stacked FedKPer round with ``train.sampling.plans`` host or device: drawing the round's
    plans makes exactly one host synchronisation (the one host-to-device copy: the host plans, or
    the device draw's keys), none in the local steps; the records equal the same round on the
    CPU."""
    mode = EmulatedDevice()
    monkeypatch.setattr(stacked, "local_steps", lambda: mode.no_sync("local steps"))
    real = stacked.StackedExecutor._phase_plans

    def counted(self, *a, **kw):
        with mode.region("plans"):
            return real(self, *a, **kw)

    monkeypatch.setattr(stacked.StackedExecutor, "_phase_plans", counted)

    def run(data, device):
        train = _train(model="cnn4", rounds=1, checkpoint_every=0, sampling={"plans": plans})
        return Engine(make_algo("fedkper", device=device), data, train, EvalConfig(every=1), seed=1,
                      executor_kind="stacked", fingerprint="plans").run()

    with mode:
        res = run(emu_data, emu_data.device)
    assert {k: v for k, v in mode.syncs.items() if k[0] == "plans"} == {("plans", "host-to-device copy"): 1}
    pd.testing.assert_frame_equal(res.records, run(fed_data, "cpu").records)
