"""``train.cuda_graphs`` (issue 32): the switch's checks on any machine, and on a CUDA GPU
(skipped without one) the captured local steps against the eager stacked run.

What runs without a GPU: the config refuses the switch with the sequential executor or a CPU
device (``medpfl check-params``, ``tests/test_cli_errors.py``), and a run refuses it for a
method that cannot be stacked or a device that is not CUDA (:func:`medpfl.fl.engine.make_executor`).
The buffers, copies and graph cache themselves are exercised on the CPU with the capture
replaced by a plain call (``tests/test_fixed_shape.py``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl import stacked
from medpfl.fl.engine import Engine, make_executor
from medpfl.models import ZOO
from tests.conftest import cuda_sync_errors, make_algo


def test_config_refuses_cuda_graphs_without_the_stacked_executor_or_cuda():
    with pytest.raises(ValueError, match="train.cuda_graphs.*sequential"):
        TrainConfig(cuda_graphs=True, executor="sequential")
    with pytest.raises(ValueError, match="train.cuda_graphs.*cpu"):
        TrainConfig(cuda_graphs=True, device="cpu")
    assert TrainConfig(cuda_graphs=True).cuda_graphs  # auto executor, auto device: decided at the run
    assert "cuda_graphs" not in TrainConfig().model_dump()  # old job descriptions unchanged
    assert TrainConfig(cuda_graphs=True).model_dump()["cuda_graphs"] is True


def test_a_method_that_cannot_be_stacked_is_refused(fed_data):
    """FedALA's adaptive aggregation trains until its loss converges (an ``until`` rule: a host
    read per step): not stackable, so not capturable; refused, naming the key and the reason."""
    algo = make_algo("fedala", device=fed_data.device)
    train = TrainConfig(cuda_graphs=True, model="cnn4")
    with pytest.raises(ValueError, match="train.cuda_graphs.*fedala.*cannot be stacked"):
        make_executor("auto", algo, fed_data, train, seed=1, eval_batch_size=64)


def test_a_cpu_device_is_refused_at_the_run(fed_data):
    algo = make_algo("fedavg", device=fed_data.device)
    with pytest.raises(ValueError, match="train.cuda_graphs.*not CUDA"):
        make_executor("stacked", algo, fed_data, TrainConfig(cuda_graphs=True), seed=1, eval_batch_size=64)


# ----- on a real GPU ------------------------------------------------------------------------
def _cuda_run(cuda_data, method: str, graphs: bool, monkeypatch=None):
    """(engine, result, number of strict local-step contexts) of three rounds of ``method`` on the
    stacked executor on CUDA. With ``monkeypatch``: once every static step of the executor has
    been captured, the local steps (replays and their input copies) run under
    ``torch.cuda.set_sync_debug_mode("error")`` (the capture itself synchronises, as
    ``torch.cuda.graph`` does)."""
    algo = make_algo(method, model="cnn4", model_args=ZOO["cnn4"].tiny_args, device=cuda_data.device)
    train = TrainConfig(rounds=3, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0, device="cuda",
                        model="cnn4", model_args=ZOO["cnn4"].tiny_args, executor="stacked", cuda_graphs=graphs)
    eng = Engine(algo, cuda_data, train, EvalConfig(every=1), seed=1, executor_kind="stacked", fingerprint="graphs")
    strict_calls = []
    if monkeypatch is not None:
        ex = eng.clients.executor

        @contextlib.contextmanager
        def strict():
            cache = ex.__dict__.get("_static_cache", {})
            if not cache or any(st.graph is None for st in cache.values()):
                yield
                return
            strict_calls.append(1)
            with cuda_sync_errors():
                yield

        monkeypatch.setattr(stacked, "local_steps", strict)
    return eng, eng.run(), len(strict_calls)


@pytest.fixture(scope="module")
def cuda_data(synthetic_processed):
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition
    from medpfl.fl.data import FederatedData

    pool = synthetic_processed.samples[synthetic_processed.samples["split"] == "train"]
    cfg = partition_config(num_clients=5, alpha=0.5, seed=1, min_samples=20)
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "t")
    return FederatedData.build(synthetic_processed, table, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["fedavg", "fedkper"])
def test_cuda_graphs_match_the_eager_stacked_run(cuda_data, method, monkeypatch):
    """Captured and replayed local steps give the eager stacked run's records (same views and
    clients; accuracies within a sample or two: the fixed-shape batched kernels sum in another
    order than the shrinking ones), a graph per phase was captured and replayed, and once every
    phase is captured the local steps (replays and their input copies) run without a host
    synchronisation (``torch.cuda.set_sync_debug_mode("error")``)."""
    _, ref, _ = _cuda_run(cuda_data, method, graphs=False)
    eng, got, strict = _cuda_run(cuda_data, method, graphs=True, monkeypatch=monkeypatch)
    assert strict >= 1, "no round ran on captured graphs only"
    cache = eng.clients.executor.__dict__.get("_static_cache", {})
    assert cache and all(isinstance(st.graph, torch.cuda.CUDAGraph) for st in cache.values()), cache
    a, b = ref.records, got.records
    assert list(a["view"]) == list(b["view"]) and list(a["client_id"]) == list(b["client_id"])
    assert np.abs(a["accuracy"].to_numpy() - b["accuracy"].to_numpy()).max() <= 0.02
    np.testing.assert_allclose(a["loss"].to_numpy(), b["loss"].to_numpy(), rtol=1e-3, atol=1e-3)
