"""PFPS-LWC (Liu, Gong, Fang, González & Rodrigues, "Personalized Federated Learning with
Progressive Local Training Strategy and Lightweight Classifier", Appl. Sci. 2025, 15, 2481;
spec ``../shared/docs/methods-fedmic-pfpslwc.md`` part B).

FedPer (:mod:`medpfl.algorithms.fedper`) plus two client-side additions; the server, the
upload (the body theta only), the aggregation (∝ n_k over the round's participants) and the
personalized model ((theta_i^l, phi_i); a client never sampled: (theta_g, phi_i)) are FedPer's,
inherited unchanged.

**Progressive Local Training (PLT, Sec. 3.2, Eq. 2-4).** On a sampled client that has trained
before, a *recall* phase first trains the client's copy theta of the received global body
towards the features of its frozen saved body theta_i^l (its body after its last local
training, i.e. the body of the model FedPer keeps in the client state), on its local train
images, without labels:

    L_sim = (1/b) sum_j [1 - cos(f(theta_i^l, x_j), f(theta, x_j))]          (Eq. 3)

with f the body's output features z (float [b, d], the model's penultimate features, the
input of the head). theta_i^l's features are computed once per round in evaluation mode
(``sample_context``: a frozen "soft label"); theta's in training mode. Only the body is
trained (the head is a constant of the phase). Skipped on a client's first participation
(theta_i^l = NULL): the phase's per-client ``epochs`` is 0 while ``state["trained"]`` is 0.

**Lightweight Classifier (LWC, Sec. 3.3, Eq. 7-9).** The local objective on (theta, phi_i) is

    L_local = CE(h_phi(f_theta(x)), y) + lam * ||phi||_2                    (Eq. 7, 9)

||phi||_2 the *unsquared* L2 norm over every head parameter (weights and bias), so its
gradient is lam * phi / ||phi|| (not weight decay); it reads the head only.

With ``plt=False, lwc=False`` every hook is FedPer's own (the same code, not a copy), so the
run equals FedPer's to the bit (``tests/test_pfpslwc.py``); the paper's Table 5 (x, x) row is
FedPer's numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import MethodConfig
from medpfl.algorithms.fedper import FedPer
from medpfl.fl.functional import Params
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Phase, RoundInfo


class PFPSLWCConfig(MethodConfig):
    """Paper (Sec. 4.2, Table 5): lam = 0.02; PLT and LWC on (the ablation switches of Table 5).
    The recall stage's schedule is not stated (spec B.2): 1 epoch over the local train set with
    the local training's optimizer (its lr, momentum, weight decay) and batch size (spec B.2
    READING; ``recall_epochs`` is the spec's OPTION)."""

    plt: bool = Field(True, description="Progressive Local Training: the label-free recall phase (Sec. 3.2, Eq. 2-4; "
                                        "Table 5 'PLT')")
    lwc: bool = Field(True, description="Lightweight Classifier: + lam * ||phi||_2 on the head (Sec. 3.3, Eq. 7-9; "
                                        "Table 5 'LWC')")
    lam: float = Field(0.02, ge=0.0, description="LWC weight lambda (paper Sec. 4.2: 0.02; sensitivity Fig. 7)")
    recall_epochs: int = Field(1, ge=1, description="recall epochs over the local train set (unstated; spec B.2 "
                                                    "READING 1, OPTION E)")
    recall_lr: float | None = Field(None, gt=0.0, description="absolute recall lr; null = the round's training lr "
                                                              "(spec B.2 READING: the local training's SGD)")
    recall_batch_size: int | None = Field(None, ge=1, description="null = train.batch_size (spec B.2 READING)")
    recall_momentum: float | None = Field(None, ge=0.0, lt=1.0, description="null = train.optimizer.momentum "
                                                                            "(spec B.2: the local optimizer)")
    recall_weight_decay: float | None = Field(None, ge=0.0, description="null = train.optimizer.weight_decay "
                                                                        "(spec B.2: the local optimizer)")


def head_l2_norm(head: Params) -> torch.Tensor:
    """``||phi||_2 = sqrt(sum_k phi_k^2)`` over every leaf of ``head`` (weights and bias; PFPS-LWC
    Eq. 9): a float scalar, unsquared. Its gradient is ``phi / ||phi||`` (0 at phi = 0)."""
    return torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in head.values()]))


def recall_distance(z: torch.Tensor, z_saved: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j (1 - cos(z_saved_j, z_j))`` (PFPS-LWC Eq. 3): with ``w = 1/b`` on the b real
    samples the batch mean of the cosine distance. z, z_saved float [B, d]; w float [B]."""
    return torch.sum(w * (1.0 - F.cosine_similarity(z_saved, z, dim=-1)))


class PFPSLWC(FedPer):
    name = "pfpslwc"
    Config = PFPSLWCConfig
    paper = ("Liu, Gong, Fang, González & Rodrigues, Personalized Federated Learning with Progressive Local "
             "Training Strategy and Lightweight Classifier, Appl. Sci. 2025, 15, 2481")

    def begin(self, received, state, info, rnd):
        trees, ctx = super().begin(received, state, info, rnd)
        if not self.cfg.plt:
            return trees, ctx
        # theta_i^l: the body of the client's last trained model (its FedPer state), frozen
        return trees, {**ctx, "saved": state["model"], "trained": state["trained"]}

    def sample_context(self, ctx: dict[str, Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``recall_z``: f(theta_i^l, x), float [n, d], in evaluation mode (no labels)."""
        if not self.cfg.plt:
            return super().sample_context(ctx, x)
        z, _ = self.forward.features_logits(ctx["saved"], x)
        return {"recall_z": z}

    def recall_epochs_for(self, ctx: dict[str, Any]) -> torch.Tensor:
        """int64 scalar: ``recall_epochs`` on a client that trained before, else 0 (no theta_i^l)."""
        return (ctx["trained"] > 0).to(torch.int64) * self.cfg.recall_epochs

    def recall_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Eq. 3 on one batch; reads ``x``, ``w`` and ``recall_z``, never ``y``."""
        z, _ = self.train_features(trees["model"], batch)
        return recall_distance(z, batch["recall_z"], batch["w"])

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        train = super().phases(rnd)
        if not self.cfg.plt:
            return train
        c = self.cfg
        recall = Phase(name="recall", trainable={"model": "body"}, loss=self.recall_loss,
                       epochs=self.recall_epochs_for, batch_size=c.recall_batch_size,
                       optimizer=RunOptimizer(lr=c.recall_lr, momentum=c.recall_momentum,
                                              weight_decay=c.recall_weight_decay))
        return [recall, *train]

    def local_loss(self, trees, ctx, batch):
        """CE (FedPer's objective), plus ``lam * ||phi||_2`` of the head with LWC (Eq. 7)."""
        ce = super().local_loss(trees, ctx, batch)
        if not self.cfg.lwc:
            return ce
        return ce + self.cfg.lam * head_l2_norm(self.forward.part(trees["model"], "head"))
