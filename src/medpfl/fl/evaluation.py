"""The evaluation protocol, in one place for every method and executor.

Per evaluated round (``eval.every``, and always the last round):
  - ``global_test``: the global model on the global test set (official test split);
  - ``global_on_local``: the global model on every client's local test split;
  - ``personalized_on_local``: every client's personalized model on its local test split
    (methods with a personalized model);
and every round:
  - ``local_after_training``: each sampled client's model right after local training on its
    local test split (the FedKPer code's ``local on local`` columns).

Counts are kept per class so that plain and class-balanced accuracy both come out exactly.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from medpfl.fl.data import FederatedData
from medpfl.fl.functional import Params
from medpfl.metrics import balanced_accuracy


@torch.no_grad()
def eval_groups(forward: Callable, params: Params, data: FederatedData, groups: list[torch.Tensor],
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One model on several index sets at once (e.g. the global model on every local test split).

    groups: G int64 index tensors. Returns ``(correct [G, C], count [G, C], loss_sum [G])``,
    float64 on the data's device; count[g, c] is the number of class-c samples in group g.
    """
    c = data.num_classes
    ids = torch.cat(groups)
    gid = torch.repeat_interleave(torch.arange(len(groups), device=ids.device),
                                  torch.as_tensor([len(g) for g in groups], device=ids.device))
    correct = torch.zeros(len(groups) * c, dtype=torch.float64, device=ids.device)
    count = torch.zeros_like(correct)
    loss = torch.zeros(len(groups), dtype=torch.float64, device=ids.device)
    for s in range(0, len(ids), batch_size):
        b = ids[s:s + batch_size]
        y = data.labels[b]
        logits = forward(params, data.x(b))
        key = gid[s:s + batch_size] * c + y
        count.index_add_(0, key, torch.ones_like(key, dtype=torch.float64))
        correct.index_add_(0, key, (logits.argmax(-1) == y).to(torch.float64))
        loss.index_add_(0, gid[s:s + batch_size], F.cross_entropy(logits.float(), y, reduction="none").to(torch.float64))
    return correct.view(-1, c), count.view(-1, c), loss


def records_from_counts(round_idx: int, view: str, client_ids: list[int], correct: torch.Tensor, count: torch.Tensor,
                        loss: torch.Tensor) -> list[dict]:
    """Rows of :class:`medpfl.data.schemas.EvalRecords` from per-class counts ([G, C])."""
    correct, count, loss = correct.cpu().numpy(), count.cpu().numpy(), loss.cpu().numpy()
    rows = []
    for g, cid in enumerate(client_ids):
        n = count[g].sum()
        rows.append({
            "round": round_idx,
            "view": view,
            "client_id": int(cid),
            "n_samples": int(n),
            "correct": int(round(correct[g].sum())),
            "accuracy": float(correct[g].sum() / n),
            "balanced_accuracy": balanced_accuracy(correct[g], count[g]),
            "loss": float(loss[g] / n),
        })
    return rows
