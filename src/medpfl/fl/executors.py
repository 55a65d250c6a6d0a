"""Executors run one round's local programs and evaluate many client models.

``SequentialExecutor`` is the reference: clients one after another, each with exact-size
mini-batches, easy to read. ``StackedExecutor`` (:mod:`medpfl.fl.stacked`) runs all of a
round's clients as one vectorised computation and must give the same numbers up to float
tolerance. Both run the same program (:mod:`medpfl.fl.program`): the method's hooks in the
same order and cases, the same batch plans (:func:`medpfl.fl.program.phase_plan`), the same
optimizer chains (:func:`medpfl.fl.optim.phase_optimizer`, one per trained tree) on the leaves
each phase trains.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.config import TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.evaluation import eval_groups
from medpfl.fl.memory import EvalSizer
from medpfl.fl.optim import Chain, phase_optimizer
from medpfl.fl.program import (Download, Pass, Phase, RoundInfo, device_plan_bounds, device_plans, pass_plan,
                                phase_plan, select)
from medpfl.fl.tree import tree_clone, tree_index, tree_map, tree_stack


def _grad(algo: Algorithm, ph: Phase, loss: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gradients of ``loss`` w.r.t. the phase's trained leaves; a clear error when the objective
    does not depend on one of them (a phase whose loss reads another tree than it trains)."""
    try:
        return torch.autograd.grad(loss, leaves)
    except RuntimeError as e:
        if "does not require grad" in str(e) or "not have been used" in str(e):
            raise ValueError(f"method {algo.name!r}, phase {ph.name!r}: the objective does not depend on every "
                             f"leaf the phase trains ({sorted(ph.trainable)}); give the phase a loss on those trees") from e
        raise


