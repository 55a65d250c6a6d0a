"""On a CUDA GPU (skipped without one): the GPU paths agree with the CPU reference.

FedAvg and FedKPer for three rounds on the synthetic set: the CPU sequential executor (the
reference), the CUDA sequential and the CUDA stacked executor (what ``executor: auto`` picks on
a GPU) give the same accuracies within float tolerance, and bf16 autocast runs in bfloat16 (the
dtypes the training forward's convolutions and matrix products receive) and stays close.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from tests.conftest import make_algo, record_train_compute_dtypes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(processed, table, method, device, executor, precision="fp32", seen=None):
    """The run's records; ``seen`` (a list) receives the dtypes the training forward's convolutions
    and matrix products compute in (:func:`~tests.conftest.record_train_compute_dtypes`)."""
    data = FederatedData.build(processed, table, torch.device(device))
    train = TrainConfig(rounds=3, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0,
                        device=device, precision=precision)
    algo = make_algo(method)
    if seen is not None:
        seen.append(record_train_compute_dtypes(algo))
    eng = Engine(algo, data, train, EvalConfig(every=1), seed=1, executor_kind=executor, fingerprint="gpu-test")
    return eng.run().records


@pytest.fixture(scope="module")
def table(synthetic_processed):
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition

    pool = synthetic_processed.samples[synthetic_processed.samples["split"] == "train"]
    cfg = partition_config(num_clients=5, alpha=0.5, seed=1, min_samples=20)
    return build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "t")


@pytest.mark.parametrize("method", ["fedavg", "fedkper"])
def test_cuda_executors_match_the_cpu_reference(synthetic_processed, table, method):
    ref = _run(synthetic_processed, table, method, "cpu", "sequential")
    for executor in ("sequential", "stacked"):
        got = _run(synthetic_processed, table, method, "cuda", executor)
        assert list(got["view"]) == list(ref["view"]) and list(got["client_id"]) == list(ref["client_id"])
        # accuracies are counts over a few hundred samples: at most a sample or two may flip
        assert np.abs(got["accuracy"].to_numpy() - ref["accuracy"].to_numpy()).max() <= 0.02, executor


def test_bf16_autocast_runs_and_stays_close(synthetic_processed, table):
    seen: list = []
    ref = _run(synthetic_processed, table, "fedavg", "cuda", "stacked", seen=seen)
    got = _run(synthetic_processed, table, "fedavg", "cuda", "stacked", precision="bf16", seen=seen)
    # the training forward's convolutions and matrix products ran in the precision asked for
    fp32, bf16 = ({dt for _, dts in s for dt in dts} for s in seen)
    assert fp32 == {torch.float32} and bf16 == {torch.bfloat16}
    assert np.isfinite(got["loss"].to_numpy()).all()
    assert abs(got["accuracy"].mean() - ref["accuracy"].mean()) <= 0.05
