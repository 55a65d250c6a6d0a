"""Evaluation batched by memory (``eval.memory_fraction``, medpfl.fl.memory; issue 32)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl import memory
from medpfl.fl.engine import Engine
from medpfl.fl.memory import EvalSizer, ForwardCost, LiveBytes, measure_peak_bytes, probe_cost
from medpfl.fl.stacked import StackedExecutor
from tests.conftest import make_algo


def test_live_bytes_by_hand():
    """Storages created under the mode, counted once while any tensor on them lives: 250 float32 =
    1000 bytes each; a view adds nothing and keeps its base's storage alive."""
    with LiveBytes() as mode:
        a = torch.empty(250)
        b = a * 2  # 2000 live
        del a  # 1000
        c = b + 1  # 2000 again
        v = c.view(5, 50)  # a view: no new storage
        assert mode.live == 2000
        del c  # v keeps the storage
        assert mode.live == 2000
        del v
        assert mode.live == 1000
        d = torch.cat([b, b, b])  # 3000 more: 4000, the peak
        del b, d
    assert mode.peak == 4000 and mode.live == 0


def test_inputs_made_before_the_mode_are_not_counted():
    x = torch.ones(1000)
    with LiveBytes() as mode:
        y = x + 1
    assert mode.peak == 4000
    del y


@pytest.mark.parametrize("budget, m, longest, want", [
    (10_000, 5, 20, (5, 20)),   # everything fits in one forward
    (400, 4, 100, (4, 65)),     # room 300: 4 models x 65 (2 forwards) ties 2 x 100 (2 forwards): the most models
    (300, 50, 100, (3, 56)),    # room 200: 3 x 56 = 298 -> 17 x 2 = 34 forwards, fewer than any other pair
    (50, 50, 100, (1, 1)),      # below one model on one sample: the smallest forward there is
])
def test_forward_cost_plan_by_hand(budget, m, longest, want):
    """bytes = 100 + 10 models + 1 samples-in-all (worked by hand: 300 bytes, m = 50, longest 100:
    1 x 100 -> 50 forwards, 2 x 90 -> 50, 3 x 56 -> 34, 4 x 40 -> 39, 5 x 30 -> 40, 6 x 23 -> 45,
    7 x 18 -> 48, ...; 18 x 1 -> 300; 19 models leave no sample)."""
    assert ForwardCost(100.0, 10.0, 1.0).plan(budget, m, longest) == want


def _stacked(fed_data, k, seed=0):
    algo = make_algo("fedavg")
    eng = Engine(algo, fed_data, TrainConfig(), EvalConfig(), seed=1, executor_kind="stacked")
    one = eng.initial_params()
    gen = torch.Generator().manual_seed(seed)
    models = tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape) + 0.05 * torch.randn(k, *t.shape, generator=gen)
                      if t.is_floating_point() else t.unsqueeze(0).expand(k, *t.shape), one)
    return algo, models


def test_the_probed_cost_predicts_a_larger_forward(fed_data):
    """The affine cost from three small probes (2 models on 16 and 32 samples each, 4 on 16)
    predicts the peak of a chunk's forward (its models' copy included) of 4 models on 4 x 40
    samples (cnn4, vmapped) within 15 %."""
    algo, models = _stacked(fed_data, 4)
    ids = fed_data.client_train[0]
    fwd = torch.vmap(algo.predict)
    cost = probe_cost(fwd, models, fed_data.x, ids, "cpu")
    assert cost.per_sample > 0 and cost.per_model > 0
    s = ids[torch.arange(160) % len(ids)].view(4, 40)
    rows = torch.arange(4)
    peak = measure_peak_bytes(lambda: fwd(tree_map(lambda t: t.index_select(0, rows), models), fed_data.x(s)), "cpu")
    assert cost.bytes(4, 160) == pytest.approx(peak, rel=0.15), (cost, peak)


@pytest.mark.parametrize("models_fit", [1, 3])
def test_stacked_evaluation_by_memory_keeps_the_counts_and_stays_in_budget(fed_data, monkeypatch, models_fit):
    """With a budget of ``models_fit`` models on 4 samples each, the stacked executor evaluates the
    5 models in chunks that the cost model fits in the budget, the whole evaluation's measured
    peak within it (up to the model's error), and its counts equal the fixed-batch evaluation's;
    the losses within float tolerance."""
    algo, models = _stacked(fed_data, 5)
    k = fed_data.num_clients
    ref = StackedExecutor(fed_data, TrainConfig(), seed=1, eval_batch_size=1024).evaluate_models(
        algo, models, fed_data.client_test)
    ex = StackedExecutor(fed_data, TrainConfig(), seed=1, eval_batch_size=1024, eval_memory_fraction=0.5)
    cost = ex.eval_sizer.cost(algo.predict, models, fed_data.x, fed_data.client_test[0])
    budget = cost.bytes(models_fit, 4 * models_fit) + 1
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * budget)
    real, forwards = ex._evaluate_stacked, []

    def spy(algo, sub, groups, chunk):
        forwards.append((len(groups), chunk))
        return real(algo, sub, groups, chunk)

    monkeypatch.setattr(ex, "_evaluate_stacked", spy)
    with LiveBytes() as mode:
        got = ex.evaluate_models(algo, models, fed_data.client_test)
    mc, n, b = ex.eval_sizer.last
    assert b == budget and cost.bytes(mc, mc * n) <= budget and (mc < k or n < 1024 // k)
    assert [f[0] for f in forwards] == [min(mc, k - a) for a in range(0, k, mc)] and {f[1] for f in forwards} == {n}
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2], atol=1e-6, rtol=1e-6)
    assert mode.peak <= 1.15 * budget, (mode.peak, budget)


