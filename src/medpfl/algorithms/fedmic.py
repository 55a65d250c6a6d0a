"""FedMIC (Ren, Hu, Chen & Wang, "Federated Distillation for Medical Image Classification: Towards
Trustworthy Computer-Aided Diagnosis"): Dual Knowledge Distillation (Dual-KD) between a local
teacher and a student, and Global Parameter Decomposition (GPD) of the student's update. Readings
of the spec ``../shared/docs/methods-fedmic-pfpslwc.md`` part A (A.1-A.9), each with a switch for
the literal form where the spec gives one.

Each client keeps a **teacher** Θ^t (own independent random init, never uploaded), its last
**student** Θ^s (its personalized model) and a trainable **auxiliary matrix** W_aux (d x d,
identity init, never uploaded); the student starts every round from the received global model
Θ_g. Per batch, with penultimate features H and logits z of both models (A.2), sg = detach:

    D      = sg(CE(z_t) + CE(z_s)) + eps                        (item 1; detach_denominator)
    L_rep  = mean((H_s W - H_t W)^2)   over samples and dims    (Eq. 3, full mean)
    L_t    = CE(z_t) + KL(sg p_s || p_t)/D + L_rep[H_s -> sg H_s]/D
    L_s    = CE(z_s) + KL(sg p_t || p_s)/D + L_rep[H_t -> sg H_t]/D      (Eq. 4-7)

one backward of ``L_t + L_s`` (each model gets its own loss's gradient only; W_aux gets both
copies of L_rep), KL summed over classes and averaged over the batch, T = 1. Ablations
(Tables 6-8): ``aux_matrix: false`` is FedMIC-A (L_rep = mean((H_s - H_t)^2), no W_aux),
``representation_ddl: false`` FedMIC-B (no L_rep term), ``gpd: false`` FedMIC-C (dense updates);
``decision_ddl: false`` drops the KL terms (not in the paper's tables).

GPD (A.4, "update_svd"): the client uploads Δ = Θ^s(after) - Θ_g per tensor as its truncated SVD
at the smallest rank whose energy is strictly greater than α (conv kernels as (C_out,
C_in k k); 1-D tensors dense; a matrix whose factors would not be smaller is sent dense:
:func:`medpfl.fl.payload.svd_encode`, FedKD's codec); BatchNorm running statistics travel
dense with the update (averaged as FedAvg would; ``num_batches_tracked`` stays the server's).
The server decodes, averages ∝ n_k over the round's clients (A.5), compresses the average the
same way and broadcasts it to all K clients, who add it to their copy of Θ_g (``synced``): server
and clients apply the identical reconstructed update. Round 0 broadcasts Θ_g itself. Bytes are
the factors actually sent (:func:`medpfl.fl.payload.payload_nbytes`).

DP variant (Table 9, A.7): Gaussian noise τ N(0, 1) on every transmitted float of the upload
(``dp_target: payload``: the kept singular triplets and the dense tensors; a matrix sent dense
gets it on its P Q entries), or on each decoded update at the server (``reconstructed_update``).
No clipping and no accounting: this is noise injection, **not** an (ε, δ) guarantee. The noise
is drawn where the uploads arrive, from a generator keyed by (run seed, round), so that both
executors and a resumed run draw the same noise; its distribution is that of client-side noise
on the payload.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.algorithms.pfedkdwcl import random_model_state
from medpfl.fl.functional import Params, clone_params, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec, LowRank, TreeSpec, decode_tree, encode_tree, matrix_view
from medpfl.fl.program import Download, Federation, Phase, RoundInfo
from medpfl.fl.sampling import derive_seed


class FedMICConfig(MethodConfig):
    """Defaults: the paper's (α = 0.98, Sec. 4.3/6.1; Dual-KD and GPD on) and, where it is silent or
    inconsistent, the readings of spec ``methods-fedmic-pfpslwc.md`` A.1-A.7 (W_aux shared d x d at
    identity, forward KL with detached targets, detached denominator, independent teacher init,
    sample-count weights, noise on the payload). The local lr (1e-3), epochs (5), batch size and
    optimizer are the study's ``train`` section (one SGD for all trees, as the paper)."""

    energy: float = Field(0.98, gt=0.0, lt=1.0,
                          description="GPD energy threshold α: smallest rank with energy > α (paper Sec. 4.3 Eq. 10, A.9)")
    gpd: bool = Field(True, description="Global Parameter Decomposition; false = FedMIC-C, dense updates (Table 6-8)")
    aux_matrix: bool = Field(True, description="W_aux in the representation loss; false = FedMIC-A, plain MSE (A.8)")
    aux_mode: Literal["shared", "per_model"] = Field(
        "shared", description="one W_aux (text, A.1 READING) or one per branch: H_s W_s - H_t W_t (Fig. 2 caption, OPTION)")
    freeze_aux: bool = Field(False, description="keep W_aux at the identity (A.2 diagnosis OPTION)")
    representation_ddl: bool = Field(True, description="the representation-based DDL L_rep/D; false = FedMIC-B (A.8)")
    decision_ddl: bool = Field(True, description="the decision-based DDL KL/D (Eq. 6); false drops it (not a paper row)")
    kl_mode: Literal["forward", "as_written"] = Field(
        "forward", description="forward: KL(sg p_other || p_own) (A.2 READING); as_written: KL(p_own || sg p_other) (Eq. 6)")
    detach_denominator: bool = Field(True, description="D = sg(CE_t + CE_s) (spec item 1); false = FedKD's code")
    detach_cross: bool = Field(True, description="each model's loss sees the other's outputs detached (A.2, item 2); "
                                                 "false = FedKD's code (nothing detached)")
    denominator_eps: float = Field(1e-8, ge=0.0, description="eps added to D (A.2 READING)")
    teacher_init: Literal["independent", "global"] = Field(
        "independent", description="teacher: own random init per client (A.6) or a copy of the initial global model")
    weighting: Literal["num_samples", "uniform"] = Field(
        "num_samples", description="aggregation weights: n_i / Σ n_j over the round's clients (Alg. 1, A.5) or 1/m (FedKD)")
    dp_noise_std: float = Field(0.0, ge=0.0, description="τ of the DP variant (Table 9: 1e-3, 1e-2, 5e-2); 0 = off")
    dp_target: Literal["payload", "reconstructed_update"] = Field(
        "payload", description="where τ N(0,1) is added: every transmitted float (A.7 READING) or each decoded update")


