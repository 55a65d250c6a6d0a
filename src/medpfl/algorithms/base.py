"""The algorithm interface: what a federated method declares, and nothing more.

A method says (a) what each client keeps between rounds (``init_client_state``), (b) its
local objective as a pure function of parameters and a batch (``local_loss``), (c) what a
client uploads after local training (``client_update``) and (d) how the server combines the
uploads (``aggregate``). The engine (:mod:`medpfl.fl.engine`) owns the round loop, data,
device, optimizer, evaluation and logging.

Shapes: ``Params`` is ``dict[str, Tensor]`` with the model's parameter shapes. In the stacked
executor every per-client function is run under ``torch.func.vmap``, so write them with
tensor ops only (no ``.item()``, no Python branching on tensor values, no in-place ops on
inputs). ``aggregate`` receives the uploads already stacked: every tensor has a leading
client dimension ``m`` (the sampled clients, in schedule order).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from medpfl.fl.functional import Params, weighted_ce


class MethodConfig(BaseModel):
    """Base for per-method hyper-parameters: unknown keys are errors, values are typed."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Algorithm:
    """Base class. Subclasses set ``name``, ``Config`` and override what they change.

    forward: :class:`medpfl.fl.functional.FunctionalModel`, ``forward(state, x) -> logits``
    (float [B, C]; evaluation mode unless ``train=True``); num_classes: C.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    paper: ClassVar[str] = ""
    #: the server keeps a global model that is evaluated on the global test set
    has_global_model: ClassVar[bool] = True
    #: clients keep a personalized model, evaluated on their local test split every round
    personalized: ClassVar[bool] = False
    #: client_update needs the local model's accuracy on its local train set
    needs_train_accuracy: ClassVar[bool] = False
    #: local objective and client update can run under vmap (stacked executor)
    stackable: ClassVar[bool] = True
    #: what crosses from a client to the server: "params" (a model-shaped parameter dict) and
    #: named per-client scalars. The engine rejects any other upload (the privacy boundary).
    upload_keys: ClassVar[tuple[str, ...]] = ("params", "num_samples")

    def __init__(self, cfg: MethodConfig, forward: Callable[[Params, torch.Tensor], torch.Tensor], num_classes: int):
        self.cfg = cfg
        self.forward = forward
        self.num_classes = num_classes

    # ----- client side -------------------------------------------------------------------
    def init_client_state(self, global_params: Params) -> dict[str, Any]:
        """One client's persistent state at round 0 (the engine stacks K copies). Default: none."""
        return {}

    def download(self, global_params: Params) -> dict[str, Any]:
        """What the server sends to each sampled client. Default: the global parameters."""
        return {"params": global_params}

    def start_params(self, received: dict[str, Any], state: dict[str, Any]) -> Params:
        """Where local training starts. Default: the received global model."""
        return received["params"]

    def context(self, received: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """Frozen tensors the local objective reads (e.g. the global model as teacher)."""
        return {}

    def sample_context(self, ctx: dict[str, Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample tensors computed once per round on the local train set (float [n, ...]),
        gathered per batch into ``batch``. Default: none."""
        return {}

    def local_loss(self, params: Params, ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The local objective on one batch: ``batch["x"]`` float [B, C, H, W], ``batch["y"]``
        int64 [B], ``batch["w"]`` float [B] (1/b on the b valid samples, 0 on padding).
        Default: cross-entropy (FedAvg)."""
        return weighted_ce(self.train_forward(params, batch), batch["y"], batch["w"])

    def train_forward(self, params: Params, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of the model being trained on ``batch`` (training mode: BatchNorm uses and
        updates batch statistics over the real samples, ``w > 0``)."""
        return self.forward(params, batch["x"], train=True, mask=batch["w"] > 0)

    def max_grad_norm(self) -> float | None:
        """Clip each local step's gradient to this global L2 norm (None: no clipping)."""
        return None

    def client_update(self, params: Params, state: dict[str, Any], info: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
        """After local training: ``(upload, new state)``. ``info`` holds ``num_samples``
        (float scalar, local train size), ``label_hist`` (float [C], local train labels) and,
        if ``needs_train_accuracy``, ``train_accuracy`` (float scalar). Only ``upload``
        crosses to the server. Default: parameters and sample count (FedAvg)."""
        return {"params": params, "num_samples": info["num_samples"]}, state

    def personalized_params(self, state: dict[str, Any]) -> Params:
        """The client's personalized model (only called when ``personalized``)."""
        raise NotImplementedError

    # ----- server side -------------------------------------------------------------------
    def aggregate(self, global_params: Params, uploads: dict[str, Any]) -> Params:
        """New global parameters from stacked uploads. Default: FedAvg, weights ∝ n_k
        (McMahan et al. 2017; FedKPer eq. 2)."""
        from medpfl.fl.functional import weighted_average

        n = uploads["num_samples"].to(torch.float64)
        return weighted_average(uploads["params"], (n / n.sum()))
