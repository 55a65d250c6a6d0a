"""Upload transforms: what a client does to its model update before it crosses to the server,
composed from small pieces with :func:`chain` (the optax style: each transform is a pair of pure
functions, and a chain of transforms is one more transform).

A transform acts on a **stacked update tree**: a flat ``dict[str, Tensor]`` whose leaves have a
leading client dim m (the round's uploading clients in schedule order), each row the update
Δ_k = w_k − w of one client (its uploaded model, or model part, minus the model it received;
:class:`~medpfl.algorithms.base.ModelUpload` names both). Floating-point leaves are transformed;
integer leaves (BatchNorm's ``num_batches_tracked``) pass through as they are.

    encode(tree, ctx)        -> payload   client side: what is sent (dense tensors, or LowRank leaves)
    decode(payload, shapes)  -> tree      server side: the dense update the server adds back

Transforms (each a function returning an :class:`UploadTransform`):

* :func:`clip_by_norm` (S): Δ_k ← Δ_k · min(1, S / ‖Δ_k‖₂), the norm taken flat over every
  floating-point leaf of the row (McMahan, Ramage, Talwar & Zhang, "Learning Differentially
  Private Recurrent Language Models", ICLR 2018, Algorithm 1, ``FlatClip``; Abadi et al., CCS
  2016, Eq. of the norm clipping step).
* :func:`gaussian_noise` (τ): Δ_k ← Δ_k + τ N(0, I), drawn on the CPU in float64 from a generator
  seeded by (stream, run seed, round, client id) (:func:`medpfl.fl.sampling.derive_seed`), so both
  executors, any order of clients and a resumed run draw the same noise (the FedMIC paper's
  "Gaussian noise scaled by τ on the shared parameters", spec A.7 READING: client side, every
  transmitted float).
* :func:`low_rank` (α): every leaf of ≥ 2 dims sent as its truncated SVD at the smallest rank with
  energy > α (:func:`medpfl.fl.payload.svd_encode`, the codec of FedKD's and FedMIC's updates;
  Wu et al., Nat. Commun. 2022; FedMIC Eq. 10); it must be the last transform of a chain (the
  others act on dense tensors). Bytes are then the factors actually sent
  (:func:`~medpfl.fl.payload.payload_nbytes`).

The engine applies a run's chain in one place (:class:`UploadPipeline`, outside the executors,
after the clients' ``finish`` and before the upload check), so both executors send the same
payload and ``bytes_up`` / ``bytes_up_dense`` count it as sent. :mod:`medpfl.fl.privacy` builds
DP-FedAvg (``train.dp``) on it: a clip at the client, the noise at the server.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from medpfl.fl.payload import LowRank, svd_decode, svd_encode
from medpfl.fl.sampling import derive_seed

Tree = dict[str, Any]


class UploadContext(NamedTuple):
    """What a transform may read about the round: the run seed, the round (0-based) and the
    uploading clients' ids (int, in the rows' order)."""

    seed: int
    round: int
    clients: tuple[int, ...]


class UploadTransform(NamedTuple):
    """One upload transform: ``encode(tree, ctx)`` at the clients, ``decode(payload, shapes)`` at
    the server (``shapes``: each leaf's shape for one client; the identity for clipping and
    noise). ``compresses``: its payload may hold :class:`~medpfl.fl.payload.LowRank` leaves (the
    upload spec then allows them)."""

    name: str
    encode: Callable[[Tree, UploadContext], Tree]
    decode: Callable[[Tree, Mapping[str, tuple[int, ...]]], Tree]
    compresses: bool = False


def _identity(tree: Tree, shapes: Mapping[str, tuple[int, ...]]) -> Tree:
    return tree


def wide(device: torch.device) -> torch.dtype:
    """The dtype the transforms' arithmetic runs in: float64, float32 on MPS (which has no float64)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _floats(tree: Mapping[str, Any]) -> list[str]:
    return [k for k, v in tree.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def update_norms(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each row of a stacked update tree, flat over its floating-point leaves:
    float64 [m] (``sqrt(sum over leaves and entries of x^2)``, accumulated in float64; float32 on
    MPS), on the leaves' device. Raises
    ValueError when the tree has no floating-point leaf."""
    names = _floats(tree)
    if not names:
        raise ValueError("upload transform: the update has no floating-point tensor to take a norm of")
    dt = wide(tree[names[0]].device)
    sq = sum(tree[k].to(dt).pow(2).reshape(tree[k].shape[0], -1).sum(1) for k in names)
    return torch.sqrt(sq)


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, S / norm)`` per row (float64 [m]); exactly 1.0 where ``norm <= S`` (a zero update
    included), so an update already within the bound is sent unchanged, bit for bit."""
    safe = torch.where(norms > max_norm, norms, torch.full_like(norms, max_norm))
    return torch.where(norms > max_norm, max_norm / safe, torch.ones_like(norms))


def clip_by_norm(max_norm: float) -> UploadTransform:
    """Flat L2 clipping of each client's update to norm ``max_norm`` (S > 0): every floating-point
    leaf of row k is multiplied by ``min(1, S / ‖Δ_k‖₂)`` (float64 factor, the product cast back
    to the leaf's dtype: the clipped norm is S up to that rounding, about 1e-7 relative in
    float32). McMahan et al., ICLR 2018, Algorithm 1 (``FlatClip``: "clip the full update to S").
    Raises ValueError for ``max_norm <= 0``."""
    if not max_norm > 0:
        raise ValueError(f"clip_by_norm: max_norm must be > 0, got {max_norm}")

    def encode(tree: Tree, ctx: UploadContext) -> Tree:
        f = clip_factors(update_norms(tree), max_norm)
        out = dict(tree)
        for k in _floats(tree):
            v = tree[k]
            scale = f.to(v.device).view(-1, *([1] * (v.dim() - 1)))
            out[k] = (v.to(scale.dtype) * scale).to(v.dtype)  # a factor of 1.0 returns v exactly
        return out

    return UploadTransform(f"clip({max_norm:g})", encode, _identity)


def gaussian_tree(shapes: Mapping[str, tuple[int, ...]], std: float, seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """``std * N(0, I)`` for one client's tree: a CPU generator seeded with ``seed`` draws each
    leaf in turn (in ``shapes``' order) in float64; returned on the CPU in ``dtype``."""
    g = torch.Generator().manual_seed(int(seed))
    return {k: (torch.randn(tuple(s), generator=g, dtype=torch.float64) * std).to(dtype) for k, s in shapes.items()}


def gaussian_noise(std: float, stream: str = "upload-noise") -> UploadTransform:
    """Gaussian noise ``std * N(0, I)`` added at each client to every floating-point entry of its
    update, drawn from a generator seeded by ``derive_seed(stream, run seed, round, client id)``
    (float64 on the CPU, then cast to the leaf's dtype and device), so the draw depends on the
    run, the round and the client only. The FedMIC paper's DP variant (Sec. 6.6; spec A.7: "every
    transmitted float x <- x + τ N(0, 1), client side", for FedAvg "the full uploaded weights").
    Noise injection only: without clipping it has no bounded sensitivity and no (ε, δ)
    (``docs/methods.md``, "Differential privacy"). Raises ValueError for ``std <= 0``."""
    if not std > 0:
        raise ValueError(f"gaussian_noise: std must be > 0, got {std}")

    def encode(tree: Tree, ctx: UploadContext) -> Tree:
        names = _floats(tree)
        out = dict(tree)
        rows = []
        for c in ctx.clients:
            rows.append(gaussian_tree({k: tuple(tree[k].shape[1:]) for k in names}, std,
                                     derive_seed(stream, ctx.seed, ctx.round, int(c))))
        for k in names:
            v = tree[k]
            dt = wide(v.device)
            noise = torch.stack([r[k] for r in rows]).to(dt).to(v.device)
            out[k] = (v.to(dt) + noise).to(v.dtype)
        return out

    return UploadTransform(f"gaussian({std:g})", encode, _identity)


def low_rank(energy: float) -> UploadTransform:
    """Low-rank compression of every floating-point leaf of >= 2 dims (per client row): its
    truncated SVD at the smallest rank whose energy exceeds ``energy`` (:func:`svd_encode`: conv
    kernels as ``[out, in*kh*kw]``, dense where the factors would not be smaller); 1-D and integer
    leaves are sent as they are. Decoded at the server with :func:`svd_decode`. Truncation never
    increases a tensor's Frobenius norm (Eckart–Young), so a clipped update stays within its bound
    up to float rounding. Raises ValueError unless 0 < energy < 1."""
    if not 0.0 < energy < 1.0:
        raise ValueError(f"low_rank: energy must be in (0, 1), got {energy}")
    encode_one = torch.func.vmap(lambda t: svd_encode(t, energy))

    def encode(tree: Tree, ctx: UploadContext) -> Tree:
        return {k: (encode_one(v) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3 else v)
                for k, v in tree.items()}

    def decode(tree: Tree, shapes: Mapping[str, tuple[int, ...]]) -> Tree:
        return {k: (svd_decode(v, tuple(shapes[k])) if isinstance(v, LowRank) else v) for k, v in tree.items()}

    return UploadTransform(f"low_rank({energy:g})", encode, decode, compresses=True)


def chain(*transforms: UploadTransform) -> UploadTransform:
    """One transform applying ``transforms`` in order at the clients and undoing them in reverse
    order at the server (optax ``chain``). A transform that compresses (:func:`low_rank`) must be
    the last: raises ValueError otherwise."""
    ts = tuple(transforms)
    for t in ts[:-1]:
        if t.compresses:
            raise ValueError(f"upload transforms: {t.name} must be the last transform of the chain "
                             f"({' -> '.join(x.name for x in ts)})")

    def encode(tree: Tree, ctx: UploadContext) -> Tree:
        for t in ts:
            tree = t.encode(tree, ctx)
        return tree

    def decode(tree: Tree, shapes: Mapping[str, tuple[int, ...]]) -> Tree:
        for t in reversed(ts):
            tree = t.decode(tree, shapes)
        return tree

    return UploadTransform(" -> ".join(t.name for t in ts) or "identity", encode, decode,
                           compresses=any(t.compresses for t in ts))


def from_config(items: Sequence[Any], stream: str = "upload-noise") -> list[UploadTransform]:
    """The transforms of ``train.upload`` (:class:`medpfl.config.UploadTransformConfig` items, in
    order). The i-th Gaussian transform draws from the stream ``f"{stream}{i}"``."""
    out: list[UploadTransform] = []
    for i, c in enumerate(items):
        if c.name == "clip":
            out.append(clip_by_norm(c.max_norm))
        elif c.name == "gaussian":
            out.append(gaussian_noise(c.std, f"{stream}{i}"))
        elif c.name == "low_rank":
            out.append(low_rank(c.energy))
        else:  # pragma: no cover - the config's union lists the names
            raise ValueError(f"train.upload: unknown transform {c.name!r}")
    return out


def split_update(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> Tree:
    """The stacked update ``upload - reference`` (upload leaves [m, ...], reference leaves [...],
    broadcast over m) for floating-point leaves; integer leaves as uploaded. Raises ValueError
    naming the leaves when the two trees do not hold the same names."""
    if set(upload) != set(reference):
        raise ValueError(f"upload transforms: the upload holds {sorted(set(upload) - set(reference))[:4]} and the "
                         f"reference {sorted(set(reference) - set(upload))[:4]} beyond each other")
    return {k: (v - reference[k].unsqueeze(0) if v.is_floating_point() else v) for k, v in upload.items()}


def join_update(update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> Tree:
    """``reference + update`` per row (floating-point leaves); integer leaves as sent: the models
    the server reads back from a decoded stacked update."""
    return {k: (reference[k].unsqueeze(0) + v.to(reference[k].dtype) if v.is_floating_point() else v)
            for k, v in update.items()}


def clients_tuple(clients: Any) -> tuple[int, ...]:
    """Client ids (a tensor, an array or a sequence) as a tuple of ints."""
    if isinstance(clients, torch.Tensor):
        clients = clients.cpu().numpy()
    return tuple(int(c) for c in np.asarray(clients).reshape(-1))


__all__ = ["UploadContext", "UploadTransform", "chain", "clip_by_norm", "clip_factors", "from_config", "gaussian_noise",
           "gaussian_tree", "join_update", "low_rank", "split_update", "update_norms", "wide"]