def test_a_generous_budget_evaluates_every_model_in_one_forward_each_chunk(fed_data, monkeypatch):
    algo, models = _stacked(fed_data, 5)
    ex = StackedExecutor(fed_data, TrainConfig(stack_clients=2), seed=1, eval_batch_size=8, eval_memory_fraction=0.5)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10 ** 12)
    ex.evaluate_models(algo, models, fed_data.client_test)
    longest = max(len(g) for g in fed_data.client_test)
    assert ex.eval_sizer.last[:2] == (5, longest)  # stack_clients and batch_size do not bound evaluation here


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_a_run_with_memory_fraction_gives_the_default_runs_records(fed_data, monkeypatch, executor):
    """Ditto (global and personalized views; mlp: about 1.2 MB a model, 10 KB a sample) over 2
    rounds with 1.3 MB to spend, so that each forward takes fewer samples than the smallest test
    split (14): the records' counts are the default run's, the losses within 1e-6."""
    runs = {}
    for frac in (None, 0.5):
        if frac is not None:
            monkeypatch.setattr(memory, "free_bytes", lambda device: 2_600_000)
        t = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, model="mlp")
        eng = Engine(make_algo("ditto", model="mlp"), fed_data, t, EvalConfig(memory_fraction=frac), seed=1,
                     executor_kind=executor)
        runs[frac] = eng.run()
        if frac is not None:
            sizer = eng.executor.eval_sizer
            assert sizer.by_memory and sizer.last is not None and sizer.last[1] < 14, sizer.last
    a, b = runs[None].records, runs[0.5].records
    assert len(a) == len(b) > 0
    assert list(a["view"]) == list(b["view"]) and list(a["client_id"]) == list(b["client_id"])
    assert list(a["correct"]) == list(b["correct"]) and list(a["n_samples"]) == list(b["n_samples"])
    torch.testing.assert_close(torch.tensor(a["loss"].to_numpy()), torch.tensor(b["loss"].to_numpy()),
                               atol=1e-6, rtol=1e-6)


def test_memory_fraction_is_not_dumped_at_its_default_and_is_validated():
    """Jobs written before the key existed keep their descriptions; a value is dumped; 0 and
    values above 0.9 are errors naming the key."""
    assert "memory_fraction" not in EvalConfig().model_dump()
    assert EvalConfig(memory_fraction=0.5).model_dump()["memory_fraction"] == 0.5
    for bad in (0, 0.95):
        with pytest.raises(ValueError, match="memory_fraction"):
            EvalConfig(memory_fraction=bad)


def test_free_bytes_on_the_cpu_is_the_hosts_available_memory():
    import psutil

    got = memory.free_bytes("cpu")
    assert 0 < got <= psutil.virtual_memory().total


def test_the_sizer_without_a_fraction_is_the_fixed_batch(fed_data):
    algo, models = _stacked(fed_data, 5)
    s = EvalSizer(64, None, "cpu")
    assert s.stacked(algo.predict, models, fed_data.x, fed_data.client_test) == (5, 12)
    assert s.one(algo.predict, tree_map(lambda t: t[0], models), fed_data.x, [fed_data.client_test[0]]) == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_probe_is_the_allocators_and_a_stacked_evaluation_stays_in_budget(fed_data, synthetic_processed,
                                                                                        monkeypatch):
    """On a GPU: the cost probed with the CUDA allocator's peak; a stacked evaluation of 5 models
    under a budget of 2 models on 8 samples each peaks (``max_memory_allocated`` above what was
    allocated before) within 1.15x the budget, with the counts of the fixed-batch evaluation."""
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition
    from medpfl.fl.data import FederatedData

    dev = torch.device("cuda")
    pool = synthetic_processed.samples[synthetic_processed.samples["split"] == "train"]
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                            partition_config(num_clients=5, alpha=0.5, seed=1, min_samples=20), "t")
    data = FederatedData.build(synthetic_processed, table, dev)
    algo, models = _stacked(fed_data, 5)
    models = tree_map(lambda t: t.to(dev), models)
    ref = StackedExecutor(data, TrainConfig(), seed=1, eval_batch_size=1024).evaluate_models(algo, models, data.client_test)
    ex = StackedExecutor(data, TrainConfig(), seed=1, eval_batch_size=1024, eval_memory_fraction=0.5)
    cost = ex.eval_sizer.cost(algo.predict, models, data.x, data.client_test[0])
    budget = cost.bytes(2, 16) + 1
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * budget)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = ex.evaluate_models(algo, models, data.client_test)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 1.15 * budget
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
