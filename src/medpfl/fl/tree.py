"""Nested dicts (and named tuples such as :class:`medpfl.fl.payload.LowRank`) of tensors
("trees"): stack, index and scatter along a leading client dim."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def _leaf_check(t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tree leaves must be tensors, got {type(t).__name__}")


def tree_map(fn: Callable[..., torch.Tensor], tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf-wise to one tree (or zipped over several with the same structure)."""

    def wrapped(*leaves):
        for x in leaves:
            _leaf_check(x)
        return fn(*leaves)

    return pytree.tree_map(wrapped, tree, *rest)


def tree_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def tree_stack(trees: list[Any]) -> Any:
    """Stack a list of equally shaped trees along a new leading dim."""
    return tree_map(lambda *xs: torch.stack(xs), trees[0], *trees[1:])


def tree_index(tree: Any, idx) -> Any:
    """Rows ``idx`` (int, or int64 [m]) of every leaf."""
    return tree_map(lambda t: t[idx], tree)


def tree_scatter(tree: Any, idx: torch.Tensor, values: Any, where: str = "client state") -> Any:
    """A copy of ``tree`` with rows ``idx`` replaced by ``values`` (leading dim m).

    Dict keys are matched by name (their order may differ). Raises ValueError when ``values``
    does not have the structure of ``tree`` (a method returned a client state of another shape
    than the one it started with)."""
    if isinstance(tree, dict):
        if not isinstance(values, dict) or set(values) != set(tree):
            got = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise ValueError(f"{where}: structure changed, keys {got} instead of {sorted(tree)}")
        return {k: tree_scatter(tree[k], idx, values[k], f"{where}[{k!r}]") for k in tree}
    if isinstance(tree, tuple):
        if type(values) is not type(tree) or len(values) != len(tree):
            raise ValueError(f"{where}: structure changed")
        return type(tree)(*(tree_scatter(t, idx, v, where) for t, v in zip(tree, values)))
    _leaf_check(tree)
    _leaf_check(values)
    if tuple(values.shape[1:]) != tuple(tree.shape[1:]):
        raise ValueError(f"{where}: shape changed from {tuple(tree.shape[1:])} to {tuple(values.shape[1:])}")
    out = tree.clone()
    out[idx] = values.to(out.dtype)
    return out


def tree_clone(tree: Any) -> Any:
    """Detached copies with their own contiguous memory (also of expanded views)."""
    return tree_map(lambda t: t.detach().clone(memory_format=torch.contiguous_format), tree)


def finite_flags(trees: dict[str, Any]) -> tuple[list[tuple[str, str]], torch.Tensor | None]:
    """The divergence guard's check without its host read: ``(labels, ok)`` with ``labels`` the
    ``(name, key path)`` of every floating-point (or complex) leaf of the named trees ``trees``
    (in their order, each in torch pytree leaf order; the key path as
    ``torch.utils._pytree.keystr`` writes it, e.g. ``['model']['fc.weight']`` or
    ``['delta']['fc.weight'].u`` for a :class:`~medpfl.fl.payload.LowRank` leaf) and ``ok`` bool
    [len(labels)] on the first leaf's device, ``ok[i]`` whether leaf i is finite (no NaN, no
    ±inf); ``ok`` is None when there is no such leaf. Integer and boolean leaves are skipped.
    Device ops only (one ``isfinite(...).all()`` per leaf and a stack): read ``ok`` with
    :func:`first_false` once the round's values come to the host."""
    found: list[tuple[str, Any, torch.Tensor]] = []
    for name, tree in trees.items():
        for path, t in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                found.append((name, path, t))
    if not found:
        return [], None
    dev = found[0][2].device
    ok = torch.stack([torch.isfinite(t).all().to(dev) for _, _, t in found])
    return [(name, pytree.keystr(path)) for name, path, _ in found], ok


def first_false(labels: list[tuple[str, str]], ok: torch.Tensor | None) -> tuple[str, str] | None:
    """The label of the first False in ``ok`` (bool [len(labels)], best on the host: a read of a
    device tensor is one host sync), None when all are True or ``ok`` is None."""
    if ok is None or bool(ok.all()):
        return None
    return labels[int(torch.argmin(ok.to(torch.uint8)))]  # the first False


def first_nonfinite(trees: dict[str, Any]) -> tuple[str, str] | None:
    """``(name, key path)`` of the first floating-point leaf holding a NaN or ±inf among the
    named trees ``trees`` (in their order, each in torch pytree leaf order; the key path as
    ``torch.utils._pytree.keystr`` writes it, e.g. ``['model']['fc.weight']`` or
    ``['delta']['fc.weight'].u`` for a :class:`~medpfl.fl.payload.LowRank` leaf); None when every
    one is finite. Integer and boolean leaves are skipped. One ``torch.isfinite(...).all()`` per
    leaf, stacked, and one host sync for all of them (:func:`finite_flags` then
    :func:`first_false`; the engine defers that read to the end of the round)."""
    return first_false(*finite_flags(trees))


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` (any shapes and dtypes), with one device-to-host copy per device
    that holds some of them (one for a round on one accelerator) instead of one per tensor.

    The tensors of each non-CPU device are flattened, reinterpreted as bytes
    (``view(torch.uint8)``: no conversion, so every value, NaN payloads included, comes back bit
    for bit), concatenated on the device and copied once; on the host each is cut out and viewed
    back with its dtype and shape. CPU tensors are returned as they are (no copy). Returns the
    CPU tensors in the order of ``tensors``."""
    out: list[torch.Tensor | None] = [t if t.device.type == "cpu" else None for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is None:
            by_device.setdefault(t.device, []).append(i)
    for dev, idx in by_device.items():
        raw = [tensors[i].detach().reshape(-1).contiguous().view(torch.uint8) for i in idx]
        flat = (torch.cat(raw) if len(raw) > 1 else raw[0]).cpu()  # the one copy from this device
        at = 0
        for i, r in zip(idx, raw):
            n = r.numel()
            t = tensors[i]
            out[i] = flat[at:at + n].clone().view(t.dtype).view(t.shape)  # clone: offset 0, aligned for the dtype
            at += n
    return out  # type: ignore[return-value]
