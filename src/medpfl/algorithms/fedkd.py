"""FedKD (Wu et al., "Communication-efficient federated learning via knowledge distillation",
Nature Communications 13, 2032 (2022); code wuch15/FedKD), in the form PFLlib ports it to image
classifiers (``clientkd.py``/``serverkd.py``): the mentee has the mentor's architecture.

Each client keeps a private mentor (its personalized model) and a projection W_h (d x d, no
bias); the mentee is the shared global model. Per batch, with task losses ``CE_t`` (mentor) and
``CE_s`` (mentee) and ``D = CE_t + CE_s``, the client minimises (adaptive mutual distillation,
paper eq. 1-6, nothing detached, as both codes):

    CE_t + KL(p_s || p_t)/D + L_h/D  +  CE_s + KL(p_t || p_s)/D + L_h/D,
    L_h = MSE(z_t, W_h z_s)     (z: penultimate features; mean over samples and dims)

with KL as ``nn.KLDivLoss()``'s default element-wise mean (sum over classes / (B C)). Mentor and
W_h use the round's lr, the mentee ``mentee_lr`` (decayed alike); each model's gradient is
clipped at norm ``max_grad_norm`` (PFLlib).

Communication (paper "dynamic gradient approximation", original code ``run.py``): a client
uploads its mentee *update* (trained minus received) with every matrix sent as its truncated SVD
at the smallest rank whose energy exceeds ``T(r) = T_start + (r + 1)/R (T_end - T_start)``; the
server averages the reconstructed updates (uniformly, as both codes), compresses the average the
same way and broadcasts it to all clients, who add it to their copy of the mentee (so every copy
stays identical to the server's). Round 0 broadcasts the initial mentee. Bytes count the factors
actually sent (:func:`medpfl.fl.payload.payload_nbytes`). PFLlib compresses the mentee weights
instead of the update; the original's update compression is used here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.payload import ArraySpec, TreeSpec, decode_tree, encode_tree
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Download, Federation, Phase, RoundInfo


class FedKDConfig(MethodConfig):
    """T_start 0.95 and T_end 0.98: the original code's defaults (``parameters.py``) and PFLlib's.
    mentee_lr 0.005 and max_grad_norm 10: PFLlib's (``-mlr``; ``clip_grad_norm_(…, 10)``); the
    original trains both BERT models with one Adam optimizer and no clipping."""

    mentee_lr: float = Field(0.005, gt=0.0, description="mentee learning rate at round 0 (PFLlib -mlr)")
    energy_start: float = Field(0.95, gt=0.0, lt=1.0, description="SVD energy threshold T_start (original, PFLlib)")
    energy_end: float = Field(0.98, gt=0.0, lt=1.0, description="SVD energy threshold T_end (original, PFLlib)")
    max_grad_norm: float | None = Field(10.0, gt=0.0, description="per-model gradient clipping (PFLlib)")
    hidden_loss: bool = Field(True, description="the hidden-state loss L_h through W_h (paper eq. 3-4)")


def energy_threshold(round_idx: int, rounds: int, start: float, end: float) -> float:
    """``T(r) = T_start + (r + 1)/R (T_end - T_start)`` (original ``run.py``)."""
    return start + (round_idx + 1) / rounds * (end - start)


def kl_mean(target_logits: torch.Tensor, logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``nn.KLDivLoss()(log_softmax(logits), softmax(target))`` (element-wise mean over B x C) with
    per-sample weights w (1/b on valid samples); gradients flow into both arguments."""
    log_t = F.log_softmax(target_logits, -1)
    log_s = F.log_softmax(logits, -1)
    c = logits.shape[-1]
    return torch.sum(w * torch.sum(log_t.exp() * (log_t - log_s), -1)) / c


