"""Shared fixtures: a throw-away MLflow store per test, and small synthetic federated data."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")

REPO = Path(__file__).resolve().parents[1]

# Property tests draw the same examples on every run (a test command that passes once passes
# again: a CI run once drew a new failing case at random). HYPOTHESIS_PROFILE=explore draws new
# random examples on each run, to look for cases the fixed draw misses; a failure it finds
# belongs in the test as an @example.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
_hyp_settings.register_profile("explore", derandomize=False, print_blob=True)
_hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))
SHARED_BLOOD = REPO.parent / "shared" / "data" / "medmnist" / "bloodmnist.npz"


@pytest.fixture(autouse=True)
def _isolated_tracking(tmp_path, monkeypatch):
    """Never write mlflow.db/mlruns.db into the repository from a test; never download a folder
    data set (MEDPFL_OFFLINE; tests/test_folder_download.py lifts it for its local server) nor
    write a download folder into the repository."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    monkeypatch.setenv("MEDPFL_OFFLINE", "1")
    monkeypatch.setenv("MEDPFL_DATA_DOWNLOAD", str(tmp_path / "external"))
    yield
    try:
        import mlflow

        mlflow.end_run()
        mlflow.set_tracking_uri(None)
    except Exception:
        pass


@pytest.fixture(scope="session")
def synthetic_processed(tmp_path_factory):
    """A preprocessed synthetic data set (4 classes, 3 channels, 28 px, 400 train images)."""
    from medpfl.data.preprocess import load_processed, preprocess
    from medpfl.data.synthetic import write_synthetic_npz

    d = tmp_path_factory.mktemp("synth")
    write_synthetic_npz(d / "synth.npz", num_classes=4, n_channels=3, size=28, counts=(400, 40, 120), seed=0)
    preprocess(d / "synth.npz", d / "arrays.npz", d / "samples.parquet", 4, 3)
    return load_processed(d / "arrays.npz", d / "samples.parquet")


def make_fed_data(processed, num_clients=5, alpha=0.5, seed=1, min_samples=20, server_data=None):
    """server_data: ``partitions.<name>.server_data`` (e.g. ``{"count": 20}``), None for none; with
    the train pool the clients' partition is the same either way (the server's draw has its own
    stream)."""
    from medpfl.config import partition_config
    from medpfl.data.partition import build_partition
    from medpfl.fl.data import FederatedData

    pool = processed.samples[processed.samples["split"] == "train"]
    val = processed.samples[processed.samples["split"] == "val"]
    cfg = partition_config(num_clients=num_clients, alpha=alpha, seed=seed, min_samples=min_samples,
                          server_data=server_data)
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "t",
                            val=(val["sample_id"].to_numpy(), val["label"].to_numpy()))
    return FederatedData.build(processed, table, torch.device("cpu"))


@pytest.fixture(scope="session")
def fed_data(synthetic_processed):
    """5 clients, Dirichlet(0.5), on the synthetic set, on the CPU; the server holds 20 unlabeled
    samples of the val split (``server_data: {count: 20}``; only FedBE reads them)."""
    return make_fed_data(synthetic_processed, server_data={"count": 20})


