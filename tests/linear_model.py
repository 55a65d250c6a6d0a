"""A tiny linear softmax model with closed-form gradients, for the methods' hand-computed tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from medpfl.fl.functional import make_forward


class Linear(nn.Module):
    """Logits ``x.flatten(1) @ W.T + b``; the head is the whole model (``fc``)."""

    head_name = "fc"

    def __init__(self, d: int, c: int):
        super().__init__()
        self.fc = nn.Linear(d, c)

    def forward(self, x, with_features=False, mask=None):
        z = x.flatten(1)
        out = self.fc(z)
        return (z, out) if with_features else out


def kd_hand_case() -> dict:
    """The distillation example the KD methods' hand tests share (pFedKD-WCL, FedGKD): student
    W = 0, b = 0, so p_s = (1/3, 1/3, 1/3) on every sample; teacher W = 0, b = (ln 2, 0, 0), so
    p_t = (1/2, 1/4, 1/4); two samples x = (1, 2), (-1, 3) with labels 0 and 1, batch-mean
    weights (float64). Closed forms: CE = ln 3, KL(p_t || p_s) = 1/2 ln(3/2) + 2 * 1/4 ln(3/4)
    = 1/2 ln(9/8), p_s - p_t = (-1/6, 1/12, 1/12). Weights as nested lists ``[C][D]``."""
    import math

    return {"student": ([[0.0, 0.0]] * 3, [0.0, 0.0, 0.0]),
            "teacher": ([[0.0, 0.0]] * 3, [math.log(2.0), 0.0, 0.0]),
            "x": torch.tensor([[1.0, 2.0], [-1.0, 3.0]], dtype=torch.float64),
            "y": torch.tensor([0, 1]),
            "w": torch.tensor([0.5, 0.5], dtype=torch.float64)}


def linear_algo(name: str, d: int, c: int, **cfg):
    """An algorithm of the registry on the linear model (meta device template)."""
    from medpfl.algorithms import resolve_method

    cls, config = resolve_method(name, {name: cfg} if cfg else {})
    return cls(config, make_forward(Linear(d, c).to("meta")), c)


def ce_grad(W: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of the mean cross-entropy of softmax(x W^T + b) (float64 numpy): ``((p - Y)^T x / n,
    mean(p - Y))``, the closed form of the multinomial logistic regression gradient."""
    z = x @ W.T + b
    z = z - z.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p.T @ x / len(y), p.mean(0)


def as_np(params: dict) -> tuple[np.ndarray, np.ndarray]:
    return params["fc.weight"].detach().double().numpy(), params["fc.bias"].detach().double().numpy()


def random_params(d: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": 0.1 * torch.randn(c, d, generator=g), "fc.bias": 0.1 * torch.randn(c, generator=g)}
