"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated Learning",
ICLR 2021; official code hongyouc/FedBE), the FedMIC paper's knowledge-distillation baseline
(``../shared/docs/methods-fedmic-pfpslwc.md`` A.11).

Clients: FedAvg's local training (CE, the engine's epochs), upload the model and n_k.

Server, every round, from the m uploaded models w_1..w_m (weights a_k = n_k / Σ n):

1. the FedAvg mean w̄ = Σ a_k w_k;
2. a Gaussian fitted to the client models, and M models sampled from it (``gaussian``):
   ``paper`` (Sec. 4): N(μ, diag σ²) with μ = Σ a_k w_k and σ² = Σ a_k (w_k − μ)², per
   entry; a sample is μ + s σ ε, ε ~ N(0, I), s = ``var_scale``. ``code`` (``swag.py``
   ``SWAG_server``, mode ``gaussian``): per tensor, the clients' updates from the model sent
   this round, d_k = w_k − w_sent, are normalised, u_k = d_k / ‖d_k‖; μ_u and σ²_u are their
   unweighted mean and variance (σ² clamped at 1e-5), and a sample is w_sent + (μ_u + s σ_u ε)
   · mean_k ‖d_k‖, s = 0.1. Only the trainable parameters are sampled (``sample_buffers``:
   also the float buffers, as the code); the other entries are w̄'s;
3. the ensemble: w̄ (``include_mean``), the m client models (``include_clients``) and the M
   samples; each member in evaluation mode; the pseudo-label of a server sample x is the mean
   of the members' softmax outputs, p̄(x) = (1/|E|) Σ_e softmax(f_e(x)), sharpened with the
   temperature T as the code (``temp_sharpen``): p ∝ max(p̄^{1/T}, 1e-8) (T = 1: p̄ itself);
4. distillation into the global model: the student starts from w̄ and runs ``distill_epochs``
   epochs of SGD (training mode) over the unlabeled server images, shuffled every epoch, in
   batches of ``distill_batch_size`` (the last one partial; a last batch of one sample is
   skipped on a model with BatchNorm), on the KL divergence KL(p ‖ softmax(student)) (the
   code's ``(P * (P.log() - Q.log())).mean()``: a mean over samples and classes; ``kl_reduction:
   batchmean`` sums over classes) or, with ``loss: ce``, CE on argmax p;
5. with ``swa`` the sent model is the SWA average (Izmailov et al. 2018, torchcontrib's ``SWA``
   as the code uses it): after every step t (counted from 1) with t > ``swa_start`` and
   t % ``swa_freq`` == 0 the student's trainable parameters enter a running average, which
   replaces them at the end (no average taken: the last iterate; the buffers are the last
   iterate's, the code's ``bn_update`` runs for its ResNet only and is not done here).

The server images come from the partition's server data (``partitions.<name>.server_data``: a
held-out part of the official val split, in no client); the method sees the images only, never
their labels (``Algorithm.server_data``). All server-side draws (the Gaussian samples, the
distillation order) use CPU generators seeded from (run seed, round), so a run is the same on
both executors and after a resume. The server-side computation runs in float32 outside the
client executors. With ``distill_epochs: 0`` the sent model is w̄ and the method is FedAvg.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, weighted_average
from medpfl.fl.optim import sgd
from medpfl.fl.program import RoundInfo
from medpfl.fl.sampling import derive_seed

#: server samples per forward pass when the ensemble labels the server data (evaluation mode; the
#: code's ``DataLoader(..., batch_size=1024)``); it does not change the numbers
LABEL_CHUNK = 1024