@contextlib.contextmanager
def cuda_sync_errors():
    """Make any host-device synchronisation inside the block raise (CUDA only):
    ``torch.cuda.synchronize()`` first, so work queued before the block does not count, then
    ``torch.cuda.set_sync_debug_mode("error")`` until the block ends (back to ``"default"``, also
    on an error). Raises ``RuntimeError`` from torch on a synchronising call inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def make_algo(name, num_classes=4, model="cnn4", model_args=None, in_channels=3, image_size=28, device="cpu",
              **overrides):
    """Method ``name`` (with config ``overrides``) on a template of ``model`` placed as
    ``medpfl.train`` places it (:func:`~medpfl.fl.functional.template_on`: on ``device`` when the
    model has frozen weights, a ViT with LoRA; else on "meta"); the defaults fit ``fed_data``
    (3x28x28 images); ``image_size=None``: vectors of ``in_channels``."""
    from medpfl.algorithms import resolve_method
    from medpfl.fl.functional import make_forward, template_on
    from medpfl.models import build_model

    cls, cfg = resolve_method(name, {name: overrides} if overrides else {})
    module = template_on(build_model(model, in_channels, num_classes, image_size, model_args), device)
    return cls(cfg, make_forward(module), num_classes)


def initial_params(num_classes=4, seed=0):
    from medpfl.models import build_model

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_model("cnn4", 3, num_classes, 28).named_parameters()}


def batch_plan(n: int, batch_size: int, epochs: int, seed: int, round_idx: int, client: int) -> torch.Tensor:
    """The batch order of a client's local training written out plainly (the reference
    :func:`medpfl.fl.program.phase_plan` must give for the phase named ``train``): int64
    ``[epochs * ceil(n / batch_size), batch_size]`` positions into the client's local train set,
    each epoch a fresh ``torch.randperm`` from a generator seeded by ``("batches", seed, round,
    client)``, the last batch of an epoch padded with -1 (``DataLoader(shuffle=True,
    drop_last=False)``)."""
    from medpfl.fl.sampling import derive_seed

    steps = -(-n // batch_size)
    g = torch.Generator().manual_seed(derive_seed("batches", seed, round_idx, client))
    plan = torch.full((epochs, steps * batch_size), -1, dtype=torch.int64)
    for e in range(epochs):
        plan[e, :n] = torch.randperm(n, generator=g)
    return plan.view(epochs * steps, batch_size)


def phase_chains(ph, round_lr=0.01, **optimizer):
    """The optimizer chain per trained tree that the executors build for phase ``ph`` in a round of
    lr ``round_lr`` on a run whose ``train.optimizer`` is ``OptimizerConfig(**optimizer)`` (default:
    SGD, momentum 0.9, weight decay 1e-5)."""
    from medpfl.config import OptimizerConfig
    from medpfl.fl.optim import phase_optimizer

    return phase_optimizer(ph, OptimizerConfig(**optimizer), round_lr, list(ph.trainable))


def assert_trees_close(a, b, atol, rtol=0.0):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_trees_close(a[k], b[k], atol, rtol)
    else:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def record_train_compute_dtypes(algo) -> list[tuple[str, frozenset]]:
    """Spy on ``algo.train_forward`` (the forward of every local training step): the returned list
    receives ``(op, the dtypes of its tensor inputs)`` for each convolution and matrix product the
    forward runs, as the kernels receive them (a dispatch mode sees the physical tensors, also under
    ``vmap`` and after autocast's casts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    heavy = {aten.convolution, aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    seen: list[tuple[str, frozenset]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in heavy:
                seen.append((func.overloadpacket.__name__,
                             frozenset(t.dtype for t in args if isinstance(t, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    real = algo.train_forward

    def spy(params, batch):
        with Record():
            return real(params, batch)

    algo.train_forward = spy
    return seen


np.set_printoptions(precision=4, suppress=True)


def prepare_train_job(folder, *, method, seed=1, counts=(200, 20, 60), data_seed=2, num_clients=4, min_samples=10,
                      train=None, study="tests", mlflow=True, image_size=28):
    """A ready ``medpfl train`` job on a synthetic set in ``folder``: ``synth.npz`` (4 classes,
    3 x ``image_size`` x ``image_size``; ``counts`` = train/val/test), ``arrays.npz`` + ``samples.parquet``, a Dirichlet(1.0)
    ``partition.parquet`` over ``num_clients`` and, with ``mlflow``, a study parent
    (``parent.json``, SQLite store ``mlruns.db``). ``train`` overrides the params' train section.
    Returns ``(job, tracking uri or None)``."""
    jobs, uri = prepare_train_jobs(folder, methods=(method,), seeds=(seed,), counts=counts, data_seed=data_seed,
                                   num_clients=num_clients, min_samples=min_samples, train=train, study=study,
                                   mlflow=mlflow, image_size=image_size)
    return jobs[0], uri


def prepare_train_jobs(folder, *, methods, seeds=(1,), counts=(200, 20, 60), data_seed=2, num_clients=4,
                       min_samples=10, train=None, study="tests", mlflow=True, image_size=28):
    """:func:`prepare_train_job` for a study of ``methods`` x ``seeds`` on the same data and
    partition: returns ``([job for each method, then seed], tracking uri or None)``."""
    from medpfl.compose import validate_params
    from medpfl.config import train_job
    from medpfl.data.partition import build_partition
    from medpfl.data.preprocess import load_processed, preprocess
    from medpfl.data.synthetic import write_synthetic_npz
    from medpfl.io import md5sum, write_parquet

    d = Path(folder)
    write_synthetic_npz(d / "synth.npz", 4, 3, image_size, counts, seed=data_seed)
    preprocess(d / "synth.npz", d / "arrays.npz", d / "samples.parquet", 4, 3)
    data = load_processed(d / "arrays.npz", d / "samples.parquet")
    params = validate_params({
        "study": study,
        "data": {"datasets": ["synth"], "custom": {"synth": {"path": str(d / "synth.npz"), "md5": md5sum(d / "synth.npz"),
                                                             "n_channels": 3, "num_classes": 4}}},
        "partitions": [{"name": "p", "num_clients": num_clients, "alpha": 1.0, "min_samples": min_samples}],
        "methods": list(methods), "seeds": list(seeds),
        "train": {"participation": 1.0, "executor": "sequential", "device": "cpu", **(train or {})},
    })
    pool = data.samples[data.samples["split"] == "train"]
    write_parquet(d / "partition.parquet", build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                                                           params.partitions["p"], "p"))
    uri = None
    if mlflow:
        from medpfl.tracking import init_study

        uri = f"sqlite:///{d}/mlruns.db"
        init_study(study, study, d / "parent.json", uri=uri, artifact_root=d / "mlartifacts")
    return [train_job(params, "synth", "p", m, s) for m in methods for s in seeds], uri
