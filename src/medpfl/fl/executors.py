"""Executors run one round's local training and evaluate many client models.

``SequentialExecutor`` is the reference: clients one after another, each with exact-size
mini-batches, easy to read. ``StackedExecutor`` (:mod:`medpfl.fl.stacked`) runs all of a
round's clients as one vectorised computation and must give the same numbers up to float
tolerance. Both use the same pieces: :func:`medpfl.fl.sampling.batch_plan` for batch order,
the algorithm's pure ``local_loss(params, ctx, batch)``, and :func:`medpfl.fl.functional.sgd_step_`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.config import TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.evaluation import accuracy, eval_groups
from medpfl.fl.functional import Params, clip_by_global_norm_, sgd_step_
from medpfl.fl.sampling import batch_plan
from medpfl.fl.tree import tree_index, tree_map, tree_stack


class SequentialExecutor:
    """Train the sampled clients one after another (the reference executor)."""

    name = "sequential"

    def __init__(self, data: FederatedData, train: TrainConfig, seed: int, eval_batch_size: int):
        self.data = data
        self.train = train
        self.seed = seed
        self.eval_batch_size = eval_batch_size

    def autocast(self):
        """bf16 autocast of the local objective when ``train.precision`` is bf16 (parameters,
        gradients and the optimizer stay float32); a no-op context otherwise."""
        bf16 = self.train.precision == "bf16"
        return torch.autocast(self.data.device.type, dtype=torch.bfloat16, enabled=bf16)

    def sample_context(self, algo: Algorithm, ctx: dict[str, Any], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {}
        for s in range(0, len(ids), self.eval_batch_size):
            for k, v in algo.sample_context(ctx, self.data.x(ids[s:s + self.eval_batch_size])).items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def train_client(self, algo: Algorithm, received: dict[str, Any], state: dict[str, Any], client: int, lr: float,
                     round_idx: int) -> tuple[Params, dict[str, torch.Tensor]]:
        """Local training of one client; returns ``(trained params, info for client_update)``."""
        data, opt, bs = self.data, self.train.optimizer, self.train.batch_size
        ids = data.client_train[client]
        n = len(ids)
        params = tree_map(lambda t: t.detach().clone(), algo.start_params(received, state))
        ctx = algo.context(received, state)
        sctx = self.sample_context(algo, ctx, ids)
        plan = batch_plan(n, bs, self.train.local_epochs, self.seed, round_idx, client).to(data.device)
        steps_per_epoch = -(-n // bs)
        last = n - (steps_per_epoch - 1) * bs
        names = list(algo.forward.trainable)
        buf = {k: torch.zeros_like(params[k]) for k in names}
        for k in names:
            params[k].requires_grad_(True)
        clip = algo.max_grad_norm()
        for s in range(plan.shape[0]):
            nv = last if s % steps_per_epoch == steps_per_epoch - 1 else bs
            pos = plan[s, :nv]
            bid = ids[pos]
            batch = {"x": data.x(bid), "y": data.labels[bid],
                     "w": torch.full((nv,), 1.0 / nv, device=data.device)}
            for k, v in sctx.items():
                batch[k] = v[pos]
            with self.autocast():
                loss = algo.local_loss(params, ctx, batch)
            g = dict(zip(names, torch.autograd.grad(loss, [params[k] for k in names])))
            if clip is not None:
                clip_by_global_norm_(g, clip)
            sgd_step_({k: params[k] for k in names}, g, buf, lr, opt.momentum, opt.weight_decay)
        params = {k: v.detach() for k, v in params.items()}
        info = {"num_samples": torch.tensor(float(n), device=data.device), "label_hist": data.train_hist[client]}
        if algo.needs_train_accuracy:
            info["train_accuracy"] = accuracy(algo.forward, params, data, ids, self.eval_batch_size)
        return params, info

    def train_clients(self, algo: Algorithm, received: dict[str, Any], states: dict[str, Any], clients: np.ndarray,
                      lr: float, round_idx: int) -> tuple[Params, dict[str, Any], dict[str, Any]]:
        """Train the round's clients. states: stacked [m] (rows in ``clients`` order).
        Returns stacked ``(trained params, uploads, new states)``, each with leading dim m."""
        trained, uploads, new_states = [], [], []
        for j, c in enumerate(clients):
            state = tree_index(states, j)
            params, info = self.train_client(algo, received, state, int(c), lr, round_idx)
            up, ns = algo.client_update(params, state, info)
            trained.append(params)
            uploads.append(up)
            new_states.append(ns)
        return tree_stack(trained), tree_stack(uploads), tree_stack(new_states)

    def evaluate_models(self, algo: Algorithm, params: Params, groups: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model j (stacked params, leading dim m) on index set ``groups[j]``.
        Returns ``(correct [m, C], count [m, C], loss_sum [m])``."""
        outs = [eval_groups(algo.forward, tree_index(params, j), self.data, [g], self.eval_batch_size)
                for j, g in enumerate(groups)]
        return tuple(torch.cat([o[i] for o in outs]) for i in range(3))