class FedBEConfig(MethodConfig):
    """Defaults: the paper (Sec. 4–5, Algorithm 1) where it states a value, the official code
    (hongyouc/FedBE ``utils/options.py``, ``swag.py``, ``models/Update.py`` ``ServerUpdate``)
    where it does not. The FedMIC paper ("uniform baseline parameters as reported in the original
    publications", A.9) adds none; its local training is the study's ``train`` section."""

    num_samples: int = Field(10, ge=0, description="M, models sampled from the Gaussian (paper's experiments: M = 10; "
                                                   "code --num_sample_teacher 10)")
    include_mean: bool = Field(True, description="the FedAvg mean w̄ is an ensemble member (paper Alg. 1; code: "
                                                 "added unless --dont_add_fedavg)")
    include_clients: bool = Field(True, description="the round's client models are ensemble members (paper Sec. 4 / "
                                                    "Alg. 1; the code's default leaves them out: --use_client off)")
    gaussian: Literal["paper", "code"] = Field(
        "paper", description="paper: diagonal Gaussian over the client weights, n-weighted mean and variance (Sec. "
                             "4.2); code: swag.py's Gaussian over per-tensor normalised updates, scaled back by the "
                             "mean update norm (unweighted, variance clamped at 1e-5)")
    var_scale: float | None = Field(None, ge=0.0, description="s, the standard deviation's factor; null: the "
                                    "form's own (paper 1, code --var_scale 0.1)")
    sample_buffers: bool = Field(False, description="also sample the float buffers (BatchNorm statistics), as the "
                                 "code does (a sampled running variance may turn negative); false: they are w̄'s")
    temperature: float = Field(0.5, gt=0.0, description="T of the code's temp_sharpen on the mean softmax (code "
                               "--temp 0.5 with --loss_type KL; 1 = no sharpening); the paper states none")
    loss: Literal["kl", "ce"] = Field("kl", description="distillation loss: KL to the soft pseudo-labels (code "
                                      "--loss_type KL) or CE on their argmax (code --loss_type CE)")
    kl_reduction: Literal["mean", "batchmean"] = Field(
        "mean", description="mean: the code's (P (log P - log Q)).mean() over samples and classes; batchmean: summed "
                            "over classes, averaged over samples (nn.KLDivLoss batchmean)")
    distill_epochs: int = Field(20, ge=0, description="server distillation epochs over the server data (code "
                                "--server_ep 20); 0: no distillation, FedAvg")
    distill_batch_size: int = Field(128, ge=1, description="server batch size (code --server_bs 128)")
    distill_lr: float = Field(1e-3, gt=0.0, description="server SGD lr (code ServerUpdate.set_opt: lr=1e-3, "
                              "hard-coded; its --server_lr 0.01 is unused)")
    distill_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="server SGD momentum (code set_opt: 0.9)")
    distill_weight_decay: float = Field(1e-5, ge=0.0, description="server SGD weight decay (code set_opt: 1e-5)")
    swa: bool = Field(True, description="send the SWA average of the distillation iterates (paper Sec. 4: SWA "
                      "for distillation; code --use_SWA, off by default) instead of the last iterate")
    swa_start: int = Field(500, ge=0, description="SWA averages after step swa_start (code SWA(swa_start=500)); "
                           "steps counted over the round's distillation")
    swa_freq: int = Field(25, ge=1, description="SWA averages every swa_freq steps (code SWA(swa_freq=25))")


# ----- the defining math (tested by hand) -------------------------------------------------------
def diagonal_gaussian(models: Params, weights: torch.Tensor, names) -> tuple[Params, Params]:
    """The paper's Gaussian: ``(μ, σ²)`` per entry of ``names``, μ = Σ_k a_k w_k and σ² = Σ_k a_k
    (w_k − μ)². models: stacked [m, ...]; weights float [m] summing to 1."""
    mean, var = {}, {}
    for k in names:
        v = models[k]
        a = weights.to(v.dtype).view(-1, *([1] * (v.dim() - 1)))
        mu = torch.sum(a * v, dim=0)
        mean[k] = mu
        var[k] = torch.sum(a * (v - mu) ** 2, dim=0)
    return mean, var


