"""The federated round loop. The engine owns the loop, the schedule, the device, evaluation,
timing, communication accounting and checkpoints; the algorithm only declares its parts
(:class:`medpfl.algorithms.base.Algorithm`); the executor runs local training.

Round r:
  1. the pre-sampled clients S_r (shared by every method) receive ``algo.download(server, S_r)``
     (or every client the method trains, ``algo.training_clients``; only S_r is aggregated);
  2. the executor runs their local programs (lr = lr0 * lr_decay^r or the cosine schedule, fresh
     optimizer buffers each phase: fl/optim.py)
     and returns the models to score, the uploads and the new persistent client states;
  3. each client's model is scored on its local test split (``local_after_training``);
  4. the uploads are checked against the method's declared ``upload_spec`` (the privacy
     boundary); with ``train.upload`` / ``train.dp`` (:mod:`medpfl.fl.privacy`) the declared model
     upload's update is transformed as the clients would send it (clipping, noise, low-rank),
     checked again as it crosses, and decoded at the server (DP-FedAvg: the clipped mean plus the
     server's Gaussian noise, ε per round by opacus' accountant); the server aggregates them (``algo.aggregate``) into its next state (a method
     declaring ``uses_server_data`` reads the partition's unlabeled server images there, from
     ``algo.server_data``, attached once before the run; the clients never see them); with
     ``train.server_optimizer`` (:mod:`medpfl.fl.server_opt`) the server then steps the previous
     global model by FedAvgM/FedAdagrad/FedAdam/FedYogi on Δ = aggregate − previous (its state
     kept in the server state under ``"server_optimizer"``, so checkpointed with it);
  5. on evaluation rounds: the global model (where the method has one) on the global test set
     (where the data set has one) and on every local test split, and each personalized model on its local test split (after
     the method's ``adaptation_phases`` on the local train split, where it declares some);
  6. bytes up (the uploads as sent, compressed where they are) and down (the shared download
     once per recipient plus every per-client row) and wall time are logged; server and client
     states are checkpointed atomically every ``checkpoint_every`` rounds.

Divergence guard: the clients' uploads and new states (after step 2) and the server state (after
step 4) must be finite; the first NaN or ±inf stops the run with :class:`DivergenceError`
before the round is scored, logged or checkpointed, so the last checkpoint keeps the last good
state and no result file is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import torch

from medpfl.algorithms.base import Algorithm, check_required_parts
from medpfl.config import EvalConfig, TrainConfig, canonical_json
from medpfl.errors import DivergenceError, ParamsError
from medpfl.fl.data import FederatedData, ServerData, model_input
from medpfl.fl.evaluation import eval_groups, records_from_counts
from medpfl.fl.functional import Params, model_state
from medpfl.fl.payload import UploadSpecError, check_upload, payload_dense_nbytes, payload_nbytes
from medpfl.fl.privacy import make_upload_pipeline
from medpfl.fl.program import Federation, RoundInfo
from medpfl.fl.sampling import client_schedule, seeded_cpu_rng
from medpfl.fl.server_opt import make_server_optimizer
from medpfl.fl.tree import first_nonfinite, tree_index, tree_leaves, tree_scatter, tree_stack
from medpfl.io import atomic_path
from medpfl.models import build_model


log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. Raises ValueError if CUDA is asked for but absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    return dev


def make_executor(kind: str, algo: Algorithm, data: FederatedData, train: TrainConfig, seed: int, eval_batch_size: int):
    """``auto`` picks the stacked executor on CUDA where the method supports it, else the
    sequential one (on a CPU the sequential executor is already compute-bound and the grouped
    convolutions of the stacked one are slower: see ``benchmarks/README.md``)."""
    from medpfl.fl.executors import SequentialExecutor

    if kind == "auto":
        kind = "stacked" if algo.stackable and data.device.type == "cuda" else "sequential"
    if kind == "stacked":
        if not algo.stackable:
            raise ValueError(f"train.executor=stacked: method {algo.name!r} cannot be stacked "
                             f"({algo.not_stackable_because}); use auto or sequential")
        from medpfl.fl.stacked import StackedExecutor

        return StackedExecutor(data, train, seed, eval_batch_size)
    return SequentialExecutor(data, train, seed, eval_batch_size)


def require_server_data(algo: Algorithm, data: FederatedData, partition: str = "<name>") -> None:
    """Raises ParamsError, naming ``partitions.<partition>.server_data``, when ``algo`` declares
    ``uses_server_data`` and ``data`` has no server samples; nothing otherwise. The engine calls it
    before a run; ``medpfl train`` calls it earlier with the job's partition name."""
    if algo.uses_server_data and not getattr(data, "has_server_data", False):
        raise ParamsError(f"method {algo.name!r} distils on unlabeled server data and partition {partition!r} has "
                          f"none: set partitions.{partition}.server_data (e.g. {{source: val, fraction: 0.5}}) and "
                          "re-run the partition stage")


