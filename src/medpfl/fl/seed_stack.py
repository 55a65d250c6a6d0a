"""Seeds of one method stacked as one computation (``train.stack_seeds``, issue 32).

A study runs each method with several seeds (FedKPer's Table 1: 3). Run separately, seed ``s``
is one :class:`~medpfl.fl.engine.Engine`; on a GPU each of its rounds trains only the few
clients sampled that round (FedKPer: 2 of 20), far too little work to fill the device. Here the
S engines of one method advance round by round in lockstep (:func:`run_seed_stack`), and each
round's local training of all S seeds runs as **one** stacked program
(:func:`train_merged`: ``sum_s m_s`` rows on the stacked executor), so a GPU runs S seeds in
about the kernel launches of one.

What stays per seed, exactly as if run separately: the schedule, the model's initialisation, the
server state and its update, the client states, the divergence guard, the evaluation, the
records, the checkpoint and the MLflow run (each engine keeps its own; :mod:`medpfl.train`
writes each seed's outputs into its own run folder). Each engine's global torch RNG stream is
its own too (:class:`RngStream`: set before the engine runs, saved after), so a server hook that
draws from it sees the numbers of a separate run.

What the merged computation changes, within the stacked executor's float tolerance (summation
order of batched kernels, :mod:`medpfl.fl.stacked`):

* each row's batch plans use its own seed (``StackedExecutor.train_clients(seeds=...)``), so a
  row draws exactly the batches of its separate run;
* the shared part of a seed's download (``shared``, ``synced``) becomes per-row leaves
  (expanded to that seed's rows and concatenated), and its ``shared_context`` is computed per
  seed and laid out the same way (``row_context``), so a teacher that runs as one ordinary
  forward in a separate run runs as a per-row (vmapped) forward here;
* the client-side hooks run once for all rows, with a :class:`MergedRoundInfo`: round, lr and
  batch size are the same for every seed, and reading its ``seed`` raises (no client-side hook
  of the registry reads it; server hooks do, FedMIC's DP noise and FedBE's draws, and they run
  per engine with the engine's own round info);
* ``round_seconds``/``train_seconds`` of every seed in a merged round hold the merged
  computation's time (one clock for S seeds).

Merging needs the stacked executor on every engine of a round (a stackable method and model)
and one :class:`~medpfl.fl.data.FederatedData` shared by all seeds; otherwise, and for engines
at different rounds (resumed from checkpoints of different ages: the ones behind run alone until
they catch up), each engine's request runs on its own client side, as in a separate run.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.utils._pytree as pytree

from medpfl.fl.clients import LocalClients, TrainedRound
from medpfl.fl.program import Download, RoundInfo
from medpfl.fl.tree import tree_index, tree_map

log = logging.getLogger(__name__)

__all__ = ["CannotMerge", "MergedRoundInfo", "RngStream", "StackOutcome", "can_merge", "run_seed_stack", "train_merged"]


class MergedRoundInfo(RoundInfo):
    """The :class:`~medpfl.fl.program.RoundInfo` the client-side hooks see in a merged round:
    that of the group's first seed, except that ``seed`` is not one value there (each row has its
    own run seed), so reading it raises AttributeError naming ``train.stack_seeds``, rather than
    giving every row the first seed's."""

    def __getattribute__(self, name: str) -> Any:
        if name == "seed":
            raise AttributeError("a client-side hook read rnd.seed in a round whose seeds run stacked "
                                 "(train.stack_seeds): each row has its own run seed there; set "
                                 "train.stack_seeds: false for this method")
        return super().__getattribute__(name)

    @classmethod
    def of(cls, rnd: RoundInfo) -> "MergedRoundInfo":
        """``rnd``'s values (its ``seed`` unreadable)."""
        return cls(round=rnd.round, rounds=rnd.rounds, lr=rnd.lr, num_clients=rnd.num_clients, seed=rnd.seed,
                   base_lr=rnd.base_lr, batch_size=rnd.batch_size)


class RngStream:
    """One engine's global torch RNG stream (CPU generator and, on CUDA, the device's), kept
    apart from the other engines of the stack: :meth:`active` sets it for the duration of the
    engine's turn and saves where the engine left it. Starts from the state current at
    construction (the engine's ``initial_params`` re-seeds it with the run seed, as a separate
    run does)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.cpu = torch.get_rng_state()
        self.dev = torch.cuda.get_rng_state(device) if self.cuda else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The engine's stream is the global one inside; the caller's outside."""
        outer_cpu = torch.get_rng_state()
        outer_dev = torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state(self.dev, self.device)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(outer_cpu)
            if self.cuda:
                self.dev = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(outer_dev, self.device)