def weighted_mse(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j mean_d (a_j - b_j)^2``: the full mean of ``nn.MSELoss`` with w = 1/b."""
    return torch.sum(w * ((a - b) ** 2).mean(-1))


def kl_batchmean(target_logits: torch.Tensor, logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j KL(p_target,j || p_j)`` (sum over classes, batch mean with w = 1/b); gradients
    flow into both arguments (detach the target where it is one)."""
    log_t = F.log_softmax(target_logits, -1)
    log_p = F.log_softmax(logits, -1)
    return torch.sum(w * torch.sum(log_t.exp() * (log_t - log_p), -1))


def dual_kd_terms(h_t, z_t, h_s, z_s, y, w, w_aux_t=None, w_aux_s=None, *, representation: bool = True,
                  decision: bool = True, kl_mode: str = "forward", detach_denominator: bool = True,
                  detach_cross: bool = True, eps: float = 1e-8) -> dict[str, torch.Tensor]:
    """Every term of the Dual-KD objective (module docstring). h_* float [B, d] penultimate
    features, z_* float [B, C] logits, y int64 [B], w float [B] (1/b on valid samples);
    w_aux_t / w_aux_s float [d, d] the matrices of the teacher / student branch (the same
    tensor when shared; None: no matrix, FedMIC-A). Returns ``task_t``, ``task_s``, ``D``,
    ``rep_t``, ``rep_s``, ``dec_t``, ``dec_s`` (already divided by D), ``loss_t``, ``loss_s``
    and ``total = loss_t + loss_s`` (the one objective that is differentiated)."""
    sg = (lambda x: x.detach()) if detach_cross else (lambda x: x)
    task_t, task_s = weighted_ce(z_t, y, w), weighted_ce(z_s, y, w)
    d = task_t + task_s
    d = (d.detach() if detach_denominator else d) + eps
    zero = torch.zeros((), dtype=z_t.dtype, device=z_t.device)
    rep_t = rep_s = dec_t = dec_s = zero
    if representation:
        def proj(h, m):
            return h if m is None else h @ m

        rep_t = weighted_mse(proj(sg(h_s), w_aux_s), proj(h_t, w_aux_t), w) / d
        rep_s = weighted_mse(proj(h_s, w_aux_s), proj(sg(h_t), w_aux_t), w) / d
    if decision:
        if kl_mode == "forward":  # KL(sg p_other || p_own)
            dec_t = kl_batchmean(sg(z_s), z_t, w) / d
            dec_s = kl_batchmean(sg(z_t), z_s, w) / d
        elif kl_mode == "as_written":  # KL(p_own || sg p_other)
            dec_t = kl_batchmean(z_t, sg(z_s), w) / d
            dec_s = kl_batchmean(z_s, sg(z_t), w) / d
        else:
            raise ValueError(f"kl_mode {kl_mode!r}")
    loss_t = task_t + dec_t + rep_t
    loss_s = task_s + dec_s + rep_s
    return {"task_t": task_t, "task_s": task_s, "D": d, "rep_t": rep_t, "rep_s": rep_s, "dec_t": dec_t,
            "dec_s": dec_s, "loss_t": loss_t, "loss_s": loss_s, "total": loss_t + loss_s}


def payload_noise(payload: dict[str, Any], shapes: dict[str, tuple[int, ...]], std: float,
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Decoded stacked updates with ``std * N(0, 1)`` added to every float that was sent: the kept
    singular triplets of a compressed matrix (u[:, :r], s[:r], vh[:r]), the P Q entries of a
    matrix sent dense, every entry of a dense tensor. Noise is drawn on the CPU from ``gen``."""
    def randn(t):
        return (torch.randn(t.shape, generator=gen, dtype=torch.float64) * std).to(t.device, t.dtype)

    out = {}
    for k, v in payload.items():
        shape = tuple(shapes[k])
        if isinstance(v, LowRank):
            p, q = matrix_view(shape)
            keep = (torch.arange(v.s.shape[-1], device=v.s.device) < v.rank.unsqueeze(-1)).to(v.s.dtype)
            noisy = LowRank(v.u + randn(v.u) * keep.unsqueeze(-2), v.s + randn(v.s) * keep,
                            v.vh + randn(v.vh) * keep.unsqueeze(-1), v.rank)
            lowrank = decode_tree({k: noisy}, shapes)[k]
            dense = decode_tree({k: v}, shapes)[k]
            dense = dense + randn(dense)
            sent_dense = (v.rank * (p + q + 1) >= p * q).view(-1, *([1] * len(shape)))
            out[k] = torch.where(sent_dense, dense, lowrank)
        else:
            out[k] = v + randn(v)
    return out


class FedMIC(Algorithm):
    name = "fedmic"
    Config = FedMICConfig
    paper = ("Ren, Hu, Chen & Wang, Federated Distillation for Medical Image Classification: Towards "
             "Trustworthy Computer-Aided Diagnosis (FedMIC)")
    requires_parts = ("body",)  # distils the body's hidden features (Dual-KD)
    seeded_client_init = True  # the teacher's independent random init: a function of (run seed, client)

    personalized = True

    # ----- what crosses --------------------------------------------------------------------
    def update_names(self) -> list[str]:
        """The tensors of the student's update: every parameter and float buffer (BatchNorm
        running statistics, sent dense); ``num_batches_tracked`` stays the server's."""
        return [k for k in self.forward.shapes if not k.endswith("num_batches_tracked")]

    def update_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.forward.shapes[k] for k in self.update_names()}

    def upload_spec(self):
        return {"update": TreeSpec(self.update_shapes(), compressed=self.cfg.gpd), "num_samples": ArraySpec()}

    def _encode(self, tree: Params) -> dict[str, Any]:
        return encode_tree(tree, self.cfg.energy) if self.cfg.gpd else dict(tree)

    # ----- server --------------------------------------------------------------------------
    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"model": params, "prev": params, "update": None}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        if server["update"] is None:  # round 0: the initial global student, to everyone
            return Download(shared={"student": server["model"]}, to_all=True)
        return Download(shared={"update": server["update"]}, synced={"prev": server["prev"]}, to_all=True)

    def _weights(self, n: torch.Tensor) -> torch.Tensor:
        n = n.to(torch.float64)
        return n / n.sum() if self.cfg.weighting == "num_samples" else torch.full_like(n, 1.0 / n.numel())

    def aggregate(self, server, uploads, clients, rnd):
        shapes = self.update_shapes()
        tau = self.cfg.dp_noise_std
        gen = torch.Generator().manual_seed(derive_seed("fedmic-dp", rnd.seed, rnd.round)) if tau > 0 else None
        if tau > 0 and self.cfg.dp_target == "payload":
            deltas = payload_noise(uploads["update"], shapes, tau, gen)
        else:
            deltas = decode_tree(uploads["update"], shapes)
            if tau > 0:  # reconstructed_update
                deltas = {k: v + (torch.randn(v.shape, generator=gen, dtype=torch.float64) * tau).to(v.device, v.dtype)
                          for k, v in deltas.items()}
        mean = weighted_average(deltas, self._weights(uploads["num_samples"]))
        update = self._encode(mean)
        applied = decode_tree(update, shapes)
        model = {k: (v + applied[k] if k in applied else v) for k, v in server["model"].items()}
        return {"model": model, "prev": server["model"], "update": update}

    # ----- client --------------------------------------------------------------------------
    def _aux_names(self) -> tuple[str, ...]:
        if not (self.cfg.aux_matrix and self.cfg.representation_ddl):
            return ()
        return ("t", "s") if self.cfg.aux_mode == "per_model" else ("shared",)

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        like = next(iter(params.values()))
        teacher = (random_model_state(self.forward.module, params) if self.cfg.teacher_init == "independent"
                   else clone_params(params))
        state = {"teacher": teacher, "student": clone_params(params),
                 "visited": torch.zeros((), device=like.device)}
        names = self._aux_names()
        if names:
            d = self.forward.feature_dim
            state["w_aux"] = {n: torch.eye(d, device=like.device, dtype=like.dtype) for n in names}
        return state

    def _received_student(self, received) -> Params:
        if "student" in received:
            return received["student"]
        upd = decode_tree(received["update"], self.update_shapes())
        return {k: (received["prev"][k] + upd[k] if k in upd else received["prev"][k]) for k in received["prev"]}

    def begin(self, received, state, info, rnd):
        student = self._received_student(received)
        trees = {"teacher": state["teacher"], "student": student}
        if "w_aux" in state:
            trees["w_aux"] = state["w_aux"]
        return trees, {"start": student}

    def _aux(self, trees) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        aux = trees.get("w_aux")
        if aux is None:
            return None, None
        if "shared" in aux:
            return aux["shared"], aux["shared"]
        return aux["t"], aux["s"]

    def terms(self, trees, batch) -> dict[str, torch.Tensor]:
        """The Dual-KD terms of one batch (training mode)."""
        h_t, z_t = self.train_features(trees["teacher"], batch)
        h_s, z_s = self.train_features(trees["student"], batch)
        w_t, w_s = self._aux(trees)
        c = self.cfg
        return dual_kd_terms(h_t, z_t, h_s, z_s, batch["y"], batch["w"], w_t, w_s,
                             representation=c.representation_ddl, decision=c.decision_ddl, kl_mode=c.kl_mode,
                             detach_denominator=c.detach_denominator, detach_cross=c.detach_cross,
                             eps=c.denominator_eps)

    def _loss(self, trees, ctx, batch):
        return self.terms(trees, batch)["total"]

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        trainable = {"teacher": None, "student": None}
        if self._aux_names() and not self.cfg.freeze_aux:
            trainable["w_aux"] = None
        return [Phase(trainable=trainable, loss=self._loss)]

    def finish(self, trees, ctx, state, info, rnd):
        delta = {k: trees["student"][k] - ctx["start"][k] for k in self.update_names()}
        up = {"update": self._encode(delta), "num_samples": info["num_samples"]}
        new = {**state, "teacher": trees["teacher"], "student": trees["student"],
               "visited": torch.ones_like(state["visited"])}
        if "w_aux" in trees:
            new["w_aux"] = trees["w_aux"]
        return up, new, trees["student"]

    def personalized_model(self, state, server):
        """The client's last trained student; the current global student for a client never sampled (A.10)."""
        seen = state["visited"] > 0
        return {k: torch.where(seen, state["student"][k], server["model"][k]) for k in server["model"]}