def update_gaussian(models: Params, base: Params, names, var_clamp: float = 1e-5) -> tuple[Params, Params, Params]:
    """The code's Gaussian (``SWAG_server.compute_mean_sq`` / ``compute_var``): per tensor, the
    updates d_k = w_k − base normalised to unit L2 norm (a zero update stays zero), their
    unweighted mean μ_u and variance max(E[u²] − μ_u², var_clamp), and the mean norm. Returns
    ``(μ_u, σ²_u, mean norm)`` (the norm a scalar tensor per name)."""
    mean, var, norm = {}, {}, {}
    for k in names:
        d = models[k] - base[k].unsqueeze(0)
        nrm = torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=1)
        u = d / torch.where(nrm > 0, nrm, torch.ones_like(nrm)).view(-1, *([1] * (d.dim() - 1)))
        mu = u.mean(0)
        mean[k] = mu
        var[k] = torch.clamp((u**2).mean(0) - mu**2, min=var_clamp)
        norm[k] = nrm.mean()
    return mean, var, norm


def ensemble_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    """The Bayesian model ensemble's prediction: the mean of the members' softmax outputs.
    logits: one float [B, C] per member. Returns float [B, C]."""
    return torch.stack([F.softmax(z.float(), dim=-1) for z in logits]).mean(0)