@dataclass
class StackOutcome:
    """One engine's end: ``result`` (a :class:`~medpfl.fl.engine.RunResult`) or ``error`` (the
    exception that ended it, e.g. DivergenceError); ``merged_rounds``: the rounds whose local
    training ran merged with at least one other seed."""

    result: Any = None
    error: BaseException | None = None
    merged_rounds: int = 0


def can_merge(requests: list[Any]) -> bool:
    """Whether these :class:`~medpfl.fl.engine.TrainRequest` (one per engine, same round) can run
    as one stacked program: at least two; every engine's client side a
    :class:`~medpfl.fl.clients.LocalClients` over all clients, on the stacked executor, over the
    same :class:`~medpfl.fl.data.FederatedData` object; the same method and round."""
    from medpfl.fl.stacked import StackedExecutor

    if len(requests) < 2:
        return False
    first = requests[0].engine
    for q in requests:
        cs = q.engine.clients
        if not (isinstance(cs, LocalClients) and cs.only is None and isinstance(cs.executor, StackedExecutor)):
            return False
        if cs.data is not first.clients.data or q.engine.algo.name != first.algo.name:
            return False
        if q.rnd.round != requests[0].rnd.round:
            return False
    return True


def _per_row(tree: dict[str, Any], m: int) -> dict[str, Any]:
    """A shared tree's leaves expanded to ``m`` rows (views: [m, *shape])."""
    return tree_map(lambda t: t.unsqueeze(0).expand(m, *t.shape), tree)


class CannotMerge(Exception):
    """The seeds' trees of a round differ in structure or in a leaf's shape beyond the row dim
    (a method whose download or state depends on the seed): the round runs seed by seed."""


def _cat_rows(parts: list[Any], what: str) -> Any:
    """Trees (any pytree: dicts, :class:`~medpfl.fl.payload.LowRank`, ...) with leading row
    dims m_i -> one tree, rows in order. Raises :class:`CannotMerge` naming ``what`` when their
    structures or trailing shapes differ."""
    specs = [pytree.tree_structure(p) for p in parts]
    if any(sp != specs[0] for sp in specs):
        raise CannotMerge(f"the seeds' {what} differ in structure")
    leaves = [pytree.tree_leaves(p) for p in parts]
    for i, first in enumerate(leaves[0]):
        if any(lv[i].shape[1:] != first.shape[1:] or lv[i].dtype != first.dtype for lv in leaves[1:]):
            raise CannotMerge(f"the seeds' {what} differ in a leaf's shape or dtype")
    return tree_map(lambda *xs: torch.cat(xs), parts[0], *parts[1:])


def train_merged(requests: list[Any], scopes: list[Any] | None = None) -> list[TrainedRound]:
    """The local training of several engines' same-round :class:`~medpfl.fl.engine.TrainRequest`
    as one stacked program (:func:`can_merge` must hold): rows are the seeds' trainers in
    request order (seed 1's m_1 rows, then seed 2's, ...), each with its own run seed, client
    state and download; the trained models scored on their local test (and val) splits in one
    stacked evaluation. Raises :class:`CannotMerge` (before any training) when the seeds'
    states, downloads or contexts cannot be stacked. ``scopes``: per request, a context-manager factory that the seed's own
    host-side work runs in (its ``shared_context``; :meth:`RngStream.active` in
    :func:`run_seed_stack`), None: none. Each engine's client side keeps its new states pending
    (:meth:`~medpfl.fl.clients.LocalClients.commit`), as after its own ``train_round``. Returns
    one :class:`~medpfl.fl.clients.TrainedRound` per request, in order."""
    first = requests[0]
    algo, cs0 = first.engine.algo, first.engine.clients
    ex, data = cs0.executor, cs0.data
    sizes = [len(q.trainers) for q in requests]
    rows = [q.trainer_index if q.trainer_index is not None else q.engine.clients._rows(q.trainers) for q in requests]
    states = _cat_rows([tree_index(q.engine.clients.states, r) for q, r in zip(requests, rows)], "client states")
    per_client = []
    row_ctx = []
    for q, m in zip(requests, sizes):
        d = q.down
        d.received()  # its own checks (a key in two parts, synced without to_all)
        per_client.append({**_per_row(d.shared, m), **_per_row(d.synced, m), **d.per_client})
        with (scopes[len(row_ctx)]() if scopes else contextlib.nullcontext()):
            row_ctx.append(_per_row(algo.shared_context(d.shared_received(), q.rnd), m))
    down = Download(per_client=_cat_rows(per_client, "downloads"))
    trainers = np.concatenate([q.trainers for q in requests]).astype(np.int64)
    seeds = [q.engine.seed for q, m in zip(requests, sizes) for _ in range(m)]
    rnd = MergedRoundInfo.of(first.rnd)
    if any((q.rnd.round, q.rnd.lr, q.rnd.rounds) != (rnd.round, rnd.lr, rnd.rounds) for q in requests):
        raise ValueError("stacked seeds: the seeds' rounds differ in round, lr or length")
    models, uploads, new_states = ex.train_clients(algo, down, states, trainers, rnd, seeds=seeds,
                                                   row_context=_cat_rows(row_ctx, "shared contexts"))
    test = ex.evaluate_models(algo, models, [data.client_test[c] for c in trainers])
    want_val = [q.score_val for q in requests]
    val = ex.evaluate_models(algo, models, [data.client_val[c] for c in trainers]) if any(want_val) else None
    out = []
    ends = np.cumsum([0, *sizes])
    for q, r, a, b, sv in zip(requests, rows, ends[:-1], ends[1:], want_val):
        sl = torch.arange(int(a), int(b), device=data.device)
        mine = tree_index(new_states, sl)
        q.engine.clients._pending = (r, mine)
        out.append(TrainedRound(tree_index(uploads, sl), tuple(t[a:b] for t in test),
                                tuple(t[a:b] for t in val) if sv else None, mine))
    return out


