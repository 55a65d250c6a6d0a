"""Client-level differential privacy by DP-FedAvg, its accountant, and the engine's upload pipeline
(``train.upload`` transforms and ``train.dp``; :mod:`medpfl.fl.upload`).

**DP-FedAvg** (McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018, Algorithm 1). In round t the m sampled clients each send their model
update clipped to L2 norm S (``FlatClip``):

    Δ̃_k = Δ_k · min(1, S / ‖Δ_k‖₂),     Δ_k = w_k − w_t   (the declared model upload minus the
                                                          model the client received)

and the server forms the fixed-denominator estimator f̃_f with uniform weights w_k = 1 (W = K,
the expected number of sampled clients qW = qK = m) plus Gaussian noise:

    Δ_t = (Σ_k Δ̃_k) / m + N(0, σ² I),     σ = z · S / m     (z: the noise multiplier)

The sum has L2 sensitivity S when one client's data is added or removed (its whole contribution
is bounded by S), so each round is the sampled Gaussian mechanism with noise multiplier z and
sampling rate q = m/K. The method then aggregates as it always does, but every client row of the
model upload it reads is the private model w_t + Δ_t and every weight entry is 1: any weighted
mean of identical rows is that row (to the float rounding of the method's weights, a few ulp), so
the server's step is the private mean, followed by whatever the method does with it (FedGKD's
buffer, pFedMe's β-mixing, FedBABU's body merge, a ``train.server_optimizer``), all
post-processing. The method's own weighting (n_k, FedKPer's scores, FedAS's Fisher traces) is
replaced by the uniform fixed-denominator mean, and the weight entries are not sent.

**Accountant.** ε at δ after r rounds is opacus' (Yousefpour et al. 2021, "Opacus: User-Friendly
Differential Privacy Library in PyTorch") ``RDPAccountant`` (Rényi DP of the sampled Gaussian
mechanism, Mironov, Talwar & Zhang 2019, converted to (ε, δ) as in opacus
``privacy_analysis.get_privacy_spent``) or ``PRVAccountant`` (Gopi, Lee & Wutschitz, NeurIPS
2021; its ε is the upper bound at ``eps_error`` 0.01), with history ``[(z, q, r)]``: q = m/K,
one step per round. It is a function of (z, q, r, δ) only, so it is recomputed from the round
count (no state to checkpoint; a resumed run reports the same ε). Assumptions, stated in
``docs/methods.md``: the analysis is for Poisson sampling of clients (each with probability q,
McMahan et al.'s Algorithm 1), ours draws exactly m without replacement (``train.sampling``); the
server is trusted (it sees each clipped update; the guarantee is for what it releases: the
models); the sample of clients is secret (a ``round_seeded`` schedule is a fixed function of the
round).

What is private: the declared model upload's floating-point parameters. A model whose upload
holds buffers (BatchNorm running statistics and ``num_batches_tracked``, data statistics that
would be sent in the clear) is refused, as opacus refuses BatchNorm (``ModuleValidator``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from medpfl.config import DPConfig, TrainConfig
from medpfl.errors import ParamsError
from medpfl.fl.payload import ArraySpec, Spec, TreeSpec
from medpfl.fl.sampling import derive_seed
from medpfl.fl.upload import (UploadContext, UploadTransform, chain, clients_tuple, clip_by_norm, from_config,
                              gaussian_tree, join_update, split_update, wide)

#: Why a method that declares no model upload cannot take ``train.dp`` / ``train.upload`` (by
#: registered name, also for subclasses); others get the generic reason.
NOT_APPLICABLE: dict[str, str] = {
    "local": "it sends nothing",
    "scaffold": "its server also sums the control-variate updates Δc, which clipping the model update does not bound",
    "fedcurv": "its server sums the clients' Fisher diagonals, data statistics outside the averaged model",
    "fedbe": "its server fits a Gaussian to the individual client models and distils on them, not only their mean",
    "fedkd": "its clients send a compressed update rebuilt from a synced broadcast (its own SVD codec)",
    "fedmic": ("its clients send a compressed update rebuilt from a synced broadcast (its own SVD codec); its "
               "noise is method_params.<name>.dp_noise_std"),
    "apple": "its server replaces each client's core model, it does not average them",
    "epfl": "its server mixes LoRA factors with weights from the uploads' distances, not a weighted mean of models",
    "fedproto": "it sends class prototypes, not a model",
    "pfedkdwcl": "it sends KL gradients, not a model",
}


def not_applicable_reason(algo_cls: type) -> str | None:
    """Why ``train.dp`` / ``train.upload`` cannot run with this method class, or None when it
    declares a model upload (:attr:`~medpfl.algorithms.base.Algorithm.model_upload`)."""
    if getattr(algo_cls, "model_upload", None) is not None:
        return None
    for klass in algo_cls.__mro__:
        why = NOT_APPLICABLE.get(getattr(klass, "name", "") or "")
        if why is not None:
            return why
    return "it declares no model upload (model_upload) that its server only averages"


def check_applicable(method: str, algo_cls: type, key: str) -> None:
    """Raises :class:`~medpfl.errors.ParamsError`, one line naming ``key`` (``train.dp``,
    ``method_params.<method>.train.upload``, ...), ``method`` and its algorithm and the reason,
    when the method cannot take upload transforms or DP-FedAvg; nothing otherwise."""
    why = not_applicable_reason(algo_cls)
    if why is None:
        return
    algo_name = getattr(algo_cls, "name", algo_cls.__name__)
    named = f"method {method!r}" + (f" ({algo_name})" if algo_name != method else "")
    what = "DP-FedAvg" if key.endswith(".dp") else "upload transforms"
    field = key.rsplit(".", 1)[-1]
    null = "null" if field == "dp" else "[]"
    raise ParamsError(f"{key}: {what} cannot run with {named}: {why}; remove the key or set "
                      f"method_params.{method}.train.{field}: {null}")


def dp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """ε of ``steps`` compositions of the sampled Gaussian mechanism (noise multiplier z = std /
    sensitivity, sampling rate q) at ``delta``, by opacus' ``RDPAccountant`` (``accountant="rdp"``:
    its default orders, ``get_epsilon(delta)``) or ``PRVAccountant`` (``"prv"``: ``get_epsilon(
    delta)``, the upper bound at eps_error 0.01), each stepped ``steps`` times. 0.0 for 0 steps.
    Raises ValueError for an unknown accountant."""
    if steps <= 0:
        return 0.0
    from opacus.accountants import PRVAccountant, RDPAccountant  # imported only when a run is private

    if accountant == "rdp":
        acc = RDPAccountant()
    elif accountant == "prv":
        acc = PRVAccountant()
    else:
        raise ValueError(f"unknown accountant {accountant!r}; known: rdp, prv")
    for _ in range(int(steps)):
        acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    with np.errstate(divide="ignore"):  # PRV at q = 1 takes log(1 - q) = -inf on its way (harmless)
        return float(acc.get_epsilon(delta=delta))


class DPFedAvg:
    """The server side of DP-FedAvg for a federation of K clients with m uploading per round.

    ``sample_rate`` q = m/K; ``sigma`` = z S / m, the std of the noise added to the mean update
    (per entry). :meth:`private_mean` forms it; :meth:`epsilon` accounts it. Raises
    :class:`~medpfl.errors.ParamsError` naming ``train.dp.delta`` when δ ≥ 1/K (such a δ allows a
    mechanism that publishes one client's data outright)."""

    def __init__(self, cfg: DPConfig, num_clients: int, per_round: int):
        if not cfg.delta < 1.0 / num_clients:
            raise ParamsError(f"train.dp.delta: {cfg.delta:g} is not below 1/K = {1.0 / num_clients:g} for K = "
                              f"{num_clients} clients; the guarantee is per client, so δ must be well below 1/K")
        self.cfg = cfg
        self.num_clients = int(num_clients)
        self.per_round = int(per_round)
        self.sample_rate = self.per_round / self.num_clients
        self.sigma = cfg.noise_multiplier * cfg.clip_norm / self.per_round

    def noise(self, shapes: Mapping[str, tuple[int, ...]], seed: int, round_idx: int) -> dict[str, torch.Tensor]:
        """The round's server noise N(0, σ² I) per leaf (float64, CPU), from a generator seeded by
        ``derive_seed("dp-fedavg", seed, round)``: the same in both executors and on resume."""
        return gaussian_tree(shapes, self.sigma, derive_seed("dp-fedavg", seed, round_idx))

    def private_mean(self, updates: Mapping[str, torch.Tensor], seed: int, round_idx: int) -> dict[str, torch.Tensor]:
        """``(Σ_k Δ̃_k) / m + N(0, σ² I)`` per leaf from the clipped, decoded stacked updates
        (leaves [m, ...], floating point), computed in float64 (float32 on MPS) and returned in
        each leaf's dtype and device. Raises ValueError when the updates do not hold m rows."""
        shapes = {k: tuple(v.shape[1:]) for k, v in updates.items()}
        noise = self.noise(shapes, seed, round_idx)
        out = {}
        for k, v in updates.items():
            if v.shape[0] != self.per_round:
                raise ValueError(f"DP-FedAvg: {v.shape[0]} updates of {k!r}, expected the round's {self.per_round}")
            dt = wide(v.device)
            mean = v.to(dt).sum(0) / self.per_round
            out[k] = (mean + noise[k].to(dt).to(v.device)).to(v.dtype)
        return out

    def epsilon(self, rounds: int) -> float:
        """ε at ``cfg.delta`` after ``rounds`` rounds (:func:`dp_epsilon` with q = m/K)."""
        return dp_epsilon(self.cfg.noise_multiplier, self.sample_rate, rounds, self.cfg.delta, self.cfg.accountant)


class UploadPipeline:
    """What the engine does between the clients' ``finish`` and the method's ``aggregate`` when a
    run has upload transforms (``train.upload``) or DP-FedAvg (``train.dp``), for a method that
    declares a model upload (``decl``: :class:`~medpfl.algorithms.base.ModelUpload`).

    :meth:`send` (as if at each client): Δ_k = upload − reference, the chain of transforms on it
    (with DP: the clip to S first), and the payload that crosses: the transformed update and,
    without DP, the weight entries as they are. ``wire_spec``: the upload spec of that payload
    (the update's ``TreeSpec``, compressed where the chain compresses). :meth:`receive` (at the
    server): the decoded updates, added back to the reference, as the method's uploads; with DP
    the private mean in every row and weights of 1. Raises ValueError when the method's
    ``upload_spec`` does not match its declaration (the upload a dense ``TreeSpec``, each weight
    an ``ArraySpec``, no other key)."""

    def __init__(self, decl: Any, spec: Mapping[str, Spec], transform: UploadTransform,
                 dp: DPFedAvg | None = None):
        self.decl = decl
        self.transform = transform
        self.dp = dp
        tree = spec.get(decl.upload)
        if not isinstance(tree, TreeSpec) or tree.compressed:
            raise ValueError(f"model_upload: upload {decl.upload!r} must be a dense TreeSpec in upload_spec, got {tree!r}")
        missing = [w for w in decl.weights if not isinstance(spec.get(w), ArraySpec)]
        extra = sorted(set(spec) - {decl.upload, *decl.weights})
        if missing or extra:
            raise ValueError(f"model_upload: upload_spec keys {sorted(spec)} do not match the declaration "
                             f"{decl} (weights not ArraySpec: {missing}; undeclared: {extra})")
        self.shapes = dict(tree.shapes)
        self.weight_specs = {w: spec[w] for w in decl.weights}
        wire = {decl.upload: TreeSpec(self.shapes, compressed=transform.compresses)}
        if dp is None:
            wire.update(self.weight_specs)
        #: the spec of what crosses (the upload check's)
        self.wire_spec: dict[str, Spec] = wire

    def send(self, uploads: Mapping[str, Any], shared: Mapping[str, Any], clients: Any, seed: int,
             round_idx: int) -> dict[str, Any]:
        """The payload the m clients send: ``{upload: transformed Δ, **weights (without DP)}``.
        ``shared``: the round's shared download (holds the reference); ``clients``: the uploading
        clients' ids in row order."""
        if self.decl.reference not in shared:
            raise ValueError(f"model_upload: the reference {self.decl.reference!r} is not in the shared download "
                             f"({sorted(shared)})")
        delta = split_update(uploads[self.decl.upload], shared[self.decl.reference])
        ctx = UploadContext(int(seed), int(round_idx), clients_tuple(clients))
        out = {self.decl.upload: self.transform.encode(delta, ctx)}
        if self.dp is None:
            out.update({w: uploads[w] for w in self.decl.weights})
        return out

    def receive(self, sent: Mapping[str, Any], shared: Mapping[str, Any], seed: int, round_idx: int,
                m: int) -> dict[str, Any]:
        """The uploads the method's ``aggregate`` reads, from the payload as sent."""
        ref = shared[self.decl.reference]
        delta = self.transform.decode(dict(sent[self.decl.upload]), self.shapes)
        if self.dp is None:
            return {self.decl.upload: join_update(delta, ref), **{w: sent[w] for w in self.decl.weights}}
        mean = self.dp.private_mean(delta, seed, round_idx)
        rows = {k: (ref[k] + mean[k]).unsqueeze(0).expand(m, *ref[k].shape) for k in mean}
        like = next(iter(rows.values()))
        ones = {w: torch.ones((m, *s.shape), dtype=torch.float32, device=like.device)
                for w, s in self.weight_specs.items()}
        return {self.decl.upload: rows, **ones}

    def epsilon(self, rounds: int) -> float | None:
        """ε at δ after ``rounds`` rounds with DP-FedAvg; None without it."""
        return None if self.dp is None else self.dp.epsilon(rounds)


def make_upload_pipeline(train: TrainConfig, algo: Any, num_clients: int, per_round: int) -> UploadPipeline | None:
    """The run's pipeline, or None when ``train`` has neither ``upload`` transforms nor ``dp`` (the
    engine's path is then unchanged). Raises :class:`~medpfl.errors.ParamsError` naming the key
    when the method cannot take them (:func:`check_applicable`), when with ``dp`` its model upload
    holds buffers (BatchNorm statistics: not privatized) and when δ ≥ 1/K."""
    if train.dp is None and not train.upload:
        return None
    key = "train.dp" if train.dp is not None else "train.upload"
    check_applicable(algo.name, type(algo), key)
    decl = type(algo).model_upload
    spec = algo.upload_spec()
    transforms = from_config(train.upload)
    dp = None
    if train.dp is not None:
        sent = set(getattr(spec.get(decl.upload), "shapes", {}))
        buffers = sorted(sent & set(algo.forward.buffers))
        if buffers:
            raise ParamsError(f"train.dp: method {algo.name!r} would send the buffers {', '.join(buffers[:3])}"
                              f"{', ...' if len(buffers) > 3 else ''} of train.model="
                              f"{getattr(algo.forward, 'model_name', '?')} (BatchNorm statistics of the client's "
                              "data) in the clear; DP-FedAvg privatizes trained parameters only (opacus refuses "
                              "BatchNorm too): choose a model without BatchNorm (cnn4, simplecnn, mlp, mlr, vit) or "
                              "a method that keeps it local (fedbn)")
        transforms = [clip_by_norm(train.dp.clip_norm)] + transforms
        dp = DPFedAvg(train.dp, num_clients, per_round)
    return UploadPipeline(decl, spec, chain(*transforms), dp)


__all__ = ["DPFedAvg", "NOT_APPLICABLE", "UploadPipeline", "check_applicable", "dp_epsilon", "make_upload_pipeline",
           "not_applicable_reason"]
