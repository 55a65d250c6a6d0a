"""Functional building blocks of local training: the functional model, cross-entropy with
per-sample weights, weighted averages (the optimizer: :mod:`medpfl.fl.optim`).

Parameters are ``dict[str, Tensor]`` (``Params``). Every function is written so that
``torch.func.vmap`` can run it over a leading client dimension unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

Params = dict[str, torch.Tensor]


class FunctionalModel:
    """``forward(state, x, train=False, mask=None) -> logits`` over a template module whose own
    trainable weights are ignored (build it on the "meta" device).

    Frozen parameters (``requires_grad=False`` in the template: a pretrained backbone under
    LoRA adapters) are not part of any state: the template's own tensors are kept, once, in
    ``frozen`` and given to every call, so all clients share one copy (never stacked, copied or
    uploaded; under ``vmap`` they enter unbatched). A template with frozen parameters must
    therefore hold real weights on the training device (ValueError on "meta").

    ``state`` holds the module's parameters and buffers (BatchNorm running statistics) by
    name; in training mode BatchNorm updates the buffers of ``state`` in place, so each
    client's statistics live in its own state (stacked along the client dimension in the
    stacked executor). ``trainable`` names the parameters SGD updates; ``buffers`` the other
    entries, carried, uploaded and averaged with the parameters. ``mask`` (bool [B]) marks the
    real samples of a padded batch for BatchNorm statistics.

    The model declares its parts (``module.head_name``: the final classifier; everything else
    is the body; optionally ``module.feature_dim``: the width of the head's input, needed when the
    head has no ``weight`` of its own) and returns its penultimate features with
    ``with_features=True``:
    :meth:`features_logits` gives ``(z float [B, d], logits float [B, C])``, :meth:`head`
    applies the classifier of a state to features. ``parts`` maps ``"body"`` and ``"head"``
    (and any part the module declares in ``extra_parts()``) to state names; ``shapes`` every
    state entry's shape. A part may be empty (``mlr``: all head, no body); :meth:`part` and
    :meth:`part_shapes` then raise a ValueError naming the model and the part, so a method that
    splits the model stops at once instead of sharing nothing. ``not_stackable_because``: the
    module's reason why its training step cannot run under ``vmap`` (active dropout; None: it
    can), which :func:`medpfl.fl.engine.make_executor` honours.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.frozen: Params = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
        if any(t.is_meta for t in self.frozen.values()):
            raise ValueError(f"model {getattr(module, 'zoo_name', type(module).__name__)}: its frozen parameters need "
                             "real weights; build the template on the training device, not on 'meta'")
        self.trainable = tuple(name for name, _ in params)
        self.buffers = tuple(name for name, _ in module.named_buffers())
        self.shapes = {n: tuple(t.shape) for n, t in [*params, *module.named_buffers()]}
        self.head_name = getattr(module, "head_name", None)
        self.model_name = getattr(module, "zoo_name", type(module).__name__)
        names = tuple(self.shapes)
        self.parts: dict[str, tuple[str, ...]] = {}
        if self.head_name:
            pre = self.head_name + "."
            self.parts["head"] = tuple(n for n in names if n.startswith(pre))
            self.parts["body"] = tuple(n for n in names if not n.startswith(pre))
        extra = getattr(module, "extra_parts", None)
        if callable(extra):
            self.parts.update({k: tuple(v) for k, v in extra().items()})
        # the head's input width: the model's own ``feature_dim`` where it declares one (a head of several
        # layers, e.g. RoBERTa's dense + out_proj), else the in-features of the head's ``weight``
        declared = getattr(module, "feature_dim", None)
        self.feature_dim = (int(declared) if declared is not None else
                            int(self.shapes[f"{self.head_name}.weight"][1]) if self.head_name else None)
        #: why a training step of this model cannot run under vmap (dropout masks), None if it can
        self.not_stackable_because: str | None = getattr(module, "not_stackable_because", None)
        # functional_call unties shared tensors on every call unless told there are none
        n_all = len(list(module.named_parameters(remove_duplicate=False))) + len(list(module.named_buffers(remove_duplicate=False)))
        self._tied = n_all != len(list(module.named_parameters())) + len(self.buffers)

    def _call(self, module: torch.nn.Module, state: Params, x: torch.Tensor, kwargs: dict | None = None) -> Any:
        return functional_call(module, state, (x,), kwargs, tie_weights=self._tied)

    def _mode(self, train: bool) -> None:
        if self.module.training != train:  # Module.train walks every submodule: only on a change
            self.module.train(train)

    def _kwargs(self, mask: torch.Tensor | None, with_features: bool) -> dict:
        kw: dict = {"with_features": True} if with_features else {}
        if mask is not None and self.buffers:
            kw["mask"] = mask
        return kw

    def _with_frozen(self, state: Params) -> Params:
        return {**self.frozen, **state} if self.frozen else state

    def __call__(self, state: Params, x: torch.Tensor, train: bool = False,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        self._mode(train)
        return self._call(self.module, self._with_frozen(state), x, self._kwargs(mask, False))

    def features_logits(self, state: Params, x: torch.Tensor, train: bool = False,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features float [B, d], logits float [B, C])`` of one forward pass."""
        self._mode(train)
        return self._call(self.module, self._with_frozen(state), x, self._kwargs(mask, True))

    def head(self, state: Params, z: torch.Tensor) -> torch.Tensor:
        """The classifier of ``state`` (its ``head`` part) on features ``z`` float [B, d]."""
        pre = self.head_name + "."
        sub = {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}
        return self._call(self.module.get_submodule(self.head_name), sub, z)

    def part_names(self, name: str) -> tuple[str, ...]:
        """The state names of the named part; ValueError if the model lacks it or it is empty."""
        if name not in self.parts:
            raise ValueError(f"train.model={self.model_name}: no model part {name!r}; the model has "
                             f"{sorted(self.parts)}")
        names = self.parts[name]
        if not names:
            rest = sorted(p for p, v in self.parts.items() if v and p != name)
            raise ValueError(f"train.model={self.model_name}: the model's {name!r} part is empty (its parameters "
                             f"are all in {rest}); a method that shares or trains the {name} apart from the rest "
                             f"(FedPer, FedBABU, FedAS, ...) cannot run on it: choose a train.model with a "
                             f"{name} (e.g. mlp or cnn4)")
        return names

    def part(self, state: Params, name: str) -> Params:
        """The entries of ``state`` that belong to the named part (``body``, ``head``, ...)."""
        return {k: state[k] for k in self.part_names(name)}

    def part_shapes(self, name: str | None = None) -> dict[str, tuple[int, ...]]:
        names = self.shapes if name is None else self.part_names(name)
        return {k: self.shapes[k] for k in names}


def template_on(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """The module as the template of :class:`FunctionalModel`: moved to ``device`` when it has frozen
    parameters (they are used, one shared copy), else to "meta" (its weights are never used)."""
    frozen = any(not p.requires_grad for p in module.parameters())
    return module.to(device if frozen else "meta")


def make_forward(module: torch.nn.Module) -> FunctionalModel:
    """The functional form of ``module`` (see :class:`FunctionalModel`)."""
    return FunctionalModel(module)


def model_state(module: torch.nn.Module) -> Params:
    """Detached copies of a module's trainable parameters and its buffers, by name (the engine's
    model state). Frozen parameters (``requires_grad=False``) are not state: see
    :class:`FunctionalModel`."""
    out = {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad}
    out.update({k: v.detach().clone() for k, v in module.named_buffers()})
    return out


def weighted_ce(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i * CE(logits_i, y_i)``; with ``w = 1/b`` on the b valid samples this is the
    batch-mean cross-entropy, and padded samples (w = 0) contribute nothing.

    logits float [B, C], y int64 [B] (padding may hold any valid class), w float [B].
    """
    # -log_softmax gathered at y is F.cross_entropy(reduction="none") bit for bit; written out,
    # it has batching rules under vmap (cross_entropy falls back to a slower Python decomposition)
    return -torch.sum(w * torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1))