def sharpen(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """The code's ``temp_sharpen``: ``max(p^{1/T}, 1e-8)`` renormalised over classes; T = 1
    returns ``p`` unchanged."""
    if temperature == 1.0:
        return p
    q = torch.clamp(p ** (1.0 / temperature), min=1e-8)
    return q / q.sum(-1, keepdim=True)


def distill_loss(logits: torch.Tensor, target: torch.Tensor, loss: str = "kl", reduction: str = "mean") -> torch.Tensor:
    """KL(target ‖ softmax(logits)) averaged over samples and classes (``mean``, the code) or
    over samples only (``batchmean``); or (``loss: ce``) CE on ``argmax target``. logits,
    target float [B, C] (target rows sum to 1, no gradient)."""
    if loss == "ce":
        return F.cross_entropy(logits, target.argmax(-1))
    terms = torch.special.xlogy(target, target) - target * F.log_softmax(logits, dim=-1)
    return terms.mean() if reduction == "mean" else terms.sum(-1).mean()


class FedBE(Algorithm):
    name = "fedbe"
    Config = FedBEConfig
    paper = "Chen & Chao, FedBE: Making Bayesian Model Ensemble Applicable to Federated Learning, ICLR 2021"
    fedavg_when = {"distill_epochs": 0}
    uses_server_data = True

    # ----- server ---------------------------------------------------------------------------
    def aggregate(self, server: dict[str, Any], uploads: dict[str, Any], clients: torch.Tensor,
                  rnd: RoundInfo) -> dict[str, Any]:
        n = uploads["num_samples"].to(torch.float64)
        a = n / n.sum()
        mean = weighted_average(uploads["model"], a)
        if self.cfg.distill_epochs == 0:
            return {**server, "model": mean}
        members = self.ensemble(server["model"], uploads["model"], a, mean, rnd)
        targets = self.pseudo_labels(members)
        return {**server, "model": self.distill(mean, targets, rnd)}

    def sampled_names(self) -> tuple[str, ...]:
        """The state entries the Gaussian covers: the trainable parameters, plus the float
        buffers with ``sample_buffers``."""
        names = tuple(self.forward.trainable)
        if self.cfg.sample_buffers:
            names += tuple(b for b in self.forward.buffers if "num_batches_tracked" not in b)
        return names

    def sample_models(self, sent: Params, models: Params, weights: torch.Tensor, mean: Params,
                      rnd: RoundInfo) -> list[Params]:
        """The M models drawn from the Gaussian fitted to the round's client models (the draws:
        a CPU generator seeded from (run seed, round), ε per sample and entry in state order)."""
        names = self.sampled_names()
        g = torch.Generator().manual_seed(derive_seed("fedbe-samples", rnd.seed, rnd.round))
        if self.cfg.gaussian == "paper":
            mu, var = diagonal_gaussian(models, weights, names)
            scale = 1.0 if self.cfg.var_scale is None else self.cfg.var_scale
        else:
            mu, var, norm = update_gaussian(models, sent, names)
            scale = 0.1 if self.cfg.var_scale is None else self.cfg.var_scale
        out = []
        for _ in range(self.cfg.num_samples):
            w = dict(mean)
            for k in names:
                eps = torch.randn(mu[k].shape, generator=g, dtype=torch.float32).to(mu[k].device, mu[k].dtype)
                draw = mu[k] + scale * torch.sqrt(var[k]) * eps
                w[k] = draw if self.cfg.gaussian == "paper" else sent[k] + draw * norm[k]
            out.append(w)
        return out

    def ensemble(self, sent: Params, models: Params, weights: torch.Tensor, mean: Params,
                 rnd: RoundInfo) -> list[Params]:
        """The ensemble's members: w̄, the client models and the M sampled models (as configured)."""
        members = [mean] if self.cfg.include_mean else []
        if self.cfg.include_clients:
            m = int(weights.shape[0])
            members += [{k: v[i] for k, v in models.items()} for i in range(m)]
        members += self.sample_models(sent, models, weights, mean, rnd)
        if not members:
            raise ValueError("fedbe: the ensemble is empty (include_mean and include_clients false, num_samples 0)")
        return members

    @torch.no_grad()
    def pseudo_labels(self, members: list[Params]) -> torch.Tensor:
        """float [S, C]: the sharpened mean softmax of the members on every server image."""
        data = self.server_data
        if data is None or len(data) == 0:
            raise ValueError("fedbe: no server data attached (the engine attaches partitions.<name>.server_data)")
        out = []
        for start in range(0, len(data), LABEL_CHUNK):
            pos = torch.arange(start, min(start + LABEL_CHUNK, len(data)))
            x = data.x(pos)
            out.append(ensemble_probs([self.forward(w, x) for w in members]))
        return sharpen(torch.cat(out), self.cfg.temperature)

    def distill(self, init: Params, targets: torch.Tensor, rnd: RoundInfo) -> Params:
        """The student (from ``init``) after the server's SGD on the distillation loss, or its
        SWA average (see the module docstring)."""
        cfg, data = self.cfg, self.server_data
        student = {k: v.detach().clone() for k, v in init.items()}
        names = list(self.forward.trainable)
        for k in names:
            student[k].requires_grad_(True)
        trained = {k: student[k] for k in names}
        opt = sgd(cfg.distill_lr, cfg.distill_momentum, cfg.distill_weight_decay)  # torch.optim.SGD (code set_opt)
        opt_state = opt.init(trained)
        swa_sum = {k: torch.zeros_like(student[k]) for k in names} if cfg.swa else None
        swa_n = 0
        s = len(data)
        g = torch.Generator().manual_seed(derive_seed("fedbe-distill", rnd.seed, rnd.round))
        has_bn = bool(self.forward.buffers)
        step = 0
        for _ in range(cfg.distill_epochs):
            perm = torch.randperm(s, generator=g)
            for start in range(0, s, cfg.distill_batch_size):
                pos = perm[start:start + cfg.distill_batch_size]
                if len(pos) < 2 and has_bn:
                    continue  # BatchNorm cannot normalise a batch of one in training mode
                logits = self.forward(student, data.x(pos), train=True)
                loss = distill_loss(logits, targets[pos.to(targets.device)], cfg.loss, cfg.kl_reduction)
                grads = torch.autograd.grad(loss, [student[k] for k in names])
                opt.step_(trained, dict(zip(names, grads)), opt_state, count=step + 1)
                step += 1
                if cfg.swa and step > cfg.swa_start and step % cfg.swa_freq == 0:
                    with torch.no_grad():
                        for k in names:
                            swa_sum[k].add_(student[k])
                    swa_n += 1
        out = {k: v.detach() for k, v in student.items()}
        if swa_n:
            out.update({k: swa_sum[k] / swa_n for k in names})
        return out