def mutual_distillation_loss(z_t, o_t, z_s, o_s, w_h, y, w, hidden: bool = True) -> torch.Tensor:
    """The summed mentor + mentee objective of FedKD (module docstring); all float tensors:
    features [B, d], logits [B, C], w_h [d, d], y int64 [B], w [B]."""
    ce_t = weighted_ce(o_t, y, w)
    ce_s = weighted_ce(o_s, y, w)
    d = ce_t + ce_s
    loss = ce_t + ce_s + kl_mean(o_s, o_t, w) / d + kl_mean(o_t, o_s, w) / d
    if hidden:
        l_h = torch.sum(w * ((z_t - z_s @ w_h.T) ** 2).mean(-1))
        loss = loss + 2.0 * l_h / d
    return loss


class FedKD(Algorithm):
    name = "fedkd"
    Config = FedKDConfig
    paper = "Wu et al., Communication-efficient federated learning via knowledge distillation, Nat. Commun. 2022"
    requires_parts = ("body",)  # distils the body's hidden features

    personalized = True

    def _float_names(self) -> list[str]:
        return [k for k in self.forward.shapes if k not in self.forward.buffers]

    def upload_spec(self):
        shapes = {k: self.forward.shapes[k] for k in self._float_names()}
        return {"update": TreeSpec(shapes, compressed=True), "num_samples": ArraySpec()}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"model": params, "prev": params, "update": None}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        if server["update"] is None:  # round 0: the initial mentee, to everyone
            return Download(shared={"mentee": server["model"]}, to_all=True)
        return Download(shared={"update": server["update"]}, synced={"prev": server["prev"]}, to_all=True)

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        d = self.forward.feature_dim
        w_h = torch.empty(d, d, device=next(iter(params.values())).device)
        torch.nn.init.kaiming_uniform_(w_h, a=math.sqrt(5))  # nn.Linear(d, d, bias=False)'s init
        return {"mentor": clone_params(params), "w_h": {"weight": w_h}}

    def _received_mentee(self, received) -> Params:
        if "mentee" in received:
            return received["mentee"]
        upd = decode_tree(received["update"], self.forward.shapes)
        return {k: (received["prev"][k] + upd[k] if k in upd else received["prev"][k]) for k in received["prev"]}

    def begin(self, received, state, info, rnd):
        mentee = self._received_mentee(received)
        return {"mentor": state["mentor"], "mentee": mentee, "w_h": state["w_h"]}, {"start": mentee}

    def _loss(self, trees, ctx, batch):
        z_t, o_t = self.train_features(trees["mentor"], batch)
        z_s, o_s = self.train_features(trees["mentee"], batch)
        return mutual_distillation_loss(z_t, o_t, z_s, o_s, trees["w_h"]["weight"], batch["y"], batch["w"],
                                        self.cfg.hidden_loss)

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        trainable = {"mentor": None, "mentee": None, **({"w_h": None} if self.cfg.hidden_loss else {})}
        clip = RunOptimizer(max_grad_norm=self.cfg.max_grad_norm)  # per model (PFLlib)
        mentee = replace(clip, lr_scale=self.cfg.mentee_lr / (rnd.base_lr or rnd.lr))
        return [Phase(trainable=trainable, loss=self._loss,
                      optimizer={**dict.fromkeys(trainable, clip), "mentee": mentee})]

    def finish(self, trees, ctx, state, info, rnd):
        energy = energy_threshold(rnd.round, rnd.rounds, self.cfg.energy_start, self.cfg.energy_end)
        delta = {k: trees["mentee"][k] - ctx["start"][k] for k in self._float_names()}
        up = {"update": encode_tree(delta, energy), "num_samples": info["num_samples"]}
        return up, {"mentor": trees["mentor"], "w_h": trees["w_h"]}, trees["mentor"]

    def aggregate(self, server, uploads, clients, rnd):
        energy = energy_threshold(rnd.round, rnd.rounds, self.cfg.energy_start, self.cfg.energy_end)
        mean = {k: v.mean(0) for k, v in decode_tree(uploads["update"], self.forward.shapes).items()}
        update = encode_tree(mean, energy)
        applied = decode_tree(update, self.forward.shapes)
        model = {k: (v + applied[k] if k in applied else v) for k, v in server["model"].items()}
        return {"model": model, "prev": server["model"], "update": update}

    def personalized_model(self, state, server):
        return state["mentor"]
