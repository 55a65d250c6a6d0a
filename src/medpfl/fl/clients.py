"""The client side of a run, as the engine sees it.

The engine (:mod:`medpfl.fl.engine`) runs the server side of every round: the schedule, the
download, the upload checks and transforms, the aggregation, the server optimizer, the
divergence guard, the round log and the checkpoints. Everything that needs a client's data or
its persistent state goes through a *client side* object:

* :class:`LocalClients` (this module): every client in this process, on one device, run by an
  executor (sequential or stacked) over :class:`~medpfl.fl.data.FederatedData`; the states of
  all K clients stacked [K]. This is the simulator (``medpfl train``).
* :class:`medpfl.deploy.server.FlowerClients`: each client at its own site, reached through a
  Flower SuperLink; each site runs :class:`LocalClients` on its own data for its own client(s)
  with the sequential executor and keeps its state on its own disk.

Both give the engine the same numbers in the same order, so a deployed run's records equal the
simulator's (``tests/test_deploy.py``). The methods' hooks are the same code in both.

Shapes: a *tree* is a flat ``dict[str, Tensor]``; ``counts`` are the evaluation sums of
:func:`~medpfl.fl.evaluation.eval_groups`: ``(correct [G, C], count [G, C], loss_sum [G])``,
float64, one row per evaluated client (G clients, C classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.fl.data import FederatedData
from medpfl.fl.evaluation import eval_groups
from medpfl.fl.program import Download, Federation, RoundInfo
from medpfl.fl.sampling import seeded_cpu_rng
from medpfl.fl.tree import tree_index, tree_scatter, tree_stack

Counts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class TrainedRound:
    """What a round's local training hands back to the server side.

    uploads: stacked [m'] (rows in the trainers' order), as the method's ``finish`` returned them;
    test: counts of each trainer's just-trained model on its local test split
    (``local_after_training``); val: the same on its local val split where asked for, else None;
    states: the new client states stacked [m'] for the divergence guard, or ``{}`` where the
    states stay at the sites (then ``bad_state`` carries a site's own finding: ``"client 3:
    theta.w"``, or None)."""

    uploads: dict[str, Any]
    test: Counts
    val: Counts | None
    states: dict[str, Any]
    bad_state: str | None = None
    #: client ids that did not answer this round (deployment only: their rows are absent)
    missing: tuple[int, ...] = ()


@dataclass
class EvalResult:
    """Counts of one evaluation round on the client side; every tuple holds a row per client of
    ``clients`` (None: all K, in order). ``personalized_global`` (the personalized models on the global test set) only
    where asked for."""

    global_test: Counts | None = None
    global_val: Counts | None = None
    #: the client ids of the rows (None: all K in order); a deployment leaves out sites that did not answer
    clients: list[int] | None = None
    personalized_test: Counts | None = None
    personalized_val: Counts | None = None
    personalized_global: Counts | None = None


class ClientSide(Protocol):
    """What the engine calls on the client side (see the module docstring)."""

    name: str
    federation: Federation
    has_val: bool
    has_global_test: bool

    def init_states(self, algo: Algorithm, params: dict, seed: int) -> None: ...

    def train_round(self, algo: Algorithm, down: Download, trainers: np.ndarray, rnd: RoundInfo,
                    score_val: bool, trainer_index: torch.Tensor | None = None) -> TrainedRound: ...

    def commit(self) -> None: ...

    def evaluate(self, algo: Algorithm, server: dict, rnd: RoundInfo, *, global_model: Any, personalized: bool,
                 val: bool, personalized_global: bool) -> EvalResult: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, blob: Any) -> None: ...


def initial_client_state(algo: Algorithm, params: dict, client: int, fed: Federation, seed: int) -> dict:
    """Client ``client``'s state at round 0 (``algo.init_client_state``); for a method with
    ``seeded_client_init``, built with the CPU generator seeded from (seed, client)
    (:func:`~medpfl.fl.sampling.seeded_cpu_rng`, restored after), so a random draw there is a
    function of the run seed and the client id only, wherever the client runs."""
    if not algo.seeded_client_init:
        return algo.init_client_state(params, client, fed)
    with seeded_cpu_rng("client_state", seed, client):
        return algo.init_client_state(params, client, fed)


class LocalClients:
    """The clients of :class:`~medpfl.fl.data.FederatedData` in this process, run by
    ``executor`` (:class:`~medpfl.fl.executors.SequentialExecutor` or
    :class:`~medpfl.fl.stacked.StackedExecutor`); their states stacked [K] in :attr:`states`.

    ``only``: the client ids this process holds (a site of a deployment), None for all K. Then
    :attr:`states` holds those clients' rows only, in ``only``'s order, and every method takes
    and returns rows for ids in ``only``."""

    def __init__(self, data: FederatedData, executor: Any, eval_batch_size: int, only: list[int] | None = None):
        self.data = data
        self.executor = executor
        self.name = executor.name
        self.eval_batch_size = eval_batch_size
        self.only = None if only is None else [int(c) for c in only]
        self.federation = Federation(num_clients=data.num_clients,
                                     num_samples=tuple(int(len(t)) for t in data.client_train),
                                     num_classes=data.num_classes)
        self.has_val = data.has_val
        self.has_global_test = len(data.global_test) > 0
        self.states: dict[str, Any] = {}
        self._pending: tuple[torch.Tensor, dict[str, Any]] | None = None

    @property
    def clients(self) -> list[int]:
        """The client ids held here, in row order."""
        return list(range(self.data.num_clients)) if self.only is None else list(self.only)

    def _rows(self, ids) -> torch.Tensor:
        """Rows of :attr:`states` for client ids ``ids``."""
        ids = [int(c) for c in ids]
        if self.only is None:
            return torch.as_tensor(ids, dtype=torch.int64, device=self.data.device)
        pos = {c: j for j, c in enumerate(self.only)}
        try:
            return torch.as_tensor([pos[c] for c in ids], dtype=torch.int64, device=self.data.device)
        except KeyError as e:
            raise ValueError(f"client {e.args[0]} is not held here (this site holds clients {self.only})") from None

    def init_states(self, algo: Algorithm, params: dict, seed: int) -> None:
        """Every held client's state at round 0 (:func:`initial_client_state`), stacked."""
        self.states = tree_stack([initial_client_state(algo, params, c, self.federation, seed) for c in self.clients])

    def train_round(self, algo: Algorithm, down: Download, trainers: np.ndarray, rnd: RoundInfo,
                    score_val: bool, trainer_index: torch.Tensor | None = None) -> TrainedRound:
        """The trainers' local programs (``down``: the round's download, per-client rows in
        ``trainers`` order), then each trained model scored on its local test split (and val
        split with ``score_val``). The new states wait for :meth:`commit` (the engine commits
        them before the server update; its divergence guard is read after the round, and a
        diverged round ends the run). ``trainer_index``: ``trainers`` as int64 [m'] on the data's
        device where the caller has them there (the engine: a row of its device copy of the
        schedule), so that no host-to-device copy is made here; None: copied here."""
        ex, data = self.executor, self.data
        if trainer_index is not None and self.only is None:  # rows are client ids
            rows = trainer_index
        else:
            rows = self._rows(trainers)
        models, uploads, new_states = ex.train_clients(algo, down, tree_index(self.states, rows), trainers, rnd)
        test = ex.evaluate_models(algo, models, [data.client_test[c] for c in trainers])
        val = ex.evaluate_models(algo, models, [data.client_val[c] for c in trainers]) if score_val else None
        self._pending = (rows, new_states)
        return TrainedRound(uploads, test, val, new_states)

    def commit(self) -> None:
        """Keep the states of the last :meth:`train_round`."""
        if self._pending is not None:
            rows, new_states = self._pending
            self.states = tree_scatter(self.states, rows, new_states)
            self._pending = None

    def personalized_models(self, algo: Algorithm, server: dict, rnd: RoundInfo | None = None) -> Any:
        """Every held client's personalized model, stacked (rows as :attr:`clients`), after the
        method's evaluation-time program (``adaptation_phases(rnd)``) where ``rnd`` is given."""
        ex = self.executor
        if self.only is None:
            pm = ex.personalized_models(algo, self.states, server)
        else:
            pm = tree_stack([algo.personalized_model(tree_index(self.states, j), server)
                             for j in range(len(self.only))])
        return pm if rnd is None else self.adapted(algo, pm, rnd)

    def adapted(self, algo: Algorithm, models: Any, rnd: RoundInfo) -> Any:
        """``models`` (stacked, rows as :attr:`clients`) after the method's evaluation-time
        program (``adaptation_phases(rnd)``) on each client's local train split, run by the
        executor (one vmapped program on the stacked executor); unchanged when the method declares
        none for this round."""
        phases = algo.adaptation_phases(rnd)
        if not phases:
            return models
        return self.executor.adapt_models(algo, phases, models, np.asarray(self.clients, dtype=np.int64), rnd)

    def evaluate(self, algo: Algorithm, server: dict, rnd: RoundInfo, *, global_model: Any, personalized: bool,
                 val: bool, personalized_global: bool) -> EvalResult:
        """One evaluation round on the held clients: the global model (None: none) on each local
        test (and val) split; each personalized model (``personalized``) on its local test (and
        val) split and, with ``personalized_global``, on the global test set."""
        data, bs, ids = self.data, self.eval_batch_size, self.clients
        out = EvalResult()
        sizer = getattr(self.executor, "eval_sizer", None)

        def on(groups: list[torch.Tensor]) -> Counts:  # the global model on ``groups``, forwards sized by the executor
            n = sizer.one(algo.predict, global_model, data.x, groups) if sizer is not None else bs
            return eval_groups(algo.predict, global_model, data, groups, n)

        if global_model is not None:
            out.global_test = on([data.client_test[c] for c in ids])
            if val:
                out.global_val = on([data.client_val[c] for c in ids])
        if personalized:
            ex = self.executor
            pm = self.personalized_models(algo, server, rnd)
            out.personalized_test = ex.evaluate_models(algo, pm, [data.client_test[c] for c in ids])
            if val:
                out.personalized_val = ex.evaluate_models(algo, pm, [data.client_val[c] for c in ids])
            if personalized_global:
                out.personalized_global = ex.evaluate_models(algo, pm, [data.global_test] * len(ids))
        return out

    def state_dict(self) -> Any:
        """The held clients' states (for the checkpoint)."""
        return self.states

    def load_state_dict(self, blob: Any) -> None:
        self.states = blob
        self._pending = None
