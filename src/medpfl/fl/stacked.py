"""The stacked executor: all of a round's clients trained as one vectorised computation.

Client parameters and momentum buffers are stacked along a leading client dimension ``m``;
the algorithm's ``local_loss`` runs under ``torch.func.vmap`` over clients (convolutions with
per-client weights become grouped convolutions, linear layers batched matmuls) and one
``autograd.grad`` of the summed loss gives every client its own gradient (the clients'
parameter slices are independent). Per-client batches are drawn by index from the uint8
images resident on the device; the whole round's batch plan (identical to the sequential
executor's, :func:`medpfl.fl.sampling.batch_plan`) is built before the first step, so there
is no host synchronisation inside the local epochs.

Clients with different data sizes are handled exactly: the clients are sorted by their number
of local steps, so at every step those that still have batches are a prefix of the stack and
the step runs on views of those rows only (a client that has finished is not touched, and no
compute is spent on it); a client's partial last batch of an epoch carries per-sample weights
``1/b`` on its ``b`` real samples and 0 on padding, and BatchNorm statistics use the real
samples only. The per-client arithmetic is that of the sequential executor, up to float
summation order.

``context`` leaves that are the very tensors of ``received`` are shared by all clients
(``in_dims=None``: e.g. FedKPer's teacher runs as one ordinary batched forward); leaves taken
from the client states are per-client. Algorithms must return such leaves unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import vmap

from medpfl.algorithms.base import Algorithm
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.functional import Params, clip_by_global_norm_, sgd_step_
from medpfl.fl.sampling import batch_plan
from medpfl.fl.tree import tree_index


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _dims(tree: Any, batched_ids: set[int]) -> Any:
    """in_dims for vmap: 0 for leaves that belong to the stacked client states, else None."""
    if isinstance(tree, dict):
        return {k: _dims(v, batched_ids) for k, v in tree.items()}
    return 0 if id(tree) in batched_ids else None


def _rows(tree: Any, dims: Any, a: int) -> Any:
    """The first ``a`` clients of the per-client leaves (dims 0); shared leaves unchanged."""
    if isinstance(tree, dict):
        return {k: _rows(v, dims[k], a) for k, v in tree.items()}
    return tree[:a] if dims == 0 else tree


def _row0(tree: Any, dims: Any) -> Any:
    """The first client's slice of the per-client leaves; shared leaves unchanged."""
    if isinstance(tree, dict):
        return {k: _row0(v, dims[k]) for k, v in tree.items()}
    return tree[0] if dims == 0 else tree


