"""FedKPer (Fowler & AlRegib, "FedKPer: Tackling Generalization and Personalization in Medical
Federated Learning via Knowledge Personalization", ICIP 2026; ``../shared/papers/000_*.txt``).

Client (eq. 3): ``loss = CE(q_k, y) + lambda * KL(q_g || q_k)`` where q_g are the predictions
of the frozen global model received this round (the teacher), KL is the batch-mean KL
divergence at temperature ``tau`` (scaled by tau^2; the authors' code uses tau = 1) and
``lambda = min(1 / CE(q_g, y), lambda_cap)``, computed per mini-batch from the teacher's
batch-mean cross-entropy, without gradient (the paper's adaptive reliability weight, capped
at 10). The paper clips gradients at max norm 5; the authors' code does not clip
(protocol Section 5), hence the ``clip_grad_norm`` switch.

Server (eq. 4-6): client k uploads its parameters and the score
``p_k = A_k * (eps + d_k)``, where A_k is the local model's accuracy on its local train set
after training and ``d_k = H(pi_k) / (log C + eps)`` the normalised entropy of its local train
label histogram (``pi_{k,c} = m_{k,c} / (M_k + eps)``, ``H = -sum pi log(pi + eps)``, clipped
to [0, 1]). Aggregation weights are ``p_k / sum_j p_j``; where that is undefined (all scores 0
or not finite) the server falls back to size weights ∝ n_k.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig, ModelUpload, accuracy_pass
from medpfl.fl.functional import Params, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Pass, Phase, RoundInfo


class FedKPerConfig(MethodConfig):
    """Defaults from the paper (Section 3.2). The authors' code differs in two places, set in
    ``config/fedkper-paper.yaml``: no gradient clipping, and eps = 1e-6 in the score (eq. 6)."""

    lambda_cap: float = Field(10.0, gt=0.0, description="cap on the adaptive KD weight lambda (paper Sec. 3.2)")
    tau: float = Field(1.0, gt=0.0, description="distillation temperature (code: 1)")
    score_eps: float = Field(1e-12, ge=0.0, description="eps in p_k = A_k (eps + d_k), eq. 6 (code: 1e-6)")
    entropy_eps: float = Field(1e-12, ge=0.0, description="eps in eq. 4-5 (paper Sec. 3.2: 1e-12 throughout)")
    clip_grad_norm: float | None = Field(
        5.0, gt=0.0, description="max global grad norm per local step (paper Sec. 3.2: 5); null = off (authors' code)")
    use_kd: bool = Field(True, description="knowledge personalization (eq. 3); false = plain CE ('Agg only')")
    use_score_aggregation: bool = Field(True, description="score weights (eq. 6); false = size weights ('KD only')")


def diversity_score(label_hist: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Normalised label entropy ``d_k`` (FedKPer eq. 4-5). label_hist: float [C] counts over
    all C classes; returns a float scalar in [0, 1] (0 for a single-class client, 1 for uniform)."""
    c = label_hist.shape[-1]
    pi = label_hist / (label_hist.sum(-1, keepdim=True) + eps)
    h = -(pi * torch.log(pi + eps)).sum(-1)
    return torch.clamp(h / (math.log(c) + eps), 0.0, 1.0)


def aggregation_scores(train_accuracy: torch.Tensor, label_hist: torch.Tensor, eps: float = 1e-12,
                       entropy_eps: float = 1e-12) -> torch.Tensor:
    """Unnormalised score ``p_k = max(A_k, 0) * (eps + d_k)`` (FedKPer eq. 6)."""
    return torch.clamp(train_accuracy, min=0.0) * (eps + diversity_score(label_hist, entropy_eps))


def aggregation_weights(scores: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
    """``scores / sum(scores)``; size weights ``n_k / sum(n)`` where that is undefined. float [m]."""
    scores = scores.to(torch.float64)
    n = num_samples.to(torch.float64)
    total = scores.sum()
    ok = torch.isfinite(total) & (total > 0)
    return torch.where(ok, scores / torch.where(ok, total, torch.ones_like(total)), n / n.sum())


def adaptive_kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                     lambda_cap: float, tau: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, ce, lambda)`` of FedKPer eq. 3 on one batch (per-sample weights ``w``, float [B]).

    lambda = min(1 / (CE_teacher + 1e-8), lambda_cap), no gradient; KL at temperature tau,
    scaled by tau^2 (``KLDivLoss(batchmean)`` over the valid samples)."""
    ce = weighted_ce(logits, y, w)
    t = teacher_logits.detach()
    g = torch.sum(w * F.cross_entropy(t, y, reduction="none"))
    lam = torch.clamp(1.0 / (g + 1e-8), max=lambda_cap).detach()
    log_q_k = F.log_softmax(logits / tau, dim=-1)
    log_q_g = F.log_softmax(t / tau, dim=-1)
    kl = (tau**2) * torch.sum(w * torch.sum(log_q_g.exp() * (log_q_g - log_q_k), dim=-1))
    return ce + lam * kl, ce, lam


class FedKPer(Algorithm):
    name = "fedkper"
    Config = FedKPerConfig
    paper = "Fowler & AlRegib, FedKPer, ICIP 2026"
    # the score-weighted mean (eq. 2; n_k where the scores are undefined)
    model_upload = ModelUpload("model", "model", ("num_samples", "score"))
    fedavg_when = {"use_kd": False, "use_score_aggregation": False, "clip_grad_norm": None}

    def upload_spec(self):
        return {**super().upload_spec(), "score": ArraySpec()}

    def shared_context(self, shared: dict[str, Any], rnd: RoundInfo) -> dict[str, Any]:
        return {"teacher": shared["model"]} if self.cfg.use_kd else {}

    def sample_context(self, ctx: dict[str, Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.cfg.use_kd:
            return {}
        return {"teacher_logits": self.forward(ctx["teacher"], x)}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        return [Phase(optimizer=RunOptimizer(max_grad_norm=self.cfg.clip_grad_norm))]

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        return [accuracy_pass(self)]  # A_k: the trained model on its local train set (eq. 6)

    def local_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.train_forward(trees["model"], batch)
        if not self.cfg.use_kd:
            return weighted_ce(logits, batch["y"], batch["w"])
        loss, _, _ = adaptive_kd_loss(logits, batch["teacher_logits"], batch["y"], batch["w"],
                                      self.cfg.lambda_cap, self.cfg.tau)
        return loss

    def finish(self, trees, ctx, state, info, rnd):
        acc = (info["train_acc"]["correct"] / info["train_acc"]["count"]).to(torch.float32)
        score = aggregation_scores(acc, info["label_hist"], self.cfg.score_eps, self.cfg.entropy_eps)
        return {"model": trees["model"], "num_samples": info["num_samples"], "score": score}, state, trees["model"]

    def aggregate(self, server, uploads, clients, rnd):
        if self.cfg.use_score_aggregation:
            w = aggregation_weights(uploads["score"], uploads["num_samples"])
        else:
            n = uploads["num_samples"].to(torch.float64)
            w = n / n.sum()
        return {**server, "model": weighted_average(uploads["model"], w)}
