"""What crosses between clients and server: declared upload specs (the upload check),
exact byte counts, and the low-rank (truncated SVD) codec of compressed payloads.

Uploads are checked against the method's :meth:`~medpfl.algorithms.base.Algorithm.upload_spec`:
every key must be declared and every leaf must have its declared shape (plus the leading client
dim m), so raw images, labels or any per-sample tensor cannot pass. Byte counts are what is
actually sent: ``numel * element_size`` per tensor, and for a :class:`LowRank` leaf only the
``rank`` leading singular triplets (``rank * (P + Q + 1)`` numbers) plus the rank itself;
:func:`payload_dense_nbytes` counts the same payload with every compressed leaf at the size of
the full tensor it encodes (the denominator of the compression ratio).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch

from medpfl.errors import UploadSpecError  # noqa: F401  (defined in medpfl.errors; importable here as before)


class LowRank(NamedTuple):
    """A matrix ``M`` [P, Q] sent as its truncated SVD ``U[:, :r] diag(S[:r]) Vh[:r]``.

    The factors keep their full width ``k = min(P, Q)`` (fixed shapes, so that a stack of
    clients with different ranks runs under vmap); components ``>= rank`` are zero and are not
    sent. u float [P, k], s float [k], vh float [k, Q], rank int64 scalar; ``shape`` of the
    original tensor is implied by the spec (a conv kernel is reshaped to ``[out, in*kh*kw]``).
    """

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    rank: torch.Tensor


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(P, Q)`` of the 2-D view a tensor of ``shape`` is compressed as: ``(shape[0], rest)``."""
    return int(shape[0]), int(math.prod(shape[1:]))


def svd_encode(x: torch.Tensor, energy: float) -> LowRank | torch.Tensor:
    """Truncated SVD of ``x`` (>= 2-D) at the smallest rank whose energy exceeds ``energy``.

    Rank r = min{ r : sum_{j<r} s_j^2 / sum_j s_j^2 > energy } (FedKD, Wu et al. Nat. Commun.
    2022, "dynamic gradient approximation"; FedMIC GPD eq. 10); r = 0 for a zero matrix. Where the
    factors would not be smaller than the matrix (``r (P + Q + 1) >= P Q``) every component is
    kept, i.e. the matrix is sent as is (counted as ``P Q`` numbers by :func:`payload_nbytes`;
    reconstructed up to float rounding). A tensor with fewer than 2 dims is returned unchanged
    (sent dense). Works under vmap (fixed shapes).
    """
    if x.dim() < 2:
        return x
    p, q = matrix_view(tuple(x.shape))
    u, s, vh = torch.linalg.svd(x.reshape(p, q).float(), full_matrices=False)
    e = s**2
    total = e.sum()
    cum = torch.cumsum(e, 0)
    # number of components whose cumulative energy is still <= energy*total, plus one
    need = (cum <= energy * total).sum() + 1
    k = s.shape[0]
    rank = torch.where(total > 0, torch.clamp(need, max=k), torch.zeros_like(need)).to(torch.int64)
    rank = torch.where(rank * (p + q + 1) >= p * q, torch.full_like(rank, k), rank)
    keep = (torch.arange(s.shape[0], device=s.device) < rank).to(s.dtype)
    return LowRank(u * keep, s * keep, vh * keep.unsqueeze(-1), rank)