class SequentialExecutor:
    """Run the sampled clients' local programs one after another (the reference executor)."""

    name = "sequential"

    def __init__(self, data: FederatedData, train: TrainConfig, seed: int, eval_batch_size: int,
                 eval_memory_fraction: float | None = None):
        self.data = data
        self.train = train
        self.seed = seed
        #: samples per forward of the passes and per-sample contexts (part of training) and, by
        #: default, of evaluation
        self.eval_batch_size = eval_batch_size
        #: how evaluation forwards are sized (``eval.memory_fraction``: by free memory)
        self.eval_sizer = EvalSizer(eval_batch_size, eval_memory_fraction, data.device)

    def autocast(self):
        """bf16 autocast of the local objective when ``train.precision`` is bf16 (parameters,
        gradients and the optimizer stay float32); a no-op context otherwise."""
        if self.train.precision != "bf16":
            return contextlib.nullcontext()  # a disabled torch.autocast still costs tens of µs a step
        return torch.autocast(self.data.device.type, dtype=torch.bfloat16)

    # ----- pieces shared with the stacked executor ------------------------------------------
    def _trained_names(self, algo: Algorithm, ph: Phase, trees: dict) -> dict[str, list[str]]:
        out = {}
        for t, sel in ph.trainable.items():
            if t not in trees:
                raise ValueError(f"method {algo.name!r}, phase {ph.name!r}: no tree named {t!r} "
                                 f"(begin/init returned {sorted(trees)})")
            out[t] = select(trees[t], sel, algo.forward.parts, algo.forward.buffers,
                            f"method {algo.name!r}, phase {ph.name!r}, tree {t!r}")
        return out

    def _optimizers(self, algo: Algorithm, ph: Phase, names: dict[str, list[str]], rnd: RoundInfo) -> dict[str, Chain]:
        """The phase's optimizer chain per trained tree (both executors)."""
        return phase_optimizer(ph, self.train.optimizer, rnd.lr, names, f"method {algo.name!r}, phase {ph.name!r}")

    def device_plans(self, ph: Phase) -> bool:
        """Whether phase ``ph``'s batch plans are drawn on the device (``train.sampling.plans:
        device``; a phase with a ``subset`` window keeps the host draw)."""
        sampling = getattr(self.train, "sampling", None)
        return getattr(sampling, "plans", "host") == "device" and ph.subset >= 1.0

    def _device_plan(self, n: int, bs: int, epochs: int, client: int, rnd: RoundInfo, ph: Phase) -> torch.Tensor:
        """One client's device-drawn plan (:func:`~medpfl.fl.program.device_plans`, the row it
        has in any batch of clients), int64 [steps, bs] on the data's device."""
        width, max_epochs, steps = device_plan_bounds([n], [epochs], bs, ph)
        keys = torch.tensor([n, epochs, self.seed, client], dtype=torch.int64).to(self.data.device)
        return device_plans(keys[0:1], keys[1:2], keys[2:3], keys[3:4], rnd.round, bs, ph, width, max_epochs,
                            steps)[0]

    def _epochs(self, ph: Phase) -> int:
        """The phase's epochs: its own (0 skips it), else ``train.local_epochs``."""
        return self.train.local_epochs if ph.epochs is None else int(ph.epochs)

    def _batch_size(self, ph: Phase) -> int:
        return ph.batch_size or self.train.batch_size

    def _pass_batch_size(self, p: Pass, default: int) -> int:
        if p.batch_size == "train":
            return self.train.batch_size
        return p.batch_size or default

    @staticmethod
    def _check_phases(algo: Algorithm, phases: list[Phase]) -> None:
        names = [p.name for p in phases]
        if len(set(names)) != len(names):
            raise ValueError(f"method {algo.name!r}: phase names must be unique, got {names}")

    # ----- one client ---------------------------------------------------------------------
    def _sample_context(self, algo: Algorithm, ctx: dict[str, Any], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for s in range(0, len(ids), self.eval_batch_size):
                for k, v in algo.sample_context(ctx, self.data.x(ids[s:s + self.eval_batch_size])).items():
                    parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def _batch(self, ids: torch.Tensor, pos: torch.Tensor, nv: int, sctx: dict[str, torch.Tensor]) -> dict:
        bid = ids[pos]
        batch = {"x": self.data.x(bid), "y": self.data.labels[bid],
                 "w": torch.full((nv,), 1.0 / nv, device=self.data.device)}
        for k, v in sctx.items():
            batch[k] = v[pos]
        return batch

    def _run_pass(self, algo: Algorithm, p: Pass, trees: dict, ctx: dict, ids: torch.Tensor, client: int,
                  rnd: RoundInfo) -> dict[str, torch.Tensor]:
        plan_cpu = pass_plan(len(ids), self._pass_batch_size(p, self.eval_batch_size), self.seed, rnd.round, client, p)
        counts = (plan_cpu >= 0).sum(1).tolist()
        plan = plan_cpu.to(self.data.device)
        total: Any = None
        with torch.no_grad():
            for s, nv in enumerate(counts):
                out = p.fn(trees, ctx, self._batch(ids, plan[s, :nv], nv, {}))
                total = tree_clone(out) if total is None else tree_map(torch.add, total, out)
        return total

    def _run_phase(self, algo: Algorithm, ph: Phase, trees: dict, ctx: dict, sctx: dict, ids: torch.Tensor,
                   client: int, rnd: RoundInfo) -> tuple[dict, int]:
        """Optimizer steps on the leaves ``ph`` trains; returns ``(trees, number of steps)``."""
        if ph.init is not None:
            trees = tree_clone(ph.init(trees, ctx))
        names = self._trained_names(algo, ph, trees)
        opts = self._optimizers(algo, ph, names, rnd)
        epochs = int(ph.epochs(ctx)) if callable(ph.epochs) else self._epochs(ph)
        if epochs <= 0:
            return trees, 0
        use_until = ph.until is not None and (ph.until_applies is None or bool(ph.until_applies(ctx)))
        if use_until:
            epochs = ph.until.max_epochs
        bs = self._batch_size(ph)
        size = max(1, int(ph.subset * len(ids))) if ph.subset < 1 else len(ids)  # as phase_plan's window
        per_epoch = -(-size // bs)
        if self.device_plans(ph):  # train.sampling.plans: device, this client's row of the batched draw
            plan = self._device_plan(len(ids), bs, epochs, client, rnd, ph)
            counts = [bs if s % per_epoch < per_epoch - 1 else size - (per_epoch - 1) * bs
                      for s in range(plan.shape[0])]
        else:
            plan_cpu = phase_plan(len(ids), bs, epochs, self.seed, rnd.round, client, ph)
            counts = (plan_cpu >= 0).sum(1).tolist()
            plan = plan_cpu.to(self.data.device)
        flat = [(t, k) for t in names for k in names[t]]
        for t, k in flat:
            trees[t][k].requires_grad_(True)
        params = {t: {k: trees[t][k] for k in names[t]} for t in names}
        states = {t: opts[t].init(params[t]) for t in names}
        loss_fn = ph.loss or algo.local_loss
        losses: list[float] = []
        steps = 0
        for s, nv in enumerate(counts):
            batch = self._batch(ids, plan[s, :nv], nv, sctx)
            with self.autocast():
                loss = loss_fn(trees, ctx, batch)
            grads = _grad(algo, ph, loss, [trees[t][k] for t, k in flat])
            g: dict[str, dict[str, torch.Tensor]] = {t: {} for t in names}
            for (t, k), gk in zip(flat, grads):
                g[t][k] = gk
            for t in names:
                opts[t].step_(params[t], g[t], states[t], count=s + 1)
            if ph.project is not None:
                with torch.no_grad():
                    for t, leaves in ph.project(trees).items():
                        for k, v in leaves.items():
                            trees[t][k].copy_(v)
            steps += 1
            if use_until and (s + 1) % per_epoch == 0:
                losses.append(float(loss.detach()))
                u = ph.until
                if len(losses) > u.window and float(np.std(losses[-u.window:])) < u.threshold:
                    break
        trees = {t: {k: v.detach() for k, v in tree.items()} for t, tree in trees.items()}
        return trees, steps

    def run_client(self, algo: Algorithm, received: dict, shared_ctx: dict, state: dict, client: int,
                   rnd: RoundInfo) -> tuple[dict, dict, Any]:
        """One client's local program; returns ``(upload, new state, eval model)``."""
        data = self.data
        ids = data.client_train[client]
        info: dict[str, Any] = {"client": torch.tensor(client, device=data.device),
                                "num_samples": torch.tensor(float(len(ids)), device=data.device),
                                "label_hist": data.train_hist[client]}
        trees, cctx = algo.begin(received, state, info, rnd)
        trees = tree_clone(trees)
        clash = set(shared_ctx) & set(cctx)
        if clash:
            raise ValueError(f"method {algo.name!r}: context keys {sorted(clash)} are both shared and per-client")
        ctx = {**shared_ctx, **cctx}
        passes = algo.passes(rnd)
        for p in passes:
            if p.when == "before":
                ctx[p.name] = self._run_pass(algo, p, trees, ctx, ids, client, rnd)
        sctx = self._sample_context(algo, ctx, ids)
        phases = algo.phases(rnd)
        self._check_phases(algo, phases)
        steps = {}
        for ph in phases:
            trees, n = self._run_phase(algo, ph, trees, ctx, sctx, ids, client, rnd)
            steps[ph.name] = torch.tensor(n, device=data.device)
        info["steps"] = steps
        for p in passes:
            if p.when == "after":
                info[p.name] = self._run_pass(algo, p, trees, ctx, ids, client, rnd)
        return algo.finish(trees, ctx, state, info, rnd)

    def train_clients(self, algo: Algorithm, down: Download, states: dict[str, Any], clients: np.ndarray,
                      rnd: RoundInfo) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Run the round's clients. states: stacked [m] (rows in ``clients`` order). Returns
        stacked ``(eval models, uploads, new states)``, each with leading dim m."""
        shared_ctx = algo.shared_context(down.shared_received(), rnd)
        shared = down.received()
        models, uploads, new_states = [], [], []
        for j, c in enumerate(clients):
            received = {**shared, **tree_index(down.per_client, j)}
            up, ns, em = self.run_client(algo, received, shared_ctx, tree_index(states, j), int(c), rnd)
            models.append(em)
            uploads.append(up)
            new_states.append(ns)
        return tree_stack(models), tree_stack(uploads), tree_stack(new_states)

    def adapt_models(self, algo: Algorithm, phases: list[Phase], models: Any, clients: np.ndarray,
                     rnd: RoundInfo) -> Any:
        """The evaluation-time program (``Algorithm.adaptation_phases``): model j (a tree stacked
        with leading dim m, rows in ``clients`` order) goes through ``phases`` on client
        ``clients[j]``'s local train split as the tree ``"model"`` (objective: the phase's, else the
        method's ``local_loss``; no context, passes or state). Returns the adapted models, stacked
        [m]; ``models`` is not modified."""
        self._check_phases(algo, phases)
        out = []
        for j, c in enumerate(clients):
            trees = {"model": tree_clone(tree_index(models, j))}
            for ph in phases:
                trees, _ = self._run_phase(algo, ph, trees, {}, {}, self.data.client_train[int(c)], int(c), rnd)
            out.append(trees["model"])
        return tree_stack(out)

    def evaluate_models(self, algo: Algorithm, models: Any, groups: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model j (stacked, leading dim m) on index set ``groups[j]``.
        Returns ``(correct [m, C], count [m, C], loss_sum [m])``. Samples per forward:
        :attr:`eval_sizer` (``eval.batch_size``, or by free memory)."""
        outs = []
        for j, g in enumerate(groups):
            model = tree_index(models, j)
            outs.append(eval_groups(algo.predict, model, self.data, [g], self.eval_sizer.one(algo.predict, model,
                                                                                             self.data.x, [g])))
        return tuple(torch.cat([o[i] for o in outs]) for i in range(3))

    def personalized_models(self, algo: Algorithm, states: dict[str, Any], server: dict[str, Any]) -> Any:
        """Every client's personalized model, stacked [K]."""
        k = self.data.num_clients
        return tree_stack([algo.personalized_model(tree_index(states, i), server) for i in range(k)])
