"""Batch plans drawn on the device (``train.sampling.plans: device``,
:func:`medpfl.fl.program.device_plans`): the hash by hand, the layout of
:func:`~medpfl.fl.program.phase_plan`, draws keyed per client, and both executors on them."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from hypothesis import given, strategies as st

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.program import Phase, device_plan_bounds, device_plan_steps, device_plans, mix64, phase_plan
from tests.conftest import assert_trees_close, make_algo

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function on Python ints (Steele, Lea & Flood, OOPSLA 2014)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_mix64_is_splitmix64_in_wrapping_int64():
    """The first output of SplitMix64 seeded 0 is 0xE220A8397B1DCDAF (the published value), and
    the int64 tensor version equals the Python-int one bit for bit, high bit set or not."""
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    xs = [0, 1, 12345, (1 << 62) + 7, (1 << 63) - 1]
    got = mix64(torch.tensor(xs, dtype=torch.int64))
    assert [int(v) & MASK for v in got] == [splitmix64(x) for x in xs]


def draw(sizes, epochs, bs, phase=Phase(name="train"), seeds=None, clients=None, round_idx=0):
    m = len(sizes)
    seeds = seeds or [1] * m
    clients = clients or list(range(m))
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return device_plans(t(sizes), t(epochs), t(seeds), t(clients), round_idx, bs, phase,
                        *device_plan_bounds(sizes, epochs, bs, phase))


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5), bs=st.integers(1, 9),
       epochs=st.integers(0, 3), steps=st.one_of(st.none(), st.integers(1, 12)), shuffle=st.booleans())
def test_layout_is_phase_plans(sizes, bs, epochs, steps, shuffle):
    """Each client's rows: the layout of phase_plan (same shape, -1 at the same places), every
    epoch a permutation of its positions (in stored order without shuffle), -1 after its steps."""
    ph = Phase(name="train", steps=steps, shuffle=shuffle)
    plan = draw(sizes, [epochs] * len(sizes), bs, ph)
    for j, n in enumerate(sizes):
        k = device_plan_steps(n, bs, epochs, ph)
        assert (plan[j, k:] == -1).all()
        if epochs <= 0:
            assert k == 0
            continue
        ref = phase_plan(n, bs, epochs, 1, 0, j, ph)
        mine = plan[j, :k]
        assert mine.shape == ref.shape and torch.equal(mine < 0, ref < 0)
        per = -(-n // bs)
        for e in range(-(-k // per)):
            block = mine[e * per:(e + 1) * per].reshape(-1)
            vals = block[block >= 0]
            full = (e + 1) * per <= k
            if full:
                assert sorted(vals.tolist()) == list(range(n))
            if not shuffle:
                assert vals.tolist() == list(range(len(vals)))


def test_a_clients_plan_is_its_own_whatever_its_companions():
    """Client 7's plan (seed 3, round 5) is the same drawn alone, beside others, in another row,
    or by another seed's row of a stacked-seeds draw; another client, seed, round or phase name
    draws another plan."""
    alone = draw([23], [2], 4, seeds=[3], clients=[7], round_idx=5)[0]
    crowd = draw([9, 23, 40], [1, 2, 2], 4, seeds=[1, 3, 2], clients=[2, 7, 7], round_idx=5)
    k = device_plan_steps(23, 4, 2, Phase(name="train"))
    assert torch.equal(crowd[1, :k], alone[:k])
    assert not torch.equal(crowd[2, :k], alone[:k])  # client 7 of seed 2
    for other in (dict(seeds=[3], clients=[8], round_idx=5), dict(seeds=[4], clients=[7], round_idx=5),
                  dict(seeds=[3], clients=[7], round_idx=6)):
        assert not torch.equal(draw([23], [2], 4, **other)[0, :k], alone[:k]), other
    assert not torch.equal(draw([23], [2], 4, Phase(name="finetune"), seeds=[3], clients=[7], round_idx=5)[0, :k],
                           alone[:k])
    assert not torch.equal(alone[:6], alone[6:12])  # a new order every epoch


def test_orders_are_uniform_enough():
    """Over 4,000 client draws of n = 4, each position takes each slot about equally often
    (chi-square well inside 3 sigma: 16 cells of expectation 1,000)."""
    plan = draw([4] * 4000, [1] * 4000, 4, clients=list(range(4000)))[:, 0, :]  # [4000, 4]
    counts = torch.stack([(plan == v).sum(0) for v in range(4)]).to(torch.float64)
    chi2 = ((counts - 1000.0) ** 2 / 1000.0).sum().item()
    assert chi2 < 9 + 3 * (2 * 9) ** 0.5, counts  # 9 degrees of freedom


def test_subset_windows_stay_on_the_host():
    with pytest.raises(ValueError, match="host"):
        draw([10], [1], 4, Phase(name="train", subset=0.5))


def _run(fed_data, method, executor, **train):
    t = TrainConfig(rounds=2, participation=0.6, local_epochs=2, batch_size=16, model="mlp",
                    sampling={"plans": "device"}, **train)
    return Engine(make_algo(method, model="mlp"), fed_data, t, EvalConfig(), seed=1, executor_kind=executor).run()


@pytest.mark.parametrize("method", ["fedavg", "fedkper", "ditto"])
def test_both_executors_train_on_the_device_plans_alike(fed_data, method):
    """Both executors draw the same device plans: counts equal, losses and states within the
    executors' tolerance; the stacked executor in chunks of 2 clients too; the default (host)
    plans give another run."""
    seq = _run(fed_data, method, "sequential")
    stk = _run(fed_data, method, "stacked")
    chunked = _run(fed_data, method, "stacked", stack_clients=2)
    cols = ["round", "view", "client_id", "n_samples", "accuracy"]
    for other in (stk, chunked):
        pd.testing.assert_frame_equal(seq.records[cols], other.records[cols])
        torch.testing.assert_close(torch.tensor(seq.records["loss"].to_numpy()),
                                   torch.tensor(other.records["loss"].to_numpy()), atol=1e-4, rtol=1e-4)
        assert_trees_close(seq.server, other.server, atol=2e-5, rtol=1e-4)
    host = Engine(make_algo(method, model="mlp"), fed_data,
                  TrainConfig(rounds=2, participation=0.6, local_epochs=2, batch_size=16, model="mlp"), EvalConfig(),
                  seed=1, executor_kind="sequential").run()
    assert not host.records["loss"].equals(seq.records["loss"])


def test_default_plans_are_not_written_into_job_descriptions():
    assert "plans" not in TrainConfig().model_dump()["sampling"]
    assert TrainConfig(sampling={"plans": "device"}).model_dump()["sampling"]["plans"] == "device"
    with pytest.raises(ValueError, match="plans"):
        TrainConfig(sampling={"plans": "gpu"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_cpu_plans():
    """The hash wraps alike on CUDA: the same keys give the same plans there as on the CPU."""
    sizes, epochs, seeds, clients = [23, 9, 40], [2, 3, 1], [1, 2, 3], [4, 5, 6]
    ph = Phase(name="train")
    cpu = draw(sizes, epochs, 4, ph, seeds, clients, round_idx=7)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    gpu = device_plans(t(sizes), t(epochs), t(seeds), t(clients), 7, 4, ph, *device_plan_bounds(sizes, epochs, 4, ph))
    assert torch.equal(gpu.cpu(), cpu)
