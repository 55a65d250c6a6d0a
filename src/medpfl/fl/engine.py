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
before the round is logged, recorded or checkpointed, so the last checkpoint keeps the last good
state and no result file is written. The guard's flags stay on the device and are read with the
round's records, after the round (one host copy for both,
:class:`~medpfl.fl.evaluation.RoundRecords`), so the error
comes at the end of the round, with the message an immediate check would give (the first
non-finite leaf, after training before after the server update); an exception that the
non-finite values cause later in the round (a method's server hook, the upload transforms'
SVD) is replaced by that :class:`DivergenceError` (``raise ... from`` it).

Host synchronisations of a round outside local training, on an accelerator: the records, the
guard's flags and the ranks of low-rank payloads (``bytes_up``) come to the host in one copy
after the round (:func:`medpfl.fl.tree.to_host`); the client index tensors are the schedule's
rows on the device (one copy per run; one more per round only where ``training_clients``
differs from the sampled clients); the round is timed with CUDA events on a CUDA device (read
after that copy: no ``torch.cuda.synchronize`` in the round), with the wall clock elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

import numpy as np
import pandas as pd
import torch

from medpfl.algorithms.base import Algorithm, check_required_parts
from medpfl.config import EvalConfig, TrainConfig, canonical_json
from medpfl.errors import DivergenceError, ParamsError
from medpfl.fl.clients import LocalClients, initial_client_state
from medpfl.fl.data import FederatedData, ServerData
from medpfl.fl.evaluation import RoundRecords, eval_groups
from medpfl.fl.functional import Params, model_state
from medpfl.fl.payload import UploadSpecError, check_upload, payload_dense_nbytes, payload_nbytes_parts
from medpfl.fl.privacy import make_upload_pipeline
from medpfl.fl.program import RoundInfo
from medpfl.fl.sampling import client_schedule
from medpfl.fl.server_opt import make_server_optimizer
from medpfl.fl.tree import finite_flags, first_false, to_host, tree_index, tree_leaves, tree_stack
from medpfl.io import atomic_path
from medpfl.models.zoo import build_model_for_data


log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. Raises ValueError if CUDA is asked for but absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    return dev


def make_executor(kind: str, algo: Algorithm, data: FederatedData, train: TrainConfig, seed: int, eval_batch_size: int,
                  eval_memory_fraction: float | None = None):
    """``auto`` picks the stacked executor on CUDA where the method and the model support it
    (a model with active dropout declares ``not_stackable_because``), else the sequential one (on a CPU the sequential executor is already compute-bound and the grouped
    convolutions of the stacked one are slower: see ``benchmarks/README.md``)."""
    from medpfl.fl.executors import SequentialExecutor

    # a model whose training step draws random masks (dropout) cannot run under vmap either
    model_why = getattr(getattr(algo, "forward", None), "not_stackable_because", None)
    if getattr(train, "cuda_graphs", False):  # captures the stacked executor's steps: nothing else will do
        why = (f"method {algo.name!r} cannot be stacked ({algo.not_stackable_because})" if not algo.stackable else
               f"model {algo.forward.model_name!r} cannot be stacked ({model_why})" if model_why is not None else
               f"the device is {data.device.type}, not CUDA" if data.device.type != "cuda" else
               "train.executor is sequential" if kind == "sequential" else None)
        if why is not None:
            raise ValueError(f"train.cuda_graphs: true captures the stacked executor's local steps on CUDA, and {why}: "
                             "set train.cuda_graphs: false")
        kind = "stacked"
    if kind == "auto":
        kind = "stacked" if algo.stackable and model_why is None and data.device.type == "cuda" else "sequential"
    if kind == "stacked":
        if not algo.stackable:
            raise ValueError(f"train.executor=stacked: method {algo.name!r} cannot be stacked "
                             f"({algo.not_stackable_because}); use auto or sequential")
        if model_why is not None:
            raise ValueError(f"train.executor=stacked: model {algo.forward.model_name!r} cannot be stacked "
                             f"({model_why}); use auto or sequential")
        from medpfl.fl.stacked import StackedExecutor

        return StackedExecutor(data, train, seed, eval_batch_size, eval_memory_fraction)
    return SequentialExecutor(data, train, seed, eval_batch_size, eval_memory_fraction)


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

