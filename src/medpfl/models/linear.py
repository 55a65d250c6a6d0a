"""Fully connected models of the pFedKD-WCL study (methods-pfedkdwcl-epfl.md A.2 "Models"):
``mlr``, multinomial logistic regression, and ``mlp``, one hidden layer.

Both flatten their input, so they take images float [B, C, H, W] (d_in = C*H*W, e.g. 784 for
MNIST) as well as vectors float [B, d] (d_in = d, e.g. 60 for Synthetic(alpha, beta)). They
return logits; the engine's losses apply the softmax (the paper's log_softmax + NLL is CE).
PyTorch default ``nn.Linear`` initialisation, as the official code [C].

Parts (``head_name`` = ``classifier`` for both):

- ``mlr``: ``classifier`` = Linear(d_in, C). The head is the whole model; the body is empty, so
  the methods that share or train the body apart from the head (FedPer, FedBABU, FedAS) stop
  with an error naming the empty part (:meth:`medpfl.fl.functional.FunctionalModel.part`). Its
  "features" are the flattened input (the head's input, d = d_in): the head applied to them gives
  the logits, but feature-contrasting methods (MOON) see the same features for every model.
- ``mlp``: ``fc1`` = Linear(d_in, hidden) -> ReLU is the body (features: the hidden
  activations, d = hidden); ``classifier`` = Linear(hidden, C) is the head.

Parameters: mlr 784*10 + 10 = 7,850 on MNIST; mlp (hidden 128) 784*128 + 128 + 128*10 + 10 =
101,770.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLR(nn.Module):
    """Input float [B, ...] with ``prod(...) = d_in``, output logits float [B, num_classes].

    ``mask`` is accepted and ignored (no BatchNorm); ``with_features=True`` returns
    ``(x.flatten(1), logits)``."""

    head_name = "classifier"

    def __init__(self, d_in: int, num_classes: int):
        super().__init__()
        self.classifier = nn.Linear(d_in, num_classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        z = x.flatten(1)
        logits = self.classifier(z)
        return (z, logits) if with_features else logits


class MLP(nn.Module):
    """Input float [B, ...] with ``prod(...) = d_in``, output logits float [B, num_classes].

    ``mask`` is accepted and ignored (no BatchNorm); ``with_features=True`` returns ``(z,
    logits)`` with z float [B, hidden] the hidden activations after the ReLU."""

    head_name = "classifier"

    def __init__(self, d_in: int, num_classes: int, hidden: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        z = F.relu(self.fc1(x.flatten(1)))
        logits = self.classifier(z)
        return (z, logits) if with_features else logits