def run_seed_stack(engines: list[Any], merge: bool = True) -> list[StackOutcome]:
    """Run ``engines`` (:class:`~medpfl.fl.engine.Engine`, one per seed of one method) in
    lockstep: every round, the engines at the lowest round each run up to their local training
    (:meth:`~medpfl.fl.engine.Engine.rounds`), whose requests then run as one stacked program
    where :func:`can_merge` allows (``merge``) and one by one otherwise; each engine then
    finishes its round. Each engine runs with its own RNG stream (:class:`RngStream`). An
    engine that raises (DivergenceError, ...) ends alone; the others go on. Returns one
    :class:`StackOutcome` per engine, in order."""
    n = len(engines)
    outcomes = [StackOutcome() for _ in range(n)]
    streams = [RngStream(e.data.device) for e in engines]
    gens = [e.rounds() for e in engines]
    pending: dict[int, Any] = {}

    def advance(i: int, send: Any = None, throw: BaseException | None = None, first: bool = False) -> None:
        """Engine i to its next request (kept in ``pending``) or its end (its outcome)."""
        try:
            with streams[i].active():
                if first:
                    pending[i] = next(gens[i])
                elif throw is not None:
                    pending[i] = gens[i].throw(throw)
                else:
                    pending[i] = gens[i].send(send)
        except StopIteration as stop:
            outcomes[i].result = stop.value
        except Exception as e:  # this seed ends here; the others go on
            log.error("seed %s of %s ended: %s", engines[i].seed, engines[i].algo.name, e)
            outcomes[i].error = e

    for i in range(n):
        advance(i, first=True)
    while pending:
        low = min(q.rnd.round for q in pending.values())
        group = sorted(i for i, q in pending.items() if q.rnd.round == low)
        reqs = [pending.pop(i) for i in group]
        if merge and can_merge(reqs):
            saved = [(streams[i].cpu.clone(), streams[i].dev) for i in group]
            try:
                outs = train_merged(reqs, [streams[i].active for i in group])
            except CannotMerge as e:  # this round seed by seed, the streams as before the attempt
                log.info("round %d of %s: %s; its seeds train one by one", low, engines[group[0]].algo.name, e)
                for i, (cpu, dev) in zip(group, saved):
                    streams[i].cpu, streams[i].dev = cpu, dev
                outs = None
            except Exception as e:  # the merged computation failed: every engine of it sees the error
                for i in group:
                    advance(i, throw=e)
                continue
            if outs is not None:
                for i, out in zip(group, outs):
                    outcomes[i].merged_rounds += 1
                    advance(i, send=out)
                continue
        for i, q in zip(group, reqs):
            try:
                with streams[i].active():
                    out = q.run(q.engine.clients)
            except Exception as e:
                advance(i, throw=e)
                continue
            advance(i, send=out)
    return outcomes