__all__ = ["DivergenceError", "Engine", "RunResult", "TrainRequest", "UploadSpecError", "check_upload", "fingerprint",
           "make_executor",
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
    #: the client side (:mod:`medpfl.fl.clients`); None: every client in this process
    #: (:class:`~medpfl.fl.clients.LocalClients` over ``data`` with ``executor_kind``'s executor)
    clients: Any = None

    def __post_init__(self):
        check_required_parts(self.algo)  # before anything is built: one line naming method, part and model
        self._attach_server_data()
        if self.clients is None:
            executor = make_executor(self.executor_kind, self.algo, self.data, self.train, self.seed,
                                     self.eval.batch_size, self.eval.memory_fraction)
            self.clients = LocalClients(self.data, executor, self.eval.batch_size)
        #: the executor of local training (None where the clients run elsewhere: a deployment)
        self.executor = getattr(self.clients, "executor", None)
        #: what the set-up hooks read about the federation (K, each client's local train size, C)
        self.federation = self.clients.federation
        self._has_val = self.clients.has_val
        self._eval_missing: list[int] = []
        self.server_opt = make_server_optimizer(self.train.server_optimizer, self.algo)  # None: the aggregate as is
        self.schedule = client_schedule(self.federation.num_clients, self.train.participation, self.train.rounds,
                                        self.train.sampling.scheme,
                                        self.train.sampling.seed if self.train.sampling.seed is not None else self.seed)
        # train.upload / train.dp (fl/privacy.py): None leaves the round exactly as without them
        self.uploader = make_upload_pipeline(self.train, self.algo, self.federation.num_clients, self.schedule.shape[1])

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
        model = build_model_for_data(self.train.model, self.data, self.train.model_args)
        return {k: v.to(self.data.device) for k, v in model_state(model).items()}

    def _is_eval_round(self, r: int) -> bool:
        return (r + 1) % self.eval.every == 0 or r == self.train.rounds - 1

    def initial_client_states(self, params: Params) -> dict[str, Any]:
        """Every client's state at round 0, stacked [K]. For a method with ``seeded_client_init``,
        client c's is built with the CPU generator seeded from (seed, c)
        (:func:`~medpfl.fl.clients.initial_client_state`), so a random draw in
        ``init_client_state`` is a function of the run seed and the client id only."""
        return tree_stack([initial_client_state(self.algo, params, c, self.federation, self.seed)
                           for c in range(self.federation.num_clients)])

    def run(self) -> RunResult:
        """Every round from the checkpoint (or round 0) to ``train.rounds``; the run's tables,
        server state and client states. Each round's local training is
        :meth:`TrainRequest.run` on this engine's client side (:meth:`rounds` yields it);
        :func:`medpfl.fl.seed_stack.run_seed_stack` drives several engines' :meth:`rounds`
        instead, their local training merged. Raises DivergenceError (see the module docstring)."""
        gen = self.rounds()
        try:
            req = next(gen)
            while True:
                try:
                    out = req.run(self.clients)
                except Exception as e:  # raised where the round asked for it (its linear-algebra guard)
                    req = gen.throw(e)
                    continue
                req = gen.send(out)
        except StopIteration as stop:
            return stop.value

    def rounds(self) -> Generator["TrainRequest", Any, RunResult]:
        """The run as a generator: yields each round's :class:`TrainRequest` and expects its
        :class:`~medpfl.fl.clients.TrainedRound` back (``send``; an exception of local training
        goes back with ``throw``); returns the :class:`RunResult` (``StopIteration.value``).
        Between a yield and the next ``send`` nothing of this engine runs, so several engines'
        requests of one round can be served by one computation."""
        algo, data, cs = self.algo, self.data, self.clients
        k = self.federation.num_clients
        state = self._load_checkpoint()
        if state is None:
            params = self.initial_params()
            server = algo.init_server(params, self.federation)
            cs.init_states(algo, params, self.seed)
            records: list[dict] = []
            rounds: list[dict] = []
            start = 0
        else:
            server, client_blob, records, rounds, start = state
            cs.load_state_dict(client_blob)
            log.info("resuming from checkpoint %s at round %d", self.checkpoint, start)
        self._checkpointed = start if state is not None else 0  # rounds held by the checkpoint file
        clock = RoundClock(data.device)
        schedule = self._device_schedule()
        for r in range(start, self.train.rounds):
            t0 = clock.mark()
            clients = self.schedule[r]
            m = len(clients)
            cidx = schedule[r]
            rnd = self.round_info(r)
            trainers, agg_pos = self._training_clients(clients, rnd)
            tidx, pos_idx = self._trainer_index(cidx, trainers, agg_pos)
            down = algo.download(server, tidx, rnd)
            for leaf in tree_leaves(down.per_client):
                if leaf.shape[:1] != (len(trainers),):
                    raise ValueError(f"method {algo.name!r}: a per-client download leaf has shape {tuple(leaf.shape)}; "
                                     f"its leading dim must be the {len(trainers)} clients that train this round")
            with self._linalg_guard(r, "in local training"):
                # model selection (FHBench protocol): the same models on the val splits in evaluation rounds
                out = yield TrainRequest(self, down, trainers, rnd, self._has_val and self._is_eval_round(r), tidx)
            uploads = out.uploads
            if len(out.missing):  # a deployment: sites that did not answer in time leave the round
                trainers, clients, agg_pos = self._without(out.missing, trainers, clients, agg_pos)
                m = len(clients)
                cidx = torch.as_tensor(clients, device=data.device)
                pos_idx = None if agg_pos is None else torch.as_tensor(agg_pos, device=data.device)
            if out.bad_state:  # a site's own finding, already on the host
                raise self._diverged(r, f"client state {out.bad_state} is not finite (NaN or inf) after local training")
            guard = DivergenceFlags()
            guard.check("after local training", {"upload": uploads, "client state": out.states})
            t1 = clock.mark()
            pending = RoundRecords(r)  # the counts stay on the device until the round's one host copy
            pending.add("local_after_training", trainers.tolist(), out.test)
            if out.val is not None:
                pending.add("local_after_training_val", trainers.tolist(), out.val)
            try:
                cs.commit()
                if pos_idx is not None:  # only the sampled clients send (and are aggregated)
                    uploads = tree_index(uploads, pos_idx)
                if m > 0:
                    check_upload(algo.name, algo.upload_spec(), uploads, m)
                sent = uploads  # what crosses (bytes_up), as the clients send it
                if self.uploader is not None:  # train.upload / train.dp: transforms at the clients, decoding at the server
                    with self._linalg_guard(r, "in the upload transforms"):
                        sent = self.uploader.send(uploads, down.shared, clients, self.seed, r)
                    check_upload(algo.name, self.uploader.wire_spec, sent, m)
                    with self._linalg_guard(r, "in the upload transforms"):
                        uploads = self.uploader.receive(sent, down.shared, self.seed, r, m)
                if algo.aggregates and m > 0:
                    with self._linalg_guard(r, "in the server update"):
                        aggregated = algo.aggregate(server, uploads, cidx, rnd)
                    # train.server_optimizer: x_{t+1} from x_t and the aggregate (state in the server dict)
                    server = self.server_opt.apply(server, aggregated) if self.server_opt else aggregated
                guard.check("after the server update", {"server state": server})
                if self._is_eval_round(r):
                    self._evaluate(server, r, pending)
            except Exception as e:  # caused by a non-finite value the guard has flagged: the guard's error
                bad = guard.first_failure()  # a host read, on this error path only
                if bad is not None:
                    raise self._diverged(r, bad) from e
                raise
            t2 = clock.mark()
            up_known, up_ranked = payload_nbytes_parts(sent)
            sh_known, sh_ranked = payload_nbytes_parts(down.shared)
            pc_known, pc_ranked = payload_nbytes_parts(down.per_client)
            ranked = [t for t in (up_ranked, sh_ranked, pc_ranked) if t is not None]
            # the round's one host copy: records, the guard's flags, the low-rank payloads' bytes
            host = to_host(pending.tensors() + guard.tensors() + ranked)
            n_rec, n_flags = len(pending.tensors()), len(guard.tensors())
            bad = guard.first_failure(host[n_rec:n_rec + n_flags])
            if bad is not None:  # nothing of this round is recorded, logged or checkpointed
                raise self._diverged(r, bad)
            new_records = pending.rows(host[:n_rec])
            ranked_host = iter(host[n_rec + n_flags:])
            up_bytes, sh_bytes, pc_bytes = (known + (0 if rk is None else int(next(ranked_host)))
                                            for known, rk in ((up_known, up_ranked), (sh_known, sh_ranked),
                                                              (pc_known, pc_ranked)))
            row = {
                "round": r,
                "lr": rnd.lr,
                "sampled_clients": " ".join(map(str, self.schedule[r].tolist())),
                "num_sampled": len(self.schedule[r]),
                "bytes_up": up_bytes,
                "bytes_up_dense": payload_dense_nbytes(sent),  # the same uploads uncompressed
                "bytes_down": (k if down.to_all else len(trainers)) * sh_bytes + pc_bytes,
                "train_seconds": clock.seconds(t0, t1),
                "eval_seconds": clock.seconds(t1, t2),
                "round_seconds": clock.seconds(t0, t2),
                "peak_memory_bytes": peak_memory_bytes(data.device),
            }
            if self.uploader is not None and self.uploader.dp is not None:  # DP-FedAvg: ε at δ after r + 1 rounds
                row["epsilon"] = self.uploader.epsilon(r + 1)
            if getattr(cs, "reports_missing", False):  # a deployment: the clients whose site did not answer
                row["missing_clients"] = " ".join(map(str, sorted(set(out.missing) | set(self._eval_missing))))
                self._eval_missing = []
            records += new_records
            rounds.append(row)
            for cb in self.callbacks:
                cb(r, row, new_records)
            if self.checkpoint and self.train.checkpoint_every and ((r + 1) % self.train.checkpoint_every == 0
                                                                    or r == self.train.rounds - 1):
                self._save_checkpoint(server, cs.state_dict(), records, rounds, r + 1)
                self._checkpointed = r + 1
        # the pipeline's table schemas (pandera), loaded when a run ends: medpfl.fl is importable without them
        from medpfl.data.schemas import EvalRecords, RoundLog, validate

        rec = validate(EvalRecords, pd.DataFrame(records), "evaluation records")
        rnd_log = validate(RoundLog, pd.DataFrame(rounds), "round log")
        local = isinstance(cs, LocalClients)  # deployed: the states and personal models stay at the sites
        personal = cs.personalized_models(algo, server) if algo.personalized and local else None
        return RunResult(rec, rnd_log, server, algo.global_model(server) if algo.has_global_model else None,
                         cs.state_dict() if local else {}, personal, resumed_from=start if state else 0)

    def _device_schedule(self) -> torch.Tensor:
        """The client schedule on the data's device, int64 [R, m] (one host-to-device copy per
        run): row r is round r's ``cidx``, with no copy in the round."""
        return torch.as_tensor(self.schedule, dtype=torch.int64, device=self.data.device)

    def _trainer_index(self, cidx: torch.Tensor, trainers: np.ndarray, agg_pos: np.ndarray | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(trainers, positions of the sampled among them)`` as int64 tensors on the data's
        device: the sampled clients' row of the schedule ``cidx`` (int64 [m], already there) and
        None where only the sampled clients train; else one host-to-device copy for both."""
        if agg_pos is None:
            return cidx, None
        both = torch.as_tensor(np.concatenate([trainers, agg_pos]), dtype=torch.int64, device=self.data.device)
        return both[:len(trainers)], both[len(trainers):]

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

    @staticmethod
    def _without(missing, trainers: np.ndarray, sampled: np.ndarray, agg_pos: np.ndarray | None):
        """``(trainers, sampled, positions of the sampled among the trainers)`` without the
        clients in ``missing`` (their sites did not answer); positions None as before when only
        the sampled clients train."""
        gone = np.asarray(sorted(missing), dtype=np.int64)
        trainers = trainers[~np.isin(trainers, gone)]
        sampled = sampled[~np.isin(sampled, gone)]
        return trainers, sampled, (None if agg_pos is None else np.searchsorted(trainers, sampled))

    def _evaluate(self, server: dict[str, Any], r: int, out: RoundRecords) -> None:
        """The evaluation round's counts, added to ``out`` (on the device; records after the
        round): the global model on the global test set here (where this process has one) and,
        on the client side, on every local test (and val) split; every personalized model on its
        local test (and val) split, and on the global test set at the last round of a method
        without a global model."""
        algo, data, bs, cs = self.algo, self.data, self.eval.batch_size, self.clients
        k = self.federation.num_clients
        clients = list(range(k))
        gm = algo.global_model(server) if algo.has_global_model else None
        if gm is not None and len(data.global_test) > 0:  # a federated data set may have none (Synthetic)
            gbs = self.executor.eval_sizer.one(algo.predict, gm, data.x, [data.global_test]) if self.executor else bs
            out.add("global_test", [-1], eval_groups(algo.predict, gm, data, [data.global_test], gbs))
        res = cs.evaluate(algo, server, self.round_info(r), global_model=gm, personalized=algo.personalized,
                          val=self._has_val,
                          personalized_global=(r == self.train.rounds - 1 and not algo.has_global_model
                                               and cs.has_global_test))
        if res.clients is not None:
            self._eval_missing = sorted(set(clients) - set(res.clients))
            clients = list(res.clients)
        for view, counts in (("global_on_local", res.global_test), ("global_on_val", res.global_val),
                             ("personalized_on_local", res.personalized_test),
                             ("personalized_on_val", res.personalized_val),
                             ("local_on_global_test", res.personalized_global)):
            if counts is not None:
                out.add(view, clients, counts)

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


@dataclass
class TrainRequest:
    """One round's local training as :meth:`Engine.rounds` asks for it: the trainers' local
    programs on ``down`` (per-client rows in ``trainers`` order), each trained model scored on
    its local test split (and val split with ``score_val``). ``trainer_index``: ``trainers`` as
    int64 [m'] on the data's device (a row of the engine's device schedule), or None."""

    engine: "Engine"
    down: Any
    trainers: np.ndarray
    rnd: RoundInfo
    score_val: bool
    trainer_index: torch.Tensor | None

    def run(self, clients: Any) -> Any:
        """The request on ``clients`` (a client side, :mod:`medpfl.fl.clients`): its
        :class:`~medpfl.fl.clients.TrainedRound`."""
        return clients.train_round(self.engine.algo, self.down, self.trainers, self.rnd, score_val=self.score_val,
                                   trainer_index=self.trainer_index)


class DivergenceFlags:
    """The divergence guard's finite-checks of one round, kept on the device until the round's
    host copy (:func:`medpfl.fl.tree.finite_flags`).

    :meth:`check` adds the flags of named trees at a point of the round (``when``: "after local
    training", "after the server update"); :meth:`tensors` are what the host copy takes (bool
    [n] per check with floating-point leaves); :meth:`first_failure` gives the message of the
    first non-finite leaf, in check order, as an immediate check would have raised it."""

    def __init__(self):
        self._checks: list[tuple[str, list[tuple[str, str]], torch.Tensor]] = []

    def check(self, when: str, trees: dict[str, Any]) -> None:
        """Flags of every floating-point leaf of ``trees`` (device ops only, nothing read)."""
        labels, ok = finite_flags(trees)
        if ok is not None:
            self._checks.append((when, labels, ok))

    def tensors(self) -> list[torch.Tensor]:
        """The flags of every check with floating-point leaves, in check order (bool [n_i] each,
        on the device of the check's first leaf)."""
        return [ok for _, _, ok in self._checks]

    def first_failure(self, host: list[torch.Tensor] | None = None) -> str | None:
        """``"<tree> <key path> is not finite (NaN or inf) <when>"`` of the first non-finite leaf,
        None when every leaf is finite. ``host``: the host copies of :meth:`tensors` (same order);
        None reads the device flags (one host read per check: for the error path)."""
        flags = host if host is not None else self.tensors()
        for (when, labels, _), ok in zip(self._checks, flags):
            bad = first_false(labels, ok)
            if bad is not None:
                tree, key = bad
                return f"{tree} {key} is not finite (NaN or inf) {when}"
        return None


class RoundClock:
    """Timestamps of a round: on a CUDA device CUDA events on the device's current stream
    (``torch.cuda.Event(enable_timing=True)``, recorded without waiting, so the round has no
    ``torch.cuda.synchronize``), elsewhere the wall clock (``time.perf_counter``). The seconds
    between two marks are read after the round (:meth:`seconds`; on CUDA it waits for the later
    event, which the round's host copy has already passed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A timestamp: a recorded ``torch.cuda.Event`` (CUDA) or a float in seconds."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (float, >= 0)."""
        if not self.cuda:
            return b - a
        b.synchronize()
        return max(0.0, a.elapsed_time(b) / 1000.0)


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