def svd_decode(v: LowRank | torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``shape`` that ``v`` encodes (dense tensors pass through). Leading dims
    beyond the factors' (a stack of clients) are kept: ``[..., *shape]``."""
    if not isinstance(v, LowRank):
        return v
    return ((v.u * v.s.unsqueeze(-2)) @ v.vh).reshape(*v.u.shape[:-2], *shape)


def encode_tree(tree: Mapping[str, torch.Tensor], energy: float) -> dict[str, Any]:
    return {k: svd_encode(t, energy) for k, t in tree.items()}


def decode_tree(tree: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {k: svd_decode(v, tuple(shapes[k])) for k, v in tree.items()}


def payload_nbytes(obj: Any) -> int:
    """Bytes of a payload: ``numel * element_size`` per tensor in nested dicts/lists. A
    :class:`LowRank` leaf (one matrix, or a stack of them with a leading client dim) counts, per
    matrix, ``min(rank (P + Q + 1), P Q)`` numbers (the leading factors, or the dense matrix where
    that is smaller) plus 8 bytes for the rank. Python numbers count 8, None 0. One host read of
    the ranks where the payload holds LowRank leaves on a device (:func:`payload_nbytes_parts`
    leaves it to the caller)."""
    known, ranked = payload_nbytes_parts(obj)
    return known + (0 if ranked is None else int(ranked))


def payload_nbytes_parts(obj: Any) -> tuple[int, torch.Tensor | None]:
    """:func:`payload_nbytes` as ``(known, ranked)`` without a host read: ``known`` (int) the
    bytes fixed by the shapes and dtypes (host metadata: every dense tensor, the 8 bytes of
    each rank), ``ranked`` the bytes of the LowRank factors actually sent, which depend on the
    ranks' values: an int64 scalar on the ranks' device (summed over the LowRank leaves; None
    when there are none). ``payload_nbytes(obj) == known + int(ranked)``. Raises TypeError on
    an object that is not a tensor, a number, None or a dict/list/tuple of them."""
    if isinstance(obj, LowRank):
        esz = obj.u.element_size()
        p, q = obj.u.shape[-2], obj.vh.shape[-1]
        r = obj.rank.to(torch.int64).reshape(-1)
        return 8 * r.numel(), torch.clamp(r * (p + q + 1), max=p * q).sum() * esz
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), None
    if isinstance(obj, (dict, list, tuple)):
        known, ranked = 0, None
        for v in (obj.values() if isinstance(obj, dict) else obj):
            k, rk = payload_nbytes_parts(v)
            known += k
            if rk is not None:
                ranked = rk if ranked is None else ranked + rk.to(ranked.device)
        return known, ranked
    if isinstance(obj, (int, float)):
        return 8, None
    if obj is None:
        return 0, None
    raise TypeError(f"payload holds an object of type {type(obj).__name__}; only tensors and numbers may cross")


def payload_dense_nbytes(obj: Any) -> int:
    """Bytes the same payload would take sent dense: a :class:`LowRank` leaf counts, per matrix,
    the full ``P Q`` numbers of the tensor it encodes (no rank); every other leaf as
    :func:`payload_nbytes` counts it. ``payload_nbytes(x) / payload_dense_nbytes(x)`` is the
    compression ratio of ``x`` (1 for a payload without compressed leaves; slightly above 1 where
    every matrix is sent dense, the ranks being sent too)."""
    if isinstance(obj, LowRank):
        p, q = obj.u.shape[-2], obj.vh.shape[-1]
        return int(obj.rank.reshape(-1).numel()) * p * q * obj.u.element_size()
    if isinstance(obj, dict):
        return sum(payload_dense_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_dense_nbytes(v) for v in obj)
    return payload_nbytes(obj)


# ----- upload specs ----------------------------------------------------------------------------
class Spec:
    """Declared structure of one upload entry (checked for every round's stacked uploads)."""

    def check(self, value: Any, m: int, where: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class ArraySpec(Spec):
    """One tensor of ``shape`` per client (``()`` for a scalar), e.g. a sample count, a score,
    class prototypes [C, d]."""

    def __init__(self, shape: tuple[int, ...] = ()):
        self.shape = tuple(int(s) for s in shape)

    def check(self, value: Any, m: int, where: str) -> None:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (m, *self.shape):
            raise UploadSpecError(f"{where} must be a tensor of shape {(m, *self.shape)}, got "
                               f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}")

    def __repr__(self) -> str:
        return f"ArraySpec({self.shape})"


class TreeSpec(Spec):
    """A flat dict of named tensors with fixed shapes (a model or a named part of it, a Fisher
    diagonal, control variates). ``compressed``: leaves of >= 2 dims may be :class:`LowRank`."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], compressed: bool = False):
        self.shapes = {k: tuple(int(s) for s in v) for k, v in shapes.items()}
        self.compressed = compressed

    def check(self, value: Any, m: int, where: str) -> None:
        if not isinstance(value, dict) or set(value) != set(self.shapes):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise UploadSpecError(f"{where} must hold exactly the declared tensors {sorted(self.shapes)[:6]}..., got {got}")
        for name, t in value.items():
            shape = self.shapes[name]
            if isinstance(t, LowRank):
                p, q = matrix_view(shape)
                k = min(p, q)
                ok = (self.compressed and len(shape) >= 2 and tuple(t.u.shape) == (m, p, k)
                      and tuple(t.s.shape) == (m, k) and tuple(t.vh.shape) == (m, k, q) and tuple(t.rank.shape) == (m,))
                if not ok:
                    raise UploadSpecError(f"{where}[{name!r}]: a low-rank leaf that does not factor a {shape} tensor")
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != (m, *shape):
                raise UploadSpecError(f"{where}[{name!r}] has shape {tuple(getattr(t, 'shape', ()))}, expected {(m, *shape)}")

    def __repr__(self) -> str:
        return f"TreeSpec({len(self.shapes)} tensors{', compressed' if self.compressed else ''})"


def check_upload(method: str, spec: Mapping[str, Spec], uploads: Mapping[str, Any], m: int) -> None:
    """The upload check (declared keys and shapes; not a privacy guarantee): the stacked uploads of m clients hold exactly the declared keys,
    each with its declared structure. Raises :class:`UploadSpecError` naming the method and key."""
    if set(uploads) != set(spec):
        raise UploadSpecError(f"method {method!r} uploaded keys {sorted(uploads)}, declared {sorted(spec)}")
    for key, s in spec.items():
        s.check(uploads[key], m, f"method {method!r}: upload {key!r}")
