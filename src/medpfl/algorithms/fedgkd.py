"""FedGKD (Yao et al., "FedGKD: Toward Heterogeneous Federated Learning via Global Knowledge
Distillation", IEEE Trans. Computers 73, 3-17, 2023, as pFedKD-WCL cites it), as the pFedKD-WCL
paper runs it as a baseline (Hu et al., Algorithms 2025, ``../shared/papers/003_*.txt`` §5; official code
HengruiH/pFedKD ``algorithms/fedgkd.py``; spec ``methods-pfedkdwcl-epfl.md`` A.2, A.4).

Client: FedAvg-style local training (the engine's epochs) from the received global model on

    CE(q_k, y) + (alpha / 2) * T^2 * KL(softmax(t / T) || softmax(s / T))

with s the local model's logits, t the logits of the frozen *teacher* (evaluation mode) and the
KL ``KLDivLoss(batchmean)`` over the batch, as the pFedKD code writes it.

Teacher: the parameter average of the last ``buffer_size`` (M) global models. The buffer lives in
the server state (checkpointed with it): a ring of M model-shaped rows and the number of
aggregations so far; after each aggregation the new global model enters it (the oldest leaves
once M are held). The initial model w_0 never enters the buffer (both the pFedKD code and the
FedGKD authors' code append the aggregated model only); before the first aggregation the
teacher is w_0 itself (the pFedKD code's ``deepcopy`` of the initial global model). So in round
r (0-based) the teacher is w_0 for r = 0 and the mean of w_max(1, r-M+1) .. w_r for r >= 1.

Download: the global model and the teacher, both shared (``bytes_down`` counts two models per
sampled client, the extra communication the pFedKD paper notes). With M = 1 the teacher is the
received global model and is not sent (as the FedGKD code's ``buffer_length <= 1``); with
alpha = 0 nothing but the model is sent and the method is FedAvg.

Server: FedAvg (weights ∝ n_k). Evaluation: the global model (the pFedKD code), not personalized.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import Params, weighted_average, weighted_ce, weighted_kl
from medpfl.fl.program import Download, Federation, RoundInfo


class FedGKDConfig(MethodConfig):
    """Defaults of the pFedKD-WCL paper's FedGKD baseline (§5: "temperature 1, penalty weight on
    KL 0.001, buffer length 5"; code: ``loss = alpha/2 * kd + ce``), the table this project
    reproduces. The FedGKD authors' code (CGCL-codes/FedGKD README) runs
    ``--distillation_coefficient 0.1`` on ``coefficient * T^2 * KL`` (no 1/2), T = 1, M = 5."""

    kl_weight: float = Field(0.001, ge=0.0, description="alpha: the loss adds (alpha/2) T^2 KL "
                             "(pFedKD-WCL paper §5 and its code; FedGKD authors' code: 0.1 without the 1/2)")
    temperature: float = Field(1.0, gt=0.0, description="distillation temperature T (pFedKD-WCL §5; FedGKD code: 1)")
    buffer_size: int = Field(5, ge=1, description="M: how many latest global models the teacher averages "
                             "(pFedKD-WCL §5, FedGKD code --buffer_length 5)")


def gkd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
             kl_weight: float, temperature: float) -> torch.Tensor:
    """``CE + (kl_weight / 2) * T^2 * KL(softmax(t/T) || softmax(s/T))`` with per-sample weights
    ``w`` (float [B]: 1/b on the b real samples, 0 on padding). logits, teacher_logits float
    [B, C]; y int64 [B]. No gradient flows into ``teacher_logits``."""
    kl = weighted_kl(teacher_logits, logits, w, temperature)
    return weighted_ce(logits, y, w) + (kl_weight / 2) * temperature**2 * kl


def buffer_push(buffer: Params, count: torch.Tensor, model: Params, size: int) -> tuple[Params, torch.Tensor]:
    """``(buffer, count)`` after ``model`` enters the ring: row ``count % size`` is replaced (the
    oldest once ``size`` models are held). buffer: ``{name: [size, *shape]}``; count: int64 scalar,
    the number of models pushed so far. The inputs are not modified. Device ops only (the slot
    is an index tensor: ``count`` is never read on the host)."""
    slot = torch.remainder(count.to(torch.int64), size).reshape(1)
    new = {k: v.index_copy(0, slot.to(v.device), model[k].unsqueeze(0).to(v.dtype)) for k, v in buffer.items()}
    return new, count + 1


def buffer_mean(buffer: Params, count: torch.Tensor, size: int) -> Params:
    """The parameter average of the ``min(count, size)`` models held (count >= 1); integer
    entries (BatchNorm's ``num_batches_tracked``) are averaged and rounded. Device ops only:
    weights ``1/n`` on the first ``n = min(count, size)`` rows and 0 on the rest (rows not yet
    filled are zeros, so the sum is that of the n held models: the same float64 weight 1/n, and
    exact zeros added last). With ``count == 0`` every weight is 0 (the mean of nothing is
    zeros; :meth:`FedGKD.teacher` then uses the current model)."""
    dev = next(iter(buffer.values())).device
    n = torch.clamp(count.to(device=dev, dtype=torch.int64), max=size)
    held = torch.arange(size, device=dev) < n
    w = held.to(torch.float64) / n.clamp(min=1).to(torch.float64)
    return weighted_average(buffer, w)


class FedGKD(Algorithm):
    name = "fedgkd"
    Config = FedGKDConfig
    paper = ("Yao et al., FedGKD: Toward Heterogeneous Federated Learning via Global Knowledge Distillation, "
             "IEEE Trans. Computers 2023 (as the pFedKD-WCL paper's baseline)")
    model_upload = MODEL_UPLOAD  # the n_k-weighted mean, which its buffer then stores
    fedavg_when = {"kl_weight": 0.0}

    @property
    def _distils(self) -> bool:
        return self.cfg.kl_weight > 0

    @property
    def _sends_teacher(self) -> bool:
        return self._distils and self.cfg.buffer_size > 1

    # ----- server ---------------------------------------------------------------------------
    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        m = self.cfg.buffer_size
        return {"model": params,
                "buffer": {k: torch.zeros((m, *v.shape), dtype=v.dtype, device=v.device) for k, v in params.items()},
                "buffer_count": torch.zeros((), dtype=torch.int64, device=next(iter(params.values())).device)}

    def teacher(self, server: dict[str, Any]) -> Params:
        """The teacher of the next round: the average of the last <= M global models, or the
        current (initial) global model before the first aggregation."""
        count = server["buffer_count"]
        mean = buffer_mean(server["buffer"], count, self.cfg.buffer_size)
        # the current model where the buffer is empty; a device-side choice (no host read of the count)
        return {k: torch.where(count > 0, mean[k], v) for k, v in server["model"].items()}

    def download(self, server: dict[str, Any], clients: torch.Tensor, rnd: RoundInfo) -> Download:
        if not self._sends_teacher:
            return Download(shared={"model": server["model"]})
        return Download(shared={"model": server["model"], "teacher": self.teacher(server)})

    def aggregate(self, server, uploads, clients, rnd):
        n = uploads["num_samples"].to(torch.float64)
        model = weighted_average(uploads["model"], n / n.sum())
        buffer, count = buffer_push(server["buffer"], server["buffer_count"], model, self.cfg.buffer_size)
        return {**server, "model": model, "buffer": buffer, "buffer_count": count}

    # ----- client ---------------------------------------------------------------------------
    def shared_context(self, shared: dict[str, Any], rnd: RoundInfo) -> dict[str, Any]:
        if not self._distils:
            return {}
        return {"teacher": shared["teacher"] if self._sends_teacher else shared["model"]}

    def sample_context(self, ctx: dict[str, Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self._distils:
            return {}
        return {"teacher_logits": self.forward(ctx["teacher"], x)}

    def local_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.train_forward(trees["model"], batch)
        if not self._distils:
            return weighted_ce(logits, batch["y"], batch["w"])
        return gkd_loss(logits, batch["teacher_logits"], batch["y"], batch["w"], self.cfg.kl_weight,
                        self.cfg.temperature)
