"""Trees on the wire: what a deployed round sends between the server and the sites.

A message's tensors travel as one flat list of numpy arrays plus a description of the tree
they came from (torch's pytree spec as JSON) and their torch dtypes, so the receiver rebuilds
exactly the tree that was sent: nested dicts, tuples, :class:`~medpfl.fl.payload.LowRank`
factors, empty dicts, 0-d tensors, integer and bfloat16 leaves (sent as their int16 bits, since
numpy has no bfloat16). Values are copied bit for bit; nothing is rounded.

:func:`pack` / :func:`unpack` know nothing of Flower; :mod:`medpfl.deploy.app` puts their output
in a Flower ``ArrayRecord`` (``"p0"``, ``"p1"``, ...) and ``ConfigRecord`` (``"treespec"``,
``"dtypes"``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from medpfl.fl.payload import LowRank

_NAMEDTUPLES = {"medpfl.fl.payload.LowRank": LowRank}
for _name, _cls in _NAMEDTUPLES.items():
    try:  # torch's pytree serialises a namedtuple only when it has a registered name
        pytree._register_namedtuple(_cls, serialized_type_name=_name)
    except ValueError:  # registered already (a re-import)
        pass


def pack(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``tree`` (nested dicts/tuples of tensors, any device) -> ``(arrays, meta)``.

    arrays: ``{"p<i>": ndarray}`` in leaf order (CPU copies; bfloat16 leaves as int16 bits);
    meta: ``{"treespec": str, "dtypes": list[str]}`` (JSON-able). Raises TypeError on a leaf
    that is not a tensor."""
    leaves, spec = pytree.tree_flatten(tree)
    arrays: dict[str, np.ndarray] = {}
    dtypes: list[str] = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"wire: leaf {i} is a {type(t).__name__}, not a tensor")
        t = t.detach().cpu().contiguous()
        dtypes.append(str(t.dtype).removeprefix("torch."))
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        arrays[f"p{i}"] = t.numpy().copy()
    return arrays, {"treespec": pytree.treespec_dumps(spec), "dtypes": dtypes}


def unpack(arrays: dict[str, np.ndarray], meta: dict[str, Any], device: torch.device | str = "cpu") -> Any:
    """The inverse of :func:`pack`: the tree with every leaf on ``device``. Raises ValueError
    when the arrays do not match the description (a truncated or foreign message)."""
    spec = pytree.treespec_loads(meta["treespec"])
    dtypes = list(meta["dtypes"])
    if len(dtypes) != spec.num_leaves or len(arrays) != spec.num_leaves:
        raise ValueError(f"wire: the message holds {len(arrays)} arrays and {len(dtypes)} dtypes for a tree of "
                         f"{spec.num_leaves} leaves")
    leaves = []
    for i, name in enumerate(dtypes):
        a = np.asarray(arrays[f"p{i}"])
        dt = getattr(torch, name)
        t = torch.from_numpy(a.copy())
        t = t.view(torch.bfloat16) if dt == torch.bfloat16 else t.to(dt)
        leaves.append(t.to(device))
    return pytree.tree_unflatten(leaves, spec)


def nbytes(arrays: dict[str, np.ndarray]) -> int:
    """Bytes of the arrays' data (what :func:`pack` put on the wire, without framing)."""
    return int(sum(a.nbytes for a in arrays.values()))


def dumps(obj: Any) -> str:
    """JSON for a message's config fields (sorted keys, no NaN)."""
    return json.dumps(obj, sort_keys=True, allow_nan=False)
