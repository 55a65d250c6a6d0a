"""Nested dicts of tensors ("trees"): stack, index and scatter along a leading client dim."""

from __future__ import annotations

from typing import Any, Callable

import torch


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    raise TypeError(f"tree leaves must be tensors, got {type(tree).__name__}")


def tree_stack(trees: list[Any]) -> Any:
    """Stack a list of equally shaped trees along a new leading dim."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: tree_stack([t[k] for t in trees]) for k in first}
    return torch.stack(trees)


def tree_index(tree: Any, idx) -> Any:
    """Rows ``idx`` (int, or int64 [m]) of every leaf."""
    return tree_map(lambda t: t[idx], tree)


def tree_scatter(tree: Any, idx: torch.Tensor, values: Any) -> Any:
    """A copy of ``tree`` with rows ``idx`` replaced by ``values`` (leading dim m)."""
    if isinstance(tree, dict):
        return {k: tree_scatter(tree[k], idx, values[k]) for k in tree}
    out = tree.clone()
    out[idx] = values.to(out.dtype)
    return out


def tree_repeat(tree: Any, k: int) -> Any:
    """K independent copies of a tree along a new leading dim."""
    return tree_map(lambda t: t.unsqueeze(0).repeat(k, *([1] * t.dim())).clone(), tree)
