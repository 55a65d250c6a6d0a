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
    Device ops only: the group sizes are the tensors' shapes (host metadata), so no value is
    read on the host and nothing is copied to or from it.
    """
    c = data.num_classes
    ids = torch.cat(groups)
    # each sample's group: one fill per group from the host-known sizes (repeat_interleave would
    # need the sizes as a device tensor, i.e. a host-to-device copy)
    gid = torch.cat([torch.full((len(g),), j, dtype=torch.int64, device=ids.device) for j, g in enumerate(groups)])
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
    """Rows of :class:`medpfl.data.schemas.EvalRecords` from per-class counts (correct, count
    float64 [G, C], loss float64 [G]; one ``.cpu()`` each where they are on a device:
    :class:`RoundRecords` copies a whole round's counts at once instead)."""
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


class RoundRecords:
    """A round's evaluation counts, kept on the device while the round runs and turned into
    records after it, from one host copy for all of them (:func:`medpfl.fl.tree.to_host`).

    :meth:`add` a view's counts as they are computed; :meth:`tensors` are what the host copy
    takes (3 per view: correct, count float64 [G, C], loss float64 [G]); :meth:`rows` builds the
    rows of :class:`medpfl.data.schemas.EvalRecords` from their host copies, exactly as
    :func:`records_from_counts` builds them from the device tensors (same values, same order)."""

    def __init__(self, round_idx: int):
        self.round_idx = round_idx
        self._views: list[tuple[str, list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def add(self, view: str, client_ids, counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The counts ``(correct [G, C], count [G, C], loss_sum [G])`` of ``view`` for the G
        clients ``client_ids`` (-1: the global test set), in row order. Nothing is read."""
        self._views.append((view, [int(c) for c in client_ids], tuple(counts)))

    def tensors(self) -> list[torch.Tensor]:
        """Every count tensor added, in order (3 per view)."""
        return [t for _, _, counts in self._views for t in counts]

    def rows(self, host: list[torch.Tensor]) -> list[dict]:
        """The records, from the host copies of :meth:`tensors` (same order). Raises
        ValueError on a list of another length."""
        if len(host) != 3 * len(self._views):
            raise ValueError(f"RoundRecords.rows: {len(host)} tensors for {len(self._views)} views (3 each)")
        out: list[dict] = []
        for j, (view, ids, _) in enumerate(self._views):
            out += records_from_counts(self.round_idx, view, ids, *host[3 * j:3 * j + 3])
        return out