#: bump when the checkpoint layout or the engine's arithmetic changes (old checkpoints restart)
ENGINE_VERSION = 2

__all__ = ["DivergenceError", "Engine", "RunResult", "UploadSpecError", "check_upload", "fingerprint", "make_executor",
           "require_server_data", "resolve_device"]


@dataclass
class RunResult:
    """records/rounds: validated tables; server: the server state (``server["model"]`` is the
    global model for most methods); global_params: the global model, None where the method has
    none; client_states: stacked [K]; personalized: every client's personalized model (stacked
    [K]) where the method has them."""

    records: pd.DataFrame
    rounds: pd.DataFrame
    server: dict[str, Any]
    global_params: Params | None
    client_states: dict[str, Any]
    personalized: Any = None
    resumed_from: int = 0


@dataclass
class Engine:
    """One training job: a method on a partitioned data set with one seed.

    callbacks: ``fn(round_idx, round_row: dict, records: list[dict])`` after every round
    (tracking). checkpoint: path of the checkpoint file (None: no checkpoints).
    """

    algo: Algorithm
    data: FederatedData
    train: TrainConfig
    eval: EvalConfig
    seed: int
    executor_kind: str = "auto"
    checkpoint: Path | None = None
    callbacks: list[Callable] = field(default_factory=list)
    fingerprint: str = ""

    def __post_init__(self):
        check_required_parts(self.algo)  # before anything is built: one line naming method, part and model
        self._attach_server_data()
        data = self.data
        #: what the set-up hooks read about the federation (K, each client's local train size, C)
        self.federation = Federation(num_clients=data.num_clients,
                                     num_samples=tuple(int(len(t)) for t in data.client_train),
                                     num_classes=data.num_classes)
        self._has_val = any(len(v) for v in (getattr(self.data, "client_val", None) or []))
        self.executor = make_executor(self.executor_kind, self.algo, self.data, self.train, self.seed, self.eval.batch_size)
        self.server_opt = make_server_optimizer(self.train.server_optimizer, self.algo)  # None: the aggregate as is
        self.schedule = client_schedule(self.data.num_clients, self.train.participation, self.train.rounds,
                                        self.train.sampling.scheme,
                                        self.train.sampling.seed if self.train.sampling.seed is not None else self.seed)
        # train.upload / train.dp (fl/privacy.py): None leaves the round exactly as without them
        self.uploader = make_upload_pipeline(self.train, self.algo, self.data.num_clients, self.schedule.shape[1])

    def _attach_server_data(self) -> None:
        """The server-data hook: a method that declares ``uses_server_data`` gets the partition's
        unlabeled server samples as ``algo.server_data`` (:class:`~medpfl.fl.data.ServerData`:
        images only, never labels), for its server hooks (``aggregate``); a method that does not
        declare it gets nothing (``algo.server_data`` stays None). The client executors never
        see them. Raises ParamsError when the method needs server data and the partition has
        none."""
        if not self.algo.uses_server_data:
            return
        require_server_data(self.algo, self.data)
        self.algo.server_data = ServerData(self.data)

    # ---------------------------------------------------------------------------------------
    def initial_params(self) -> Params:
        torch.manual_seed(self.seed)
        model = build_model(self.train.model, self.data.in_channels, self.data.num_classes, self.data.image_size,
                            self.train.model_args, **model_input(self.data))
        return {k: v.to(self.data.device) for k, v in model_state(model).items()}

    def _sync(self):
        if self.data.device.type == "cuda":
            torch.cuda.synchronize(self.data.device)

    def _is_eval_round(self, r: int) -> bool:
        return (r + 1) % self.eval.every == 0 or r == self.train.rounds - 1

    def initial_client_states(self, params: Params) -> dict[str, Any]:
        """Every client's state at round 0, stacked [K]. For a method with ``seeded_client_init``,
        client c's is built with the CPU generator seeded from (seed, c)
        (:func:`~medpfl.fl.sampling.seeded_cpu_rng`, restored after), so a random draw in
        ``init_client_state`` is a function of the run seed and the client id only."""
        if not self.algo.seeded_client_init:
            return tree_stack([self.algo.init_client_state(params, c, self.federation)
                               for c in range(self.data.num_clients)])
        states = []
        for c in range(self.data.num_clients):
            with seeded_cpu_rng("client_state", self.seed, c):
                states.append(self.algo.init_client_state(params, c, self.federation))
        return tree_stack(states)

    def run(self) -> RunResult:
        algo, data, ex = self.algo, self.data, self.executor
        k = data.num_clients
        state = self._load_checkpoint()
        if state is None:
            params = self.initial_params()
            server = algo.init_server(params, self.federation)
            client_states = self.initial_client_states(params)
            records: list[dict] = []
            rounds: list[dict] = []
            start = 0
        else:
            server, client_states, records, rounds, start = state
            log.info("resuming from checkpoint %s at round %d", self.checkpoint, start)
        self._checkpointed = start if state is not None else 0  # rounds held by the checkpoint file
        for r in range(start, self.train.rounds):
            self._sync()
            t0 = time.perf_counter()
            clients = self.schedule[r]
            m = len(clients)
            cidx = torch.as_tensor(clients, device=data.device)
            rnd = self.round_info(r)
            trainers, agg_pos = self._training_clients(clients, rnd)
            tidx = torch.as_tensor(trainers, device=data.device)
            down = algo.download(server, tidx, rnd)
            for leaf in tree_leaves(down.per_client):
                if leaf.shape[:1] != (len(trainers),):
                    raise ValueError(f"method {algo.name!r}: a per-client download leaf has shape {tuple(leaf.shape)}; "
                                     f"its leading dim must be the {len(trainers)} clients that train this round")
            with self._linalg_guard(r, "in local training"):
                models, uploads, new_states = ex.train_clients(algo, down, tree_index(client_states, tidx), trainers,
                                                               rnd)
            self._check_finite(r, "after local training", {"upload": uploads, "client state": new_states})
            self._sync()
            t1 = time.perf_counter()
            new_records = records_from_counts(r, "local_after_training", trainers.tolist(),
                                              *ex.evaluate_models(algo, models, [data.client_test[c] for c in trainers]))
            if self._has_val and self._is_eval_round(r):  # model selection (FHBench protocol): same models, val splits
                new_records += records_from_counts(r, "local_after_training_val", trainers.tolist(),
                                                   *ex.evaluate_models(algo, models, [data.client_val[c] for c in trainers]))
            client_states = tree_scatter(client_states, tidx, new_states)
            if agg_pos is not None:  # only the sampled clients send (and are aggregated)
                uploads = tree_index(uploads, torch.as_tensor(agg_pos, device=data.device))
            check_upload(algo.name, algo.upload_spec(), uploads, m)
            sent = uploads  # what crosses (bytes_up), as the clients send it
            if self.uploader is not None:  # train.upload / train.dp: transforms at the clients, decoding at the server
                with self._linalg_guard(r, "in the upload transforms"):
                    sent = self.uploader.send(uploads, down.shared, clients, self.seed, r)
                check_upload(algo.name, self.uploader.wire_spec, sent, m)
                with self._linalg_guard(r, "in the upload transforms"):
                    uploads = self.uploader.receive(sent, down.shared, self.seed, r, m)
            if algo.aggregates:
                with self._linalg_guard(r, "in the server update"):
                    aggregated = algo.aggregate(server, uploads, cidx, rnd)
                # train.server_optimizer: x_{t+1} from x_t and the aggregate (state in the server dict)
                server = self.server_opt.apply(server, aggregated) if self.server_opt else aggregated
            self._check_finite(r, "after the server update", {"server state": server})
            if self._is_eval_round(r):
                new_records += self._evaluate(server, client_states, r)
            self._sync()
            t2 = time.perf_counter()
            row = {
                "round": r,
                "lr": rnd.lr,
                "sampled_clients": " ".join(map(str, clients.tolist())),
                "num_sampled": m,
                "bytes_up": payload_nbytes(sent),
                "bytes_up_dense": payload_dense_nbytes(sent),  # the same uploads uncompressed
                "bytes_down": (k if down.to_all else len(trainers)) * payload_nbytes(down.shared)
                + payload_nbytes(down.per_client),
                "train_seconds": t1 - t0,
                "eval_seconds": t2 - t1,
                "round_seconds": t2 - t0,
                "peak_memory_bytes": peak_memory_bytes(data.device),
            }
            if self.uploader is not None and self.uploader.dp is not None:  # DP-FedAvg: ε at δ after r + 1 rounds
                row["epsilon"] = self.uploader.epsilon(r + 1)
            records += new_records
            rounds.append(row)
            for cb in self.callbacks:
                cb(r, row, new_records)
            if self.checkpoint and self.train.checkpoint_every and ((r + 1) % self.train.checkpoint_every == 0
                                                                    or r == self.train.rounds - 1):
                self._save_checkpoint(server, client_states, records, rounds, r + 1)
                self._checkpointed = r + 1
        # the pipeline's table schemas (pandera), loaded when a run ends: medpfl.fl is importable without them
        from medpfl.data.schemas import EvalRecords, RoundLog, validate

        rec = validate(EvalRecords, pd.DataFrame(records), "evaluation records")
        rnd_log = validate(RoundLog, pd.DataFrame(rounds), "round log")
        personal = ex.personalized_models(algo, client_states, server) if algo.personalized else None
        return RunResult(rec, rnd_log, server, algo.global_model(server) if algo.has_global_model else None,
                         client_states, personal, resumed_from=start if state else 0)

    def _check_finite(self, r: int, when: str, trees: dict[str, Any]) -> None:
        """The divergence guard: raises :class:`DivergenceError` when a floating-point leaf of
        ``trees`` (named, e.g. ``{"server state": server}``) holds a NaN or ±inf in round ``r``
        (0-based). One ``isfinite`` reduction per leaf and one host sync per call
        (:func:`~medpfl.fl.tree.first_nonfinite`)."""
        bad = first_nonfinite(trees)
        if bad is None:
            return
        tree, key = bad
        raise self._diverged(r, f"{tree} {key} is not finite (NaN or inf) {when}")

    @contextlib.contextmanager
    def _linalg_guard(self, r: int, when: str) -> Iterator[None]:
        """Turns a ``torch.linalg.LinAlgError`` caused by non-finite input (torch's message
        "... contained non-finite values", e.g. ``linalg.svd`` of a diverged client's update)
        into :class:`DivergenceError`; other linear-algebra errors propagate unchanged."""
        try:
            yield
        except torch.linalg.LinAlgError as e:
            if "non-finite" not in str(e):
                raise
            raise self._diverged(r, f"a linear-algebra routine met a NaN or inf {when} ({e})") from e

    def _diverged(self, r: int, what: str) -> DivergenceError:
        """The :class:`DivergenceError` for round ``r`` (0-based): method, round, ``what`` went
        non-finite, the checkpoint kept, and what to change."""
        algo, opt = self.algo, self.train.optimizer
        clip = [f for f in type(algo.cfg).model_fields if "clip" in f or "grad_norm" in f]
        hint = f"lower train.optimizer.lr (now {opt.lr:g}; this round's lr {opt.round_lr(r, self.train.rounds):g})"
        if clip:
            hint += f" or set the method's gradient clipping (method_params.<method>.{clip[0]})"
        kept = (f"; the checkpoint {self.checkpoint} (after round {self._checkpointed}) is kept"
                if self.checkpoint and self._checkpointed else "")
        return DivergenceError(f"method {algo.name!r} diverged in round {r + 1}/{self.train.rounds} (round {r} in "
                               f"rounds.parquet): {what}{kept}; {hint}")

    def round_info(self, r: int) -> RoundInfo:
        """What every hook may read about round ``r`` (lr: ``train.optimizer.round_lr``)."""
        opt = self.train.optimizer
        return RoundInfo(round=r, rounds=self.train.rounds, lr=opt.round_lr(r, self.train.rounds),
                         num_clients=self.data.num_clients,
                         seed=self.seed, base_lr=opt.lr, batch_size=self.train.batch_size)

    def _training_clients(self, sampled: np.ndarray, rnd: RoundInfo) -> tuple[np.ndarray, np.ndarray | None]:
        """``(clients that train, positions of the sampled ones among them)``; positions None when
        only the sampled clients train. Raises ValueError when the method's choice is not a sorted
        set of valid client ids containing every sampled client."""
        trainers = np.asarray(self.algo.training_clients(sampled, self.data.num_clients, rnd), dtype=np.int64)
        if trainers.shape == sampled.shape and np.array_equal(trainers, sampled):
            return sampled, None
        ok = (trainers.ndim == 1 and np.all(np.diff(trainers) > 0) and trainers.min(initial=0) >= 0
              and trainers.max(initial=0) < self.data.num_clients and np.isin(sampled, trainers).all())
        if not ok:
            raise ValueError(f"method {self.algo.name!r}: training_clients must return sorted, distinct client ids in "
                             f"[0, {self.data.num_clients}) that include every sampled client; got {trainers.tolist()}")
        return trainers, np.searchsorted(trainers, sampled)

    def _adapted(self, models: Any, r: int) -> Any:
        """Every client's personalized model after the method's evaluation-time program
        (``adaptation_phases``) on its local train split, run by the executor for all K clients
        (one vmapped program on the stacked executor); stacked [K]. ``models`` unchanged when
        the method declares no program for round ``r``."""
        rnd = self.round_info(r)
        phases = self.algo.adaptation_phases(rnd)
        if not phases:
            return models
        return self.executor.adapt_models(self.algo, phases, models, np.arange(self.data.num_clients, dtype=np.int64),
                                          rnd)

    def _evaluate(self, server: dict[str, Any], client_states: dict[str, Any], r: int) -> list[dict]:
        algo, data, bs = self.algo, self.data, self.eval.batch_size
        out: list[dict] = []
        k = data.num_clients
        has_global_test = len(data.global_test) > 0  # a federated data set may have none (Synthetic)
        if algo.has_global_model:
            gm = algo.global_model(server)
            if has_global_test:
                out += records_from_counts(r, "global_test", [-1],
                                           *eval_groups(algo.predict, gm, data, [data.global_test], bs))
            out += records_from_counts(r, "global_on_local", list(range(k)),
                                       *eval_groups(algo.predict, gm, data, data.client_test, bs))
            if self._has_val:
                out += records_from_counts(r, "global_on_val", list(range(k)),
                                           *eval_groups(algo.predict, gm, data, data.client_val, bs))
        if algo.personalized:
            pm = self._adapted(self.executor.personalized_models(algo, client_states, server), r)
            out += records_from_counts(r, "personalized_on_local", list(range(k)),
                                       *self.executor.evaluate_models(algo, pm, data.client_test))
            if self._has_val:
                out += records_from_counts(r, "personalized_on_val", list(range(k)),
                                           *self.executor.evaluate_models(algo, pm, data.client_val))
            if r == self.train.rounds - 1 and not algo.has_global_model and has_global_test:
                out += records_from_counts(r, "local_on_global_test", list(range(k)),
                                           *self.executor.evaluate_models(algo, pm, [data.global_test] * k))
        return out

    # ----- checkpoints ------------------------------------------------------------------------
    def _save_checkpoint(self, server, client_states, records, rounds, next_round: int) -> None:
        blob = {"fingerprint": self.fingerprint, "engine": ENGINE_VERSION, "next_round": next_round,
                "server": server, "client_states": client_states, "records": records, "rounds": rounds}
        with atomic_path(self.checkpoint) as tmp:
            torch.save(blob, tmp)

    def _load_checkpoint(self):
        if not self.checkpoint or not Path(self.checkpoint).exists():
            return None
        try:
            blob = torch.load(self.checkpoint, map_location=self.data.device, weights_only=False)
        except Exception as e:  # truncated or foreign file: start over, keep the file for inspection
            bad = Path(self.checkpoint).with_suffix(".corrupt")
            Path(self.checkpoint).replace(bad)
            log.warning("checkpoint %s unreadable (%s); moved to %s, starting from round 0", self.checkpoint, e, bad)
            return None
        if blob.get("fingerprint") != self.fingerprint or blob.get("engine") != ENGINE_VERSION:
            log.warning("checkpoint %s belongs to another configuration or engine version; starting from round 0",
                        self.checkpoint)
            return None
        return (blob["server"], blob["client_states"], blob["records"], blob["rounds"], int(blob["next_round"]))


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory so far, in bytes: on CUDA the peak memory allocated by tensors
    on ``device`` (``torch.cuda.max_memory_allocated``); on a CPU the peak resident set size of
    the process (``getrusage`` ``ru_maxrss``, KiB on Linux; bytes on macOS), which includes the
    interpreter and libraries."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def fingerprint(job: dict) -> str:
    """Hash of everything that determines a run's numbers (for checkpoint compatibility)."""
    return hashlib.sha256(canonical_json(job).encode()).hexdigest()[:16]
