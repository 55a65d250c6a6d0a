"""FedBN (Li, Jiang, Zhang, Kamp & Dou, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization", ICLR 2021; official code med-air/FedBN ``federated/fed_digits.py``
``communication``; PFLlib ``clientbn.py``).

The model's BatchNorm layers stay with each client: their weight and bias (trained locally)
and their running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``). The
BN entries are read from the model (its ``bn`` part, :meth:`medpfl.models.cnn.CNN4.extra_parts`),
never matched by name; a model without BatchNorm (``cnn4``, ``mlp``, ``mlr``) stops at the
start of the run with an error naming ``train.model``.

With S the state names of the model and B the ``bn`` part, the shared part is S \\ B (for
``cnn4bn``: the convolutions, ``fc`` and the classifier). A round:

- the server sends the shared part w_g (float tensors by name) to the sampled clients;
- client k trains ``{**w_g, **bn_k}`` (its own BN entries from its state) on cross-entropy for
  the local epochs (every parameter, BN weight and bias included, is trained; BN statistics
  are updated in training mode), keeps the trained BN entries as its state, and uploads the
  trained shared part and n_k (``bytes_up``: the shared part and n_k only);
- the server averages the shared parts, ``w_g <- sum_k a_k w_k`` with a_k = n_k / sum_j n_j
  (``weighting: num_samples``, FedAvg / PFLlib's aggregation) or 1/m (``uniform``: the official
  code's ``client_weights = 1/client_num``, whose clients hold equally many samples).

There is no single global model: the shared part alone cannot predict, and no BN statistics
belong to the federation, so the global-test columns are not applicable
(``has_global_model`` False). A client's personalized model is the current shared part with its
own BN entries (for a client never sampled: its initial BN entries), which is what the
official code and PFLlib score after each round. Scoring every client with the current shared
part assumes every client receives it (both codes copy it into all clients), so the download
is a broadcast to all K clients (``to_all``: ``bytes_down`` counts K copies of the shared part).
Right after training (``local_after_training``) a client is scored with its trained model.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import Params, size_weights, weighted_average
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.program import Download, Federation, RoundInfo


class FedBNConfig(MethodConfig):
    """Aggregation weights ∝ n_k: FedAvg's, as PFLlib's FedBN (``serverbase`` weighs by the
    clients' train sizes); the official code weighs its equally sized clients 1/K
    (``weighting: uniform``). Nothing else is a knob: which layers stay local is the model's
    ``bn`` part."""

    weighting: Literal["num_samples", "uniform"] = Field(
        "num_samples", description="weights of the shared-part average: n_k / sum n (FedAvg; PFLlib's FedBN) or "
                                   "1/m (official med-air/FedBN code, equally sized clients)")


class FedBN(Algorithm):
    name = "fedbn"
    Config = FedBNConfig
    paper = "Li, Jiang, Zhang, Kamp & Dou, FedBN: Federated Learning on Non-IID Features via Local Batch " \
            "Normalization, ICLR 2021"
    model_upload = MODEL_UPLOAD  # the weighted mean of the non-BN part
    requires_parts = ("bn",)

    has_global_model = False
    personalized = True

    # ----- the split -------------------------------------------------------------------------
    def bn_names(self) -> tuple[str, ...]:
        """The state names of the model's BatchNorm layers (its ``bn`` part); ValueError naming
        ``train.model`` when the model has none."""
        names = self.forward.parts.get("bn", ())
        if not names:
            why = "its 'bn' part is empty" if "bn" in self.forward.parts else "it declares no 'bn' part"
            raise ValueError(f"train.model={self.forward.model_name}: FedBN keeps the model's BatchNorm layers local, "
                             f"and this model has none ({why}); choose a train.model with BatchNorm (e.g. cnn4bn)")
        return names

    def shared_names(self) -> tuple[str, ...]:
        """Every other state name (parameters and buffers), in the model's order: what is averaged."""
        bn = set(self.bn_names())
        return tuple(k for k in self.forward.shapes if k not in bn)

    def _part(self, params: Params, names: tuple[str, ...]) -> Params:
        return {k: params[k] for k in names}

    def _whole(self, shared: Params, bn: Params) -> Params:
        merged = {**shared, **bn}
        return {k: merged[k] for k in self.forward.shapes}

    # ----- server ------------------------------------------------------------------------------
    def upload_spec(self):
        return {"model": TreeSpec({k: self.forward.shapes[k] for k in self.shared_names()}),
                "num_samples": ArraySpec()}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"model": self._part(params, self.shared_names())}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        return Download(shared={"model": server["model"]}, to_all=True)

    def aggregate(self, server, uploads, clients, rnd):
        n = uploads["num_samples"]
        w = size_weights(n) if self.cfg.weighting == "num_samples" else size_weights(torch.ones_like(n))
        return {**server, "model": weighted_average(uploads["model"], w)}

    # ----- client ------------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"bn": {k: v.detach().clone() for k, v in self._part(params, self.bn_names()).items()}}

    def begin(self, received, state, info, rnd):
        return {"model": self._whole(received["model"], state["bn"])}, {}

    def finish(self, trees, ctx, state, info, rnd):
        model = trees["model"]
        up = {"model": self._part(model, self.shared_names()), "num_samples": info["num_samples"]}
        return up, {"bn": self._part(model, self.bn_names())}, model

    def personalized_model(self, state, server):
        return self._whole(server["model"], state["bn"])