def clone_params(p: Params) -> Params:
    return {k: v.detach().clone() for k, v in p.items()}


def weighted_average(stacked: Params, weights: torch.Tensor) -> Params:
    """``sum_k weights[k] * stacked[name][k]`` for every tensor; weights float [m] summing to 1.
    Integer tensors (BatchNorm's ``num_batches_tracked``) are averaged in float64 and rounded."""
    out = {}
    for k, v in stacked.items():
        if v.is_floating_point():
            w = weights.to(v.dtype).view(-1, *([1] * (v.dim() - 1)))
            out[k] = torch.sum(w * v, dim=0)
        else:
            w = weights.to(torch.float64).view(-1, *([1] * (v.dim() - 1)))
            out[k] = torch.round(torch.sum(w * v.to(torch.float64), dim=0)).to(v.dtype)
    return out


def weighted_kl(target_logits: torch.Tensor, logits: torch.Tensor, w: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """``sum_i w_i KL(softmax(target_i / tau) || softmax(logits_i / tau))``: with ``w = 1/b`` on
    the b valid samples this is ``nn.KLDivLoss(reduction="batchmean")(log_softmax(logits / tau),
    softmax(target / tau))``. No gradient flows into ``target_logits``. [B, C] each; scalar."""
    log_t = F.log_softmax(target_logits.detach() / tau, dim=-1)
    log_s = F.log_softmax(logits / tau, dim=-1)
    return torch.sum(w * torch.sum(log_t.exp() * (log_t - log_s), dim=-1))


def size_weights(num_samples: torch.Tensor) -> torch.Tensor:
    """``n_k / sum(n)`` in float64 (FedAvg's aggregation weights). num_samples float [m]."""
    n = num_samples.to(torch.float64)
    return n / n.sum()
