"""FedBABU (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022; code jhoon-oh/FedBABU).

The head is randomly initialised once (the same for every client) and never updated during
federated training: clients train only the body (the head is frozen: no gradient, no momentum,
no weight decay), upload only the body, and the server averages the bodies (weights ∝ n_k).
The global model is the averaged body with that fixed head.

**Personalization** (``personalization``):

- ``final`` (default; the FedBABU paper, Sec. 4 "personalization": "the global model is
  fine-tuned on each client's training set" after federated training; official ``analysis.ipynb``;
  PFLlib ``serverbabu.py``, which calls every client's ``fine_tune`` after the last round): at the
  last round every client, sampled or not, fine-tunes the **final global model** (averaged body,
  fixed head) on its local train split (``finetune_*``) and the fine-tuned copy is scored on its
  local test split. The fine-tuning is the engine's evaluation-time adaptation
  (``adaptation_phases``), run for all K clients as one batch of clients by the stacked executor
  (one sequential fine-tune after another on the sequential one). At the other evaluation rounds
  the personalized view scores the global model with the fixed head (the paper's "initial"
  accuracy, before fine-tuning). Training never fine-tunes: ``local_after_training`` scores the
  client's locally trained model (trained body, fixed head). A client never sampled is scored
  like every other: the fine-tuned final global model.
- ``every_eval``: the same fine-tuning at every evaluation round (``eval.every``), so the
  personalized curve is "fine-tuned from this round's global model"; costs K fine-tunes per
  evaluation round.
- ``per_visit`` (medpfl's earlier reading, kept as an option): each sampled client fine-tunes
  a copy of its locally trained model right after local training; that copy is scored in
  ``local_after_training`` and kept as its personalized model until its next visit; a client
  never sampled is scored with the global model (averaged body, the random fixed head).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig, ModelUpload
from medpfl.fl.functional import Params, size_weights, weighted_average
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.optim import sgd
from medpfl.fl.program import Download, Federation, Phase, RoundInfo


class FedBABUConfig(MethodConfig):
    """Fine-tuning as the official evaluation (``analysis.ipynb``, ``--ft_ep 5``): 5 epochs of SGD
    at lr 1e-3, momentum 0.9, no weight decay, batch 50, on the whole model. PFLlib fine-tunes 10
    epochs at the local lr (``finetune_epochs: 10, finetune_lr: null``)."""

    finetune_epochs: int = Field(5, ge=0, description="fine-tuning epochs (official --ft_ep)")
    finetune_lr: float | None = Field(1e-3, gt=0.0, description="absolute lr; null = the round's lr (PFLlib)")
    finetune_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="official notebook")
    finetune_weight_decay: float = Field(0.0, ge=0.0, description="official notebook")
    finetune_batch_size: int | None = Field(50, ge=1, description="official notebook; null = train.batch_size")
    finetune_part: Literal["all", "head", "body"] = Field("all", description="what fine-tuning trains (paper: all)")
    personalization: Literal["final", "every_eval", "per_visit"] = Field(
        "final", description="fine-tune the final global model on every client before scoring (FedBABU paper "
                             "Sec. 4; PFLlib serverbabu.py), the same at every evaluation round, or each sampled "
                             "client's trained model right after its local training (medpfl's earlier reading)")


class FedBABU(Algorithm):
    name = "fedbabu"
    Config = FedBABUConfig
    paper = "Oh, Kim & Yun, FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022"
    model_upload = ModelUpload("body", "body", ("num_samples",))  # the n_k-weighted mean of the bodies
    requires_parts = ("body", "head")  # shares the body, freezes the head

    personalized = True

    def upload_spec(self):
        return {"body": TreeSpec(self.forward.part_shapes("body")), "num_samples": ArraySpec()}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        return Download(shared={"body": self.forward.part(server["model"], "body")})

    @property
    def per_visit(self) -> bool:
        return self.cfg.personalization == "per_visit"

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        # the fixed head every client holds from the shared initialisation (and, per visit, the
        # last fine-tuned model and whether there is one)
        head = self.forward.part(params, "head")
        if not self.per_visit:
            return {"head": head}
        return {"head": head, "personal": dict(params), "tuned": torch.zeros((), device=next(iter(params.values())).device)}

    def begin(self, received, state, info, rnd):
        return {"model": {**state["head"], **received["body"]}}, {}

    def finetune_phase(self, tree: str, rnd: RoundInfo) -> Phase:
        """``finetune_epochs`` of SGD on ``tree`` (its ``finetune_part``) at the fine-tuning lr
        (null: the round's), momentum, weight decay and batch size (the FedBABU paper's
        personalization step; SGD as the official notebook and PFLlib, whatever ``train.optimizer``)."""
        c = self.cfg
        part = None if c.finetune_part == "all" else c.finetune_part
        lr = c.finetune_lr if c.finetune_lr is not None else rnd.lr
        return Phase(name="finetune", trainable={tree: part}, loss=self.ce_loss(tree), epochs=c.finetune_epochs,
                     optimizer=sgd(lr, momentum=c.finetune_momentum, weight_decay=c.finetune_weight_decay),
                     batch_size=c.finetune_batch_size)

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        out = [Phase(trainable={"model": "body"})]
        if self.per_visit and self.cfg.finetune_epochs > 0:
            ft = self.finetune_phase("personal", rnd)
            out.append(dataclasses.replace(ft, init=lambda t, ctx: {**t, "personal": t["model"]}))
        return out

    def adaptation_phases(self, rnd: RoundInfo) -> list[Phase]:
        """``final``: the fine-tuning at the last round only; ``every_eval``: at every evaluation
        round; ``per_visit`` (or ``finetune_epochs: 0``): none."""
        c = self.cfg
        if self.per_visit or c.finetune_epochs == 0:
            return []
        if c.personalization == "final" and rnd.round != rnd.rounds - 1:
            return []
        return [self.finetune_phase("model", rnd)]

    def finish(self, trees, ctx, state, info, rnd):
        up = {"body": self.forward.part(trees["model"], "body"), "num_samples": info["num_samples"]}
        if not self.per_visit:
            return up, state, trees["model"]
        personal = trees.get("personal", trees["model"])
        return up, {"head": state["head"], "personal": personal, "tuned": torch.ones_like(state["tuned"])}, personal

    def aggregate(self, server, uploads, clients, rnd):
        body = weighted_average(uploads["body"], size_weights(uploads["num_samples"]))
        return {**server, "model": {**server["model"], **body}}

    def personalized_model(self, state, server):
        """``final``/``every_eval``: the global model (fine-tuned by ``adaptation_phases`` where
        they apply); ``per_visit``: the client's last fine-tuned model, else the global model."""
        if not self.per_visit:
            return server["model"]
        t = state["tuned"] > 0
        return {k: torch.where(t, state["personal"][k], v) for k, v in server["model"].items()}
