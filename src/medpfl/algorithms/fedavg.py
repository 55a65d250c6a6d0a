"""FedAvg (McMahan et al., AISTATS 2017): local SGD on cross-entropy, server average of the
client models weighted by local train size (FedKPer eq. 2). No hyper-parameters of its own."""

from __future__ import annotations

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, LocalStepsConfig
from medpfl.fl.program import Phase, RoundInfo


class FedAvgConfig(LocalStepsConfig):
    """FedAvg has no method-specific knobs of its paper; ``local_steps`` (default None: epochs)
    runs a fixed number of mini-batch steps instead (:class:`~medpfl.algorithms.base.LocalStepsConfig`)."""


class FedAvg(Algorithm):
    name = "fedavg"
    Config = FedAvgConfig
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    model_upload = MODEL_UPLOAD  # the n_k-weighted mean of the uploaded models
    fedavg_when = {}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        """One phase on the local train set: ``train.local_epochs`` epochs, or exactly
        ``local_steps`` mini-batches when set."""
        return [Phase(steps=self.cfg.local_steps)]
