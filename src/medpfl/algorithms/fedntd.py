"""FedNTD (Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning", NeurIPS 2022, Sec. 3, eq. 3-4).

Local objective: ``CE(logits, y) + beta * tau^2 * KL(q~_g || q~_l)``, where q~ are the softmax
(at temperature tau) over the *not-true* classes only (the true class's logit is removed) of
the frozen global model received this round (q~_g) and of the local model (q~_l); the KL is
``KLDivLoss(batchmean)`` as in the official code (``algorithms/fedntd/criterion.py``).
Aggregation as FedAvg. beta = 0 is FedAvg.
"""

from __future__ import annotations

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import weighted_ce, weighted_kl
from medpfl.fl.program import RoundInfo


class FedNTDConfig(MethodConfig):
    """tau = 1 and beta = 1: the paper's default (Sec. 4 and appendix) and the official
    ``config/fedntd.json``."""

    tau: float = Field(1.0, gt=0.0, description="distillation temperature (official config)")
    beta: float = Field(1.0, ge=0.0, description="weight of the not-true distillation (official config)")


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The C-1 logits of the classes other than each sample's label, in class order.
    logits float [B, C], y int64 [B] -> float [B, C-1]."""
    c = logits.shape[-1]
    j = torch.arange(c - 1, device=logits.device).unsqueeze(0)
    idx = j + (j >= y.unsqueeze(-1)).to(j.dtype)
    return torch.gather(logits, -1, idx)


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
             tau: float) -> torch.Tensor:
    """``tau^2 * sum_i w_i KL(softmax(nt(global_i)/tau) || softmax(nt(logits_i)/tau))`` (FedNTD eq. 3)."""
    return tau**2 * weighted_kl(not_true_logits(global_logits, y), not_true_logits(logits, y), w, tau)


class FedNTD(Algorithm):
    name = "fedntd"
    Config = FedNTDConfig
    paper = "Lee et al., Preservation of the Global Knowledge by Not-True Distillation in FL, NeurIPS 2022"
    model_upload = MODEL_UPLOAD  # FedAvg's server: the n_k-weighted mean
    fedavg_when = {"beta": 0.0}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"global": shared["model"]}

    def sample_context(self, ctx, x):
        return {"global_logits": self.forward(ctx["global"], x)}

    def local_loss(self, trees, ctx, batch):
        logits = self.train_forward(trees["model"], batch)
        ce = weighted_ce(logits, batch["y"], batch["w"])
        return ce + self.cfg.beta * ntd_loss(logits, batch["global_logits"], batch["y"], batch["w"], self.cfg.tau)