def _pad_ids(groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index sets -> (ids int64 [m, L] padded with each set's first id, valid bool [m, L])."""
    lengths = torch.as_tensor([len(g) for g in groups], device=groups[0].device)
    width = int(lengths.max())
    ids = torch.stack([F.pad(g, (0, width - len(g)), value=int(g[0])) if len(g) < width else g for g in groups])
    valid = torch.arange(width, device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    return ids, valid


class StackedExecutor(SequentialExecutor):
    """Vectorised over the round's clients; same results as :class:`SequentialExecutor`."""

    name = "stacked"

    def _shared_or_stacked(self, tree: Any, m: int, batched_ids: set[int]) -> Any:
        """A per-client copy of a tree: stacked leaves are cloned, shared ones repeated m times."""
        if isinstance(tree, dict):
            return {k: self._shared_or_stacked(v, m, batched_ids) for k, v in tree.items()}
        if id(tree) in batched_ids:
            return tree.detach().clone()
        return tree.detach().unsqueeze(0).expand(m, *tree.shape).clone()

    @torch.no_grad()
    def _sample_context(self, algo: Algorithm, ctx: dict, ctx_dims: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        if not ctx:
            return {}
        fn = vmap(algo.sample_context, in_dims=(ctx_dims, 0))
        parts: dict[str, list[torch.Tensor]] = {}
        chunk = max(1, self.eval_batch_size // max(1, ids.shape[0]))
        for s in range(0, ids.shape[1], chunk):
            for k, v in fn(ctx, self.data.x(ids[:, s:s + chunk])).items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v, dim=1) for k, v in parts.items()}

    def train_clients(self, algo: Algorithm, received: dict[str, Any], states: dict[str, Any], clients: np.ndarray,
                      lr: float, round_idx: int) -> tuple[Params, dict[str, Any], dict[str, Any]]:
        data, opt, bs, epochs = self.data, self.train.optimizer, self.train.batch_size, self.train.local_epochs
        dev, m = data.device, len(clients)
        # Clients sorted by decreasing number of local steps: at step s the clients that still
        # have batches are the first n_active[s] rows of the stack, so a step computes on views
        # of exactly those rows (no padded steps, no masks, no host synchronisation).
        sizes = [len(data.client_train[int(c)]) for c in clients]
        steps_k = [epochs * -(-n // bs) for n in sizes]
        order = sorted(range(m), key=lambda j: -steps_k[j])
        order_t = torch.as_tensor(order, device=dev)
        inverse = torch.empty_like(order_t)
        inverse[order_t] = torch.arange(m, device=dev)
        s_clients = [int(clients[j]) for j in order]
        groups = [data.client_train[c] for c in s_clients]
        steps = steps_k[order[0]]
        n_active = [sum(1 for j in order if steps_k[j] > s) for s in range(steps)]

        # The round's batch plan for every client (the sequential executor's), padded: [m, S, B].
        plan = torch.full((m, steps, bs), -1, dtype=torch.int64)
        for j, (g, c) in enumerate(zip(groups, s_clients)):
            p = batch_plan(len(g), bs, epochs, self.seed, round_idx, c)
            plan[j, : p.shape[0]] = p
        plan = plan.to(dev)
        valid = plan >= 0
        weights = valid.to(torch.float32) / valid.sum(-1, keepdim=True).clamp(min=1)  # 1/b on a batch's b samples
        pos = plan.clamp(min=0)
        ids, _ = _pad_ids(groups)  # [m, n_max]
        sample_ids = torch.gather(ids.unsqueeze(1).expand(m, steps, ids.shape[1]), 2, pos)  # [m, S, B]

        s_states = tree_index(states, order_t)
        batched_ids = {id(t) for t in _leaves(s_states)}
        params = self._shared_or_stacked(algo.start_params(received, s_states), m, batched_ids)
        ctx = algo.context(received, s_states)
        ctx_dims = _dims(ctx, batched_ids)
        sctx = self._sample_context(algo, ctx, ctx_dims, ids)
        names = list(algo.forward.trainable)
        buf = {k: torch.zeros_like(params[k]) for k in names}
        loss_fn = vmap(algo.local_loss, in_dims=(0, ctx_dims, 0))
        clip = algo.max_grad_norm()
        labels = data.labels
        for s in range(steps):
            a = n_active[s]
            sid = sample_ids[:a, s]
            batch = {"x": data.x(sid), "y": labels[sid], "w": weights[:a, s]}
            for k, v in sctx.items():
                idx = pos[:a, s].view(a, bs, *([1] * (v.dim() - 2))).expand(a, bs, *v.shape[2:])
                batch[k] = torch.gather(v[:a], 1, idx)
            if a > 1:
                # leaves sharing storage with the stack: in-place SGD and BatchNorm updates land in it
                rows = {k: (v[:a].detach().requires_grad_() if k in buf else v[:a]) for k, v in params.items()}
                with self.autocast():
                    loss = loss_fn(rows, _rows(ctx, ctx_dims, a), batch).sum()
                g = dict(zip(names, torch.autograd.grad(loss, [rows[k] for k in names])))
            else:
                # one client left (the long tail of an unbalanced round): the plain, unbatched step
                one = {k: (v[0].detach().requires_grad_() if k in buf else v[0]) for k, v in params.items()}
                with self.autocast():
                    loss = algo.local_loss(one, _row0(ctx, ctx_dims), {k: v[0] for k, v in batch.items()})
                g = {k: t.unsqueeze(0) for k, t in zip(names, torch.autograd.grad(loss, [one[k] for k in names]))}
                rows = {k: one[k].unsqueeze(0) for k in names}
            if clip is not None:
                clip_by_global_norm_(g, clip, stacked=True)
            sgd_step_({k: rows[k] for k in names}, g, {k: buf[k][:a] for k in names}, lr, opt.momentum,
                      opt.weight_decay)
        params = tree_index({k: v.detach() for k, v in params.items()}, inverse)  # back to schedule order

        groups = [data.client_train[int(c)] for c in clients]
        info = {"num_samples": torch.as_tensor([float(n) for n in sizes], device=dev),
                "label_hist": data.train_hist[torch.as_tensor(clients, device=dev)]}
        if algo.needs_train_accuracy:
            correct, count, _ = self.evaluate_models(algo, params, groups)
            info["train_accuracy"] = (correct.sum(1) / count.sum(1)).to(torch.float32)
        uploads, new_states = vmap(algo.client_update)(params, states, info)
        return params, uploads, new_states

    @torch.no_grad()
    def evaluate_models(self, algo: Algorithm, params: Params, groups: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model j on ``groups[j]``, all models at once. Returns ``(correct [m, C], count [m, C],
        loss_sum [m])`` (float64)."""
        data, c = self.data, self.data.num_classes
        m = len(groups)
        ids, valid = _pad_ids(groups)
        fwd = vmap(algo.forward)
        correct = torch.zeros(m, c, dtype=torch.float64, device=data.device)
        count = torch.zeros_like(correct)
        loss = torch.zeros(m, dtype=torch.float64, device=data.device)
        chunk = max(1, self.eval_batch_size // m)
        rows = torch.arange(m, device=data.device).unsqueeze(1)
        for s in range(0, ids.shape[1], chunk):
            b, ok = ids[:, s:s + chunk], valid[:, s:s + chunk].to(torch.float64)
            y = data.labels[b]
            logits = fwd(params, data.x(b))
            hit = (logits.argmax(-1) == y).to(torch.float64) * ok
            key = (rows * c + y).reshape(-1)
            count.view(-1).index_add_(0, key, ok.reshape(-1))
            correct.view(-1).index_add_(0, key, hit.reshape(-1))
            ce = F.cross_entropy(logits.reshape(-1, c).float(), y.reshape(-1), reduction="none").view_as(ok)
            loss += (ce.to(torch.float64) * ok).sum(1)
        return correct, count, loss
