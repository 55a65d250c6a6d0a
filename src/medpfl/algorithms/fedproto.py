"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022, arXiv 2105.00243; official code yuetan031/FedProto ``lib/update.py``,
``lib/utils.py``, ``exps/federated_main.py``; PFLlib ``clientproto.py``/``serverproto.py``).

No model parameter crosses. Every client keeps its whole model (initialised from the run's
shared initial weights, persistent across rounds). With f the model's penultimate features
(its ``body``; z float [B, d]) and C classes:

- **Local prototypes** (paper Eq. 2): after local training, a pass over the client's local train
  set with its trained model (evaluation mode) gives, per class j,
  ``C_i^(j) = (1 / |D_ij|) sum_{(x, y) in D_ij} f(x)`` (float [C, d]; zero rows for the classes
  it does not hold) and the counts ``|D_ij|`` (float [C]). These two arrays are the upload:
  ``C d + C`` numbers (``ArraySpec((C, d))``, ``ArraySpec((C,))``); no per-sample tensor, no
  parameter.
- **Global prototypes** (server): per class j, over the clients k of the round that hold it
  (``|D_kj| > 0``): ``uniform`` (default) ``P_j = mean_k C_k^(j)`` (the official
  ``proto_aggregation`` and PFLlib), or ``count`` ``P_j = sum_k |D_kj| C_k^(j) / sum_k |D_kj|``
  (the paper's Eq. 6 weights |D_kj| / N_j; as printed, Eq. 6 also divides by the number of
  holders, a factor its appendix's q_i, which sum to 1, does not have: not reproduced). A class
  no client of the round holds has no global prototype next round (PFLlib rebuilds them from
  each round's uploads; ``keep_missing_classes: true`` keeps its last one instead). The
  download is the global prototypes P float [C, d] and the mask ``has`` bool [C] of classes
  that have one.
- **Local loss** (official ``update_weights_het``; the paper's appendix, Eq. for L):
  ``CE + lam * sum_i w_i * has[y_i] * mean_d (f(x_i) - P[y_i])^2``, i.e. ``nn.MSELoss`` between
  the batch's features and their classes' global prototypes, where a sample whose class has
  no prototype contributes 0 (and still counts in the mean, as the code's copy of its own
  feature). P is a constant. Before the first aggregation no class has a prototype: plain CE.
- **Prediction** (``predict_with``): ``prototypes`` (default; the paper's "prototype-based model
  inference" ``argmin_j ||f(x) - P_j||``, PFLlib's ``test_metrics``): logits ``-mean_d (f(x) -
  P_j)^2`` for the classes with a prototype; the others get the largest of those distances plus
  1 (never the argmin, finite loss; the official code gives them 100, PFLlib infinity), and a
  model with no prototype at all (round 0's ``local_after_training``) predicts with its
  classifier. ``classifier``: the local model's own head (the official code's "w/o protos"
  accuracy, printed next to the "with protos" one). The official code restricts the candidates
  to the client's own classes; here every class with a global prototype is a candidate (PFLlib).

There is no global model (the global-test columns are not applicable). A client's
personalized model is its own model with the current global prototypes; scoring every client
with them assumes that every client receives them (PFLlib's ``send_protos`` sends to all), so with
``predict_with: prototypes`` the download is a broadcast to all K clients (``to_all``) and
``bytes_down`` counts K copies; with ``classifier`` only the round's clients receive them.

The official code collects the prototypes from the training forward passes of the last local
epoch (training mode, a model that changes between batches; PFLlib: of all local epochs); here
they are the trained model's features, as Eq. 2 defines them (the same for a model without
BatchNorm, up to those in-epoch updates).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.payload import ArraySpec
from medpfl.fl.program import Download, Federation, Pass, RoundInfo


class FedProtoConfig(MethodConfig):
    """lam 1: the official code's ``--ld`` default (README: 1 for MNIST and FEMNIST, 0.1 for
    CIFAR-10; the paper's appendix: the best lambda is 1, 1 and 0.1 for them). Aggregation
    uniform over the holders of a class: official ``proto_aggregation`` and PFLlib (the paper's
    Eq. 6 weighs by the class counts: ``count``). Prediction by the nearest global prototype:
    the paper's prototype-based inference and PFLlib (``classifier``: the local head). Classes
    without an upload in a round lose their global prototype: PFLlib."""

    lam: float = Field(1.0, ge=0.0, description="weight of the prototype regularizer (official code --ld, default 1; "
                                                "paper appendix: 1 MNIST/FEMNIST, 0.1 CIFAR-10)")
    proto_weighting: Literal["uniform", "count"] = Field(
        "uniform", description="global prototype: plain mean over the round's clients holding the class (official "
                               "proto_aggregation, PFLlib) or weighted by their class counts (paper Eq. 6)")
    predict_with: Literal["prototypes", "classifier"] = Field(
        "prototypes", description="nearest global prototype (paper's prototype-based inference, PFLlib test_metrics) "
                                  "or the local classifier (the official code's 'w/o protos' accuracy)")
    keep_missing_classes: bool = Field(
        False, description="a class no client of the round holds keeps its last global prototype (false: it has "
                           "none until a holder is sampled again, as PFLlib rebuilds them every round)")


def class_prototypes(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, num_classes: int
                     ) -> dict[str, torch.Tensor]:
    """Per-class feature sums and counts of one batch: ``{"sum": float [C, d], "count": float [C]}``.
    z float [B, d], y int64 [B], valid bool [B] (padding excluded)."""
    onehot = torch.nn.functional.one_hot(y, num_classes).to(z.dtype) * valid.to(z.dtype).unsqueeze(-1)  # [B, C]
    return {"sum": onehot.T @ z, "count": onehot.sum(0)}


def local_prototypes(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``C^(j) = sum_j / count_j`` (paper Eq. 2), zero rows where ``count_j = 0``. sums [C, d], counts [C]."""
    return sums / counts.clamp(min=1).unsqueeze(-1)


def aggregate_prototypes(protos: torch.Tensor, counts: torch.Tensor, weighting: str = "uniform"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global prototypes from m clients' uploads: ``(P float [C, d], has bool [C])``.

    protos float [m, C, d], counts float [m, C]. Only clients with ``counts[k, j] > 0`` enter class
    j: ``uniform`` ``P_j = mean over them of protos[k, j]``; ``count`` ``P_j = sum_k counts[k, j]
    protos[k, j] / sum_k counts[k, j]``. A class no client holds: zero row, ``has`` False."""
    holds = counts > 0
    w = holds.to(protos.dtype) if weighting == "uniform" else torch.where(holds, counts, 0).to(protos.dtype)
    total = w.sum(0)  # [C]
    has = total > 0
    p = torch.einsum("mc,mcd->cd", w, protos) / torch.where(has, total, torch.ones_like(total)).unsqueeze(-1)
    return torch.where(has.unsqueeze(-1), p, torch.zeros_like(p)), has


def prototype_regularizer(z: torch.Tensor, y: torch.Tensor, w: torch.Tensor, protos: torch.Tensor,
                          has: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i * has[y_i] * mean_d (z_i - P[y_i])^2``: with w = 1/b on the b valid samples the
    official code's ``MSELoss(proto_new, protos)``, where a sample whose class has no global
    prototype contributes 0. z float [B, d], y int64 [B], w float [B], protos [C, d], has bool [C].
    No gradient flows into ``protos``."""
    target = protos.detach()[y]  # [B, d]
    err = ((z - target) ** 2).mean(-1)  # [B]
    return torch.sum(w * has[y].to(z.dtype) * err)


def prototype_logits(z: torch.Tensor, protos: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """``-mean_d (z - P_j)^2`` for the classes with a prototype; the others get minus (the largest
    of those distances + 1), so that they are never the argmax and the loss stays finite.
    z float [B, d], protos [C, d], has bool [C]; float [B, C]."""
    dist = ((z.unsqueeze(-2) - protos) ** 2).mean(-1)  # [B, C]
    worst = torch.where(has, dist, torch.full_like(dist, -torch.inf)).amax(-1, keepdim=True)  # [B, 1]
    return -torch.where(has, dist, worst + 1.0)


class FedProto(Algorithm):
    name = "fedproto"
    Config = FedProtoConfig
    paper = "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"
    requires_parts = ("body",)

    has_global_model = False
    personalized = True

    def _check_body(self) -> None:
        if not self.forward.parts.get("body"):
            raise ValueError(f"train.model={self.forward.model_name}: FedProto's prototypes are the model's "
                             f"penultimate features, and the model's 'body' part is empty (its features are its raw "
                             f"input: the prototypes would be class-mean inputs and the regularizer would have no "
                             f"gradient); choose a train.model with a body (e.g. mlp or cnn4)")

    def _shapes(self) -> tuple[int, int]:
        return self.num_classes, int(self.forward.feature_dim)

    def upload_spec(self):
        c, d = self._shapes()
        return {"protos": ArraySpec((c, d)), "counts": ArraySpec((c,))}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        self._check_body()
        c, d = self._shapes()
        dev = next(iter(params.values())).device
        return {"protos": torch.zeros(c, d, device=dev), "has": torch.zeros(c, dtype=torch.bool, device=dev)}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        return Download(shared={"protos": server["protos"], "has": server["has"]},
                        to_all=self.cfg.predict_with == "prototypes")

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"model": clone_params(params)}

    def shared_context(self, shared, rnd: RoundInfo) -> dict[str, Any]:
        return {"global_protos": shared["protos"], "has_proto": shared["has"]}

    def begin(self, received, state, info, rnd):
        return {"model": state["model"]}, {}

    def local_loss(self, trees, ctx, batch):
        z, logits = self.train_features(trees["model"], batch)
        ce = weighted_ce(logits, batch["y"], batch["w"])
        if self.cfg.lam == 0:
            return ce
        reg = prototype_regularizer(z, batch["y"], batch["w"], ctx["global_protos"], ctx["has_proto"])
        return ce + self.cfg.lam * reg

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        c = self.num_classes

        def protos(trees, ctx, batch):
            z, _ = self.forward.features_logits(trees["model"], batch["x"])
            return class_prototypes(z, batch["y"], batch["w"] > 0, c)

        return [Pass("protos", protos, when="after")]

    def finish(self, trees, ctx, state, info, rnd):
        p = info["protos"]
        up = {"protos": local_prototypes(p["sum"], p["count"]).to(torch.float32),
              "counts": p["count"].to(torch.float32)}
        model = {"model": trees["model"], "protos": ctx["global_protos"], "has": ctx["has_proto"]}
        return up, {"model": trees["model"]}, model

    def aggregate(self, server, uploads, clients, rnd):
        p, has = aggregate_prototypes(uploads["protos"], uploads["counts"], self.cfg.proto_weighting)
        if self.cfg.keep_missing_classes:
            p = torch.where(has.unsqueeze(-1), p, server["protos"])
            has = has | server["has"]
        return {**server, "protos": p, "has": has}

    def personalized_model(self, state, server):
        return {"model": state["model"], "protos": server["protos"], "has": server["has"]}

    def predict(self, model: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        """Logits float [B, C] of ``{"model": params, "protos": [C, d], "has": bool [C]}``:
        prototype logits (:func:`prototype_logits`), or the classifier's where no class has a
        prototype or ``predict_with`` is ``classifier``."""
        z, logits = self.forward.features_logits(model["model"], x)
        if self.cfg.predict_with == "classifier":
            return logits
        return torch.where(model["has"].any(), prototype_logits(z, model["protos"], model["has"]), logits)
