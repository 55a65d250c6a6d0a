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


def first_nonfinite(trees: dict[str, Any]) -> tuple[str, str] | None:
    """``(name, key path)`` of the first floating-point leaf holding a NaN or ±inf among the
    named trees ``trees`` (in their order, each in torch pytree leaf order; the key path as
    ``torch.utils._pytree.keystr`` writes it, e.g. ``['model']['fc.weight']`` or
    ``['delta']['fc.weight'].u`` for a :class:`~medpfl.fl.payload.LowRank` leaf); None when every
    one is finite. Integer and boolean leaves are skipped. One ``torch.isfinite(...).all()`` per
    leaf, stacked, and one host sync for all of them."""
    found: list[tuple[str, Any, torch.Tensor]] = []
    for name, tree in trees.items():
        for path, t in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                found.append((name, path, t))
    if not found:
        return None
    dev = found[0][2].device
    ok = torch.stack([torch.isfinite(t).all().to(dev) for _, _, t in found])
    if bool(ok.all()):
        return None
    name, path, _ = found[int(torch.argmin(ok.to(torch.uint8)))]  # the first False
    return name, pytree.keystr(path)
