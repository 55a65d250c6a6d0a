"""The federated round loop. The engine owns the loop, the schedule, the device, evaluation,
timing, communication accounting and checkpoints; the algorithm only declares its parts
(:class:`medpfl.algorithms.base.Algorithm`); the executor runs local training.

Round r:
  1. the pre-sampled clients S_r (shared by every method) receive ``algo.download(w)``;
  2. the executor trains them (lr = lr0 * lr_decay^r, fresh momentum each visit) and returns
     their models, uploads and new persistent states;
  3. each trained model is scored on its client's local test split (``local_after_training``);
  4. the server aggregates the uploads (``algo.aggregate``) into the new global model;
  5. on evaluation rounds: the global model on the global test set and on every local test
     split, and each personalized model on its local test split;
  6. bytes up (sum of upload sizes) and down (m x download size) and wall time are logged; the
     state is checkpointed atomically every ``checkpoint_every`` rounds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.config import EvalConfig, TrainConfig, canonical_json
from medpfl.data.schemas import EvalRecords, RoundLog, validate
from medpfl.fl.data import FederatedData
from medpfl.fl.evaluation import eval_groups, records_from_counts
from medpfl.fl.functional import Params, model_state, payload_nbytes
from medpfl.fl.sampling import client_schedule
from medpfl.fl.tree import tree_index, tree_repeat, tree_scatter
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
            raise ValueError(f"train.executor=stacked: method {algo.name!r} cannot be stacked; use auto or sequential")
        from medpfl.fl.stacked import StackedExecutor

        return StackedExecutor(data, train, seed, eval_batch_size)
    return SequentialExecutor(data, train, seed, eval_batch_size)


class PrivacyError(RuntimeError):
    """A client tried to send the server something other than what its method declares."""


def check_upload(algo: Algorithm, uploads: dict[str, Any], param_shapes: dict[str, torch.Size], m: int) -> None:
    """The privacy boundary: the stacked uploads of m clients may hold only the method's
    declared keys; ``params`` must be model-shaped ([m, *shape] per parameter) and every other
    key one scalar per client ([m]). Raw images, labels or any per-sample tensor cannot pass.

    Raises PrivacyError naming the method and the offending key.
    """
    if set(uploads) != set(algo.upload_keys):
        raise PrivacyError(f"method {algo.name!r} uploaded keys {sorted(uploads)}, declared {sorted(algo.upload_keys)}")
    for key, value in uploads.items():
        if key == "params":
            if not isinstance(value, dict) or set(value) != set(param_shapes):
                raise PrivacyError(f"method {algo.name!r}: upload 'params' is not the model's parameter dict")
            for name, t in value.items():
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != (m, *param_shapes[name]):
                    raise PrivacyError(f"method {algo.name!r}: upload params[{name!r}] has shape "
                                       f"{tuple(getattr(t, 'shape', ()))}, expected {(m, *param_shapes[name])}")
        elif not isinstance(value, torch.Tensor) or tuple(value.shape) != (m,):
            raise PrivacyError(f"method {algo.name!r}: upload {key!r} must be one scalar per client (shape ({m},)), "
                               f"got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}")


@dataclass
class RunResult:
    records: pd.DataFrame
    rounds: pd.DataFrame
    global_params: Params
    client_states: dict[str, Any]
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
        self.executor = make_executor(self.executor_kind, self.algo, self.data, self.train, self.seed, self.eval.batch_size)
        self.schedule = client_schedule(self.data.num_clients, self.train.participation, self.train.rounds,
                                        self.train.sampling.scheme,
                                        self.train.sampling.seed if self.train.sampling.seed is not None else self.seed)

    # ---------------------------------------------------------------------------------------
    def initial_params(self) -> Params:
        torch.manual_seed(self.seed)
        model = build_model(self.train.model, self.data.in_channels, self.data.num_classes, self.data.image_size)
        return {k: v.to(self.data.device) for k, v in model_state(model).items()}

    def _sync(self):
        if self.data.device.type == "cuda":
            torch.cuda.synchronize(self.data.device)

    def _is_eval_round(self, r: int) -> bool:
        return (r + 1) % self.eval.every == 0 or r == self.train.rounds - 1

    def run(self) -> RunResult:
        algo, data, ex = self.algo, self.data, self.executor
        k = data.num_clients
        state = self._load_checkpoint()
        if state is None:
            global_params = self.initial_params()
            client_states = tree_repeat(algo.init_client_state(global_params), k)
            records: list[dict] = []
            rounds: list[dict] = []
            start = 0
        else:
            global_params, client_states, records, rounds, start = state
            log.info("resuming from checkpoint %s at round %d", self.checkpoint, start)
        opt = self.train.optimizer
        param_shapes = {k: v.shape for k, v in global_params.items()}
        for r in range(start, self.train.rounds):
            self._sync()
            t0 = time.perf_counter()
            clients = self.schedule[r]
            cidx = torch.as_tensor(clients, device=data.device)
            lr = opt.lr * opt.lr_decay**r
            received = algo.download(global_params)
            trained, uploads, new_states = ex.train_clients(algo, received, tree_index(client_states, cidx), clients, lr, r)
            self._sync()
            t1 = time.perf_counter()
            new_records = records_from_counts(r, "local_after_training", clients.tolist(),
                                              *ex.evaluate_models(algo, trained, [data.client_test[c] for c in clients]))
            client_states = tree_scatter(client_states, cidx, new_states)
            check_upload(algo, uploads, param_shapes, len(clients))
            if algo.has_global_model:
                global_params = algo.aggregate(global_params, uploads)
            if self._is_eval_round(r):
                new_records += self._evaluate(global_params, client_states, r)
            self._sync()
            t2 = time.perf_counter()
            row = {
                "round": r,
                "lr": lr,
                "sampled_clients": " ".join(map(str, clients.tolist())),
                "num_sampled": len(clients),
                "bytes_up": payload_nbytes(uploads),
                "bytes_down": len(clients) * payload_nbytes(received),
                "train_seconds": t1 - t0,
                "eval_seconds": t2 - t1,
                "round_seconds": t2 - t0,
            }
            records += new_records
            rounds.append(row)
            for cb in self.callbacks:
                cb(r, row, new_records)
            if self.checkpoint and self.train.checkpoint_every and ((r + 1) % self.train.checkpoint_every == 0
                                                                    or r == self.train.rounds - 1):
                self._save_checkpoint(global_params, client_states, records, rounds, r + 1)
        rec = validate(EvalRecords, pd.DataFrame(records), "evaluation records")
        rnd = validate(RoundLog, pd.DataFrame(rounds), "round log")
        return RunResult(rec, rnd, global_params, client_states, resumed_from=start if state else 0)

    def _evaluate(self, global_params: Params, client_states: dict[str, Any], r: int) -> list[dict]:
        algo, data, bs = self.algo, self.data, self.eval.batch_size
        out: list[dict] = []
        k = data.num_clients
        if algo.has_global_model:
            out += records_from_counts(r, "global_test", [-1],
                                       *eval_groups(algo.forward, global_params, data, [data.global_test], bs))
            out += records_from_counts(r, "global_on_local", list(range(k)),
                                       *eval_groups(algo.forward, global_params, data, data.client_test, bs))
        if algo.personalized:
            pp = algo.personalized_params(client_states)
            out += records_from_counts(r, "personalized_on_local", list(range(k)),
                                       *self.executor.evaluate_models(algo, pp, data.client_test))
            if r == self.train.rounds - 1 and not algo.has_global_model:
                out += records_from_counts(r, "local_on_global_test", list(range(k)),
                                           *self.executor.evaluate_models(algo, pp, [data.global_test] * k))
        return out

    # ----- checkpoints ------------------------------------------------------------------------
    def _save_checkpoint(self, global_params, client_states, records, rounds, next_round: int) -> None:
        blob = {"fingerprint": self.fingerprint, "next_round": next_round, "global_params": global_params,
                "client_states": client_states, "records": records, "rounds": rounds}
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
        if blob.get("fingerprint") != self.fingerprint:
            log.warning("checkpoint %s belongs to another configuration; starting from round 0", self.checkpoint)
            return None
        return (blob["global_params"], blob["client_states"], blob["records"], blob["rounds"], int(blob["next_round"]))


def fingerprint(job: dict) -> str:
    """Hash of everything that determines a run's numbers (for checkpoint compatibility)."""
    return hashlib.sha256(canonical_json(job).encode()).hexdigest()[:16]
