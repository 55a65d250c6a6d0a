"""FedAvg (McMahan et al., AISTATS 2017): local SGD on cross-entropy, server average of the
client models weighted by local train size (FedKPer eq. 2). No hyper-parameters of its own."""

from __future__ import annotations

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig


class FedAvgConfig(MethodConfig):
    """FedAvg has no method-specific knobs."""


class FedAvg(Algorithm):
    name = "fedavg"
    Config = FedAvgConfig
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    model_upload = MODEL_UPLOAD  # the n_k-weighted mean of the uploaded models
    fedavg_when = {}
