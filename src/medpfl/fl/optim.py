"""The client optimizer as a chain of small gradient transformations.

The idea is optax's (``GradientTransformation``: an ``init``/``update`` pair, composed with
``chain``), written here in torch and in place. A transformation turns the gradients of the
leaves a phase trains into the update that is added to them; :func:`chain` runs several in
order and then adds the result to the leaves. One chain per trained tree and phase:

- SGD as ``torch.optim.SGD`` (dampening 0, no Nesterov):
  ``chain(clip_by_global_norm(c), add_decayed_weights(wd), trace(m), scale(-lr))``, i.e.
  ``d = g + wd*w;  b = m*b + d;  w = w - lr*b`` (:func:`sgd`);
- Adam as ``torch.optim.Adam``: ``chain(add_decayed_weights(wd), scale_by_adam(b1, b2, eps),
  scale(-lr))``, or with the decay decoupled (AdamW) ``chain(scale_by_adam(...),
  add_decayed_weights(wd), scale(-lr))`` (:func:`adam`).

A phase declares its chains (``Phase.optimizer``): :class:`RunOptimizer` (the run's
``train.optimizer``, with per-phase changes), an explicit chain, or ``{tree: either}``;
:func:`phase_optimizer` turns the declaration into one chain per trained tree, for both
executors alike.

**Leaves, state and clients.** ``params``, ``updates`` and every state buffer are
``{leaf name: tensor}`` of the same shapes. In the sequential executor a leaf is one client's
tensor; in the stacked executor it is a view of the first ``a`` rows of a stack ``[m, ...]``
(the clients still training), updated in place. Every transformation but the clip is
elementwise, so it acts on each client's row alone unchanged; the clip reduces per row when
``per_client`` is set. A transformation's state is ``{slot: {leaf: tensor}}`` (the momentum
buffer, Adam's moments: zeros like the leaves, new in every phase), so the stacked executor
takes the active rows of every buffer as views (:func:`rows`) and lays a buffer out like its
gradient (:func:`relayout_leaf_`). The step number ``count`` (1-based, within the phase) is
passed in: all clients still training in a phase have taken the same number of steps.

**One kernel per operation, not per leaf.** Every transformation applies its operations to the
list of leaves at once with PyTorch's multi-tensor ``torch._foreach_*`` ops (``_foreach_add_``,
``_foreach_mul_``, ``_foreach_lerp_``, ``_foreach_addcmul_``, ``_foreach_norm``; on CUDA one
launch per few dozen tensors, on the CPU a loop of the same per-tensor kernels, so the floats are
those of the per-leaf ops). Not per leaf: the per-client clip's rescaling (a per-row
coefficient broadcast over each leaf; torch's foreach fast path needs equal shapes).

**Device scalars (stacked executor).** :meth:`Chain.step_` takes ``count`` as a Python int
(sequential executor, FedBE) or as a 0-dim int64 tensor on the leaves' device, and the final
scale (``-lr``) as a Python float or a 0-dim tensor of the leaves' dtype on that device (``scale=``). With
tensors nothing per step is a Python number, so a step is the same kernels with the same
arguments at every step and round (what CUDA-graph capture needs), and the lr of a new round is
written into the tensor. The floats are the same: ``w += s*u`` with a 0-dim ``s`` is ``addcmul``,
rounded once like ``add_(u, alpha=s)`` (CPU: bit-identical), and Adam's bias corrections are
computed in float64 on the device from the count and rounded to float32, as the Python path's
float64 numbers are rounded to float32 by the kernels (bit-identical on the CPU for every step
count tested, ``tests/test_optim.py``; on CUDA float64 ``pow`` is within 2 float64 ulp, which
changes the float32 value only where the exact value lies within 2 float64 ulp of a float32
rounding boundary).

**Same floats as PyTorch.** Each transformation applies the in-place operations of
``torch.optim.SGD``'s single-tensor step in its order, and a chain that ends in ``scale(c)``
applies ``w += c * u`` as one ``w.add_(u, alpha=c)``, as ``torch.optim.SGD`` does
(``param.add_(grad, alpha=-lr)``, rounded once: PyTorch's vectorised CPU kernel is a fused
multiply-add); multiplying first would round twice. SGD chains therefore give torch's SGD
and the earlier hand-wired step bit for bit (with a clip first: within 1e-6 relative, as the
clip's global norm is now the norm of per-leaf ``_foreach_norm`` norms, summed in another order
than the earlier sum of squares; :func:`global_norm`). ``torch._fused_sgd_`` is not used: on the
CPU its floats differ from these on strided leaves and on small ones (torch 2.13). Adam is ``torch.optim.Adam``'s arithmetic up to
rounding: torch folds ``1 / (1 - b1^t)`` into the step size and applies ``addcdiv`` (its
reading of Kingma & Ba's "efficient version"), the chain scales the bias-corrected direction
(``tests/test_optim.py``: within 1e-6 relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

if TYPE_CHECKING:
    from medpfl.config import OptimizerConfig
    from medpfl.fl.program import Phase

Params = dict[str, torch.Tensor]
#: a transformation's state: {slot: {leaf: tensor}} (buffers shaped like the leaves)
State = dict[str, Params]


Count = int | torch.Tensor


class Transform:
    """A gradient transformation: ``init(params) -> state`` and ``update_(updates, state,
    params, count=, per_client=) -> updates``. ``update_`` may change the tensors of
    ``updates`` and ``state`` in place (they are the optimizer's own: fresh gradients and
    buffers, or views of a stack's rows) and returns the updates for the next transformation;
    it never changes ``params``. ``count``: the step number within the phase (1-based), a Python
    int or a 0-dim int64 tensor on the leaves' device; ``per_client``: the leaves carry a
    leading client dim (reductions are per row)."""

    def init(self, params: Params) -> State:
        return {}

    def update_(self, updates: Params, state: State, params: Params, *, count: Count, per_client: bool) -> Params:
        raise NotImplementedError


@dataclass(frozen=True)
class ClipByGlobalNorm(Transform):
    """``u <- u * min(1, max_norm / (||u|| + 1e-6))`` with ``||u||`` the L2 norm over all leaves of
    the tree (computed in float32; float64 for float64 leaves), per client: ``torch.nn.utils.clip_grad_norm_`` (its 1e-6
    included; PyTorch docs). FedKPer's ``clip_grad_norm``, FedKD's (PFLlib) per-model clip."""

    max_norm: float

    def update_(self, updates, state, params, *, count, per_client):
        us = list(updates.values())
        norm = global_norm(us, per_client)
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        if per_client:  # a per-row coefficient broadcast over each leaf: one kernel per leaf
            for u in us:
                u.mul_(coef.view(-1, *([1] * (u.dim() - 1))))
        else:
            torch._foreach_mul_(us, coef)
        return updates

    def __str__(self):
        return f"clip_by_global_norm({self.max_norm:g})"


@dataclass(frozen=True)
class AddDecayedWeights(Transform):
    """``u <- u + weight_decay * w``: weight decay as ``torch.optim.SGD`` and ``torch.optim.Adam``
    couple it (an L2 penalty's gradient, added before momentum / the moments; PyTorch docs).
    Placed after :class:`ScaleByAdam` it is the decoupled decay of AdamW (Loshchilov & Hutter,
    ICLR 2019, Alg. 2 line 12, with PyTorch's coupling of the decay to the lr: ``w <- w - lr
    (adam + wd w)``, ``torch.optim.AdamW``)."""

    weight_decay: float

    def update_(self, updates, state, params, *, count, per_client):
        torch._foreach_add_(list(updates.values()), [params[k] for k in updates], alpha=self.weight_decay)
        return updates

    def __str__(self):
        return f"add_decayed_weights({self.weight_decay:g})"


@dataclass(frozen=True)
class Trace(Transform):
    """Heavy-ball momentum as ``torch.optim.SGD``: ``b <- decay * b + u;  u <- b``, ``b`` zero at
    the start of each phase (dampening 0, no Nesterov; PyTorch docs, which note that this
    differs from Sutskever et al. 2013 by where the lr enters)."""

    decay: float

    def init(self, params):
        return {"trace": {k: torch.zeros_like(p) for k, p in params.items()}}

    def update_(self, updates, state, params, *, count, per_client):
        bufs = [state["trace"][k] for k in updates]
        torch._foreach_mul_(bufs, self.decay)
        torch._foreach_add_(bufs, list(updates.values()))
        return dict(zip(updates, bufs))

    def __str__(self):
        return f"trace({self.decay:g})"


@dataclass(frozen=True)
class ScaleByAdam(Transform):
    """Adam's direction (Kingma & Ba, ICLR 2015, Algorithm 1; ``torch.optim.Adam``):
    ``m <- b1 m + (1 - b1) u;  v <- b2 v + (1 - b2) u^2;  u <- m_hat / (sqrt(v_hat) + eps)``
    with ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)``, t = ``count``; eps is added
    outside the square root (as the paper and PyTorch). Defaults b1 0.9, b2 0.999, eps 1e-8:
    the paper's "good default settings" (Sec. 2) and PyTorch's. Moments start at zero in each
    phase. The in-place moment updates are torch's (``lerp_``, ``mul_().addcmul_``)."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def init(self, params):
        return {"mu": {k: torch.zeros_like(p) for k, p in params.items()},
                "nu": {k: torch.zeros_like(p) for k, p in params.items()}}

    def bias_corrections(self, count: Count, dtype: torch.dtype = torch.float32
                         ) -> tuple[float, float] | tuple[torch.Tensor, torch.Tensor]:
        """``(1 - b1^t, sqrt(1 - b2^t))`` at step t = ``count``: Python floats (float64) for an
        int; for a 0-dim integer tensor, 0-dim tensors of ``dtype`` (the leaves' dtype) on its
        device, computed in float64 from it (device ops only) and rounded to ``dtype``, which is
        what a kernel of that dtype makes of the Python floats (float32: the same float32
        values, ``tests/test_optim.py``; float64: the Python floats up to ``pow``'s rounding)."""
        if isinstance(count, torch.Tensor):
            t = count.to(torch.float64)
            return ((1 - torch.pow(self.b1, t)).to(dtype),
                    torch.sqrt(1 - torch.pow(self.b2, t)).to(dtype))
        return 1 - self.b1 ** count, (1 - self.b2 ** count) ** 0.5

    def update_(self, updates, state, params, *, count, per_client):
        us = list(updates.values())
        ms, vs = [state["mu"][k] for k in updates], [state["nu"][k] for k in updates]
        bc1, bc2_sqrt = self.bias_corrections(count, us[0].dtype if us else torch.float32)
        torch._foreach_lerp_(ms, us, 1 - self.b1)
        torch._foreach_mul_(vs, self.b2)
        torch._foreach_addcmul_(vs, us, us, value=1 - self.b2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.eps)
        out = torch._foreach_div(ms, denom)  # m_hat / (sqrt(v_hat) + eps)
        torch._foreach_div_(out, bc1)
        return dict(zip(updates, out))

    def __str__(self):
        return f"scale_by_adam({self.b1:g}, {self.b2:g}, {self.eps:g})"


@dataclass(frozen=True)
class Scale(Transform):
    """``u <- factor * u``. ``scale(-lr)`` last in a chain is the step size (SGD's and Adam's);
    :meth:`Chain.step_` then adds ``factor * u`` to the leaves in one fused operation."""

    factor: float

    def update_(self, updates, state, params, *, count, per_client):
        torch._foreach_mul_(list(updates.values()), self.factor)
        return updates

    def __str__(self):
        return f"scale({self.factor:g})"


@dataclass(frozen=True)
class Chain:
    """Transformations applied in order; :meth:`step_` then adds the result to the leaves.
    Build with :func:`chain` (which flattens nested chains)."""

    transforms: tuple[Transform, ...]

    def init(self, params: Params) -> list[State]:
        """Zero buffers for one phase (a list: one state per transformation)."""
        return [t.init(params) for t in self.transforms]

    @torch.no_grad()
    def step_(self, params: Params, grads: Params, state: list[State], count: Count, per_client: bool = False,
              scale: torch.Tensor | None = None) -> None:
        """One optimizer step, in place: ``w <- w + u`` with ``u`` the transformed ``grads``
        (overwritten). A final :class:`Scale` is applied as ``w.add_(u, alpha=factor)`` (one
        rounding), all leaves in one ``torch._foreach_add_``. A transformation's state is never
        handed on to a later one (which may change its updates in place): :class:`Trace`'s
        buffer is copied unless only the final scale follows it.

        ``count``: the step number within the phase (1-based): a Python int, or a 0-dim int64
        tensor on the leaves' device (the stacked executor's, incremented in place).
        ``scale``: None, or the final :class:`Scale`'s factor (``-lr``) as a 0-dim tensor of
        the leaves' dtype on their device (a float32 scale on float64 leaves would step with
        the float32-rounded lr), applied as ``torch._foreach_addcmul_(w, u, scale)``
        (also rounded once: on the CPU the same floats as the Python factor). ``per_client``:
        the leaves carry a leading client dim [a, ...] (the clip's norm is per row).
        Raises ValueError when ``scale`` is given and the chain does not end in a
        :class:`Scale`."""
        ts = self.transforms
        alpha = 1.0
        if ts and isinstance(ts[-1], Scale):
            ts, alpha = ts[:-1], ts[-1].factor
        elif scale is not None:
            raise ValueError(f"step_: scale given, but the chain {self} does not end in scale(c)")
        u = grads
        for i, (t, s) in enumerate(zip(ts, state)):
            u = t.update_(u, s, params, count=count, per_client=per_client)
            if s and i < len(ts) - 1:  # trace returns its buffer: a later in-place transformation gets a copy
                own = {id(b) for bufs in s.values() for b in bufs.values()}
                u = {k: v.clone() if id(v) in own else v for k, v in u.items()}
        ps, us = list(params.values()), [u[k] for k in params]
        if scale is None:
            torch._foreach_add_(ps, us, alpha=alpha)
        else:
            torch._foreach_addcmul_(ps, us, [scale] * len(ps))

    @property
    def final_scale(self) -> float | None:
        """The factor of a final :class:`Scale` (``-lr`` for SGD and Adam; None without one)."""
        return self.transforms[-1].factor if self.transforms and isinstance(self.transforms[-1], Scale) else None

    @property
    def lr(self) -> float | None:
        """The step size: minus the factor of a final :class:`Scale` (None without one)."""
        return -self.transforms[-1].factor if self.transforms and isinstance(self.transforms[-1], Scale) else None

    def __str__(self):
        return " -> ".join(str(t) for t in self.transforms) or "identity"


def global_norm(leaves: list[torch.Tensor], per_client: bool = False) -> torch.Tensor:
    """The L2 norm over all ``leaves`` (any float dtype; computed in float32, or in float64 when a
    leaf is float64, as ``clip_grad_norm_`` computes in the leaves' dtype): a 0-dim tensor of
    that dtype, or with ``per_client`` (leaves [a, ...], a leading client dim) [a], the norm
    of each row over all leaves. One ``torch._foreach_norm`` over the leaves (their rows with
    ``per_client``), then the norm of those norms: ``sqrt(sum_l ||u_l||^2)``. Equals the norm of
    the concatenated leaves up to float32 summation order (within 1e-6 relative,
    ``tests/test_optim.py``). Raises ValueError on an empty list."""
    if not leaves:
        raise ValueError("global_norm: no leaves")
    dtype = torch.float64 if any(u.dtype == torch.float64 for u in leaves) else torch.float32
    if per_client:
        a = leaves[0].shape[0]
        norms = torch._foreach_norm([r for u in leaves for r in u.unbind(0)], 2, dtype=dtype)
        return torch.linalg.vector_norm(torch.stack(norms).view(len(leaves), a), dim=0)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves, 2, dtype=dtype)))


def chain(*transforms: Transform | Chain) -> Chain:
    """The transformations in order (nested chains are flattened)."""
    flat: list[Transform] = []
    for t in transforms:
        if isinstance(t, Chain):
            flat.extend(t.transforms)
        elif isinstance(t, Transform):
            flat.append(t)
        else:
            raise TypeError(f"chain: expected transformations, got {type(t).__name__}")
    return Chain(tuple(flat))


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    return ClipByGlobalNorm(max_norm)


def add_decayed_weights(weight_decay: float) -> AddDecayedWeights:
    return AddDecayedWeights(weight_decay)


def trace(decay: float) -> Trace:
    return Trace(decay)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> ScaleByAdam:
    return ScaleByAdam(b1, b2, eps)


def scale(factor: float) -> Scale:
    return Scale(factor)


def sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> Chain:
    """``torch.optim.SGD(lr, momentum, weight_decay)`` (dampening 0, no Nesterov):
    ``add_decayed_weights(wd) -> trace(m) -> scale(-lr)``; a zero decay or momentum leaves its
    transformation out (the same numbers, no buffer)."""
    return chain(*([add_decayed_weights(weight_decay)] if weight_decay else []),
                 *([trace(momentum)] if momentum else []), scale(-lr))


def adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
         decoupled_weight_decay: bool = False) -> Chain:
    """``torch.optim.Adam(lr, betas=(b1, b2), eps, weight_decay, decoupled_weight_decay)``:
    the decay added to the gradient before the moments (L2, Adam's), or with
    ``decoupled_weight_decay`` to the direction after them (AdamW, Loshchilov & Hutter 2019;
    ``torch.optim.AdamW``); then ``scale(-lr)``."""
    decay = [add_decayed_weights(weight_decay)] if weight_decay else []
    if decoupled_weight_decay:
        return chain(scale_by_adam(b1, b2, eps), *decay, scale(-lr))
    return chain(*decay, scale_by_adam(b1, b2, eps), scale(-lr))


# ----- what a phase declares ------------------------------------------------------------------

@dataclass(frozen=True)
class RunOptimizer:
    """The run's optimizer (``train.optimizer``: SGD or Adam, its betas and eps) with this phase's
    changes, for one tree or every tree of a phase. Every None is the run's value.

    lr: absolute learning rate (None: the round's lr); lr_scale: a multiplier of it.
    momentum: SGD's heavy-ball coefficient; on an Adam run (no such term) only None or 0.
    weight_decay: coupled as the run's (Adam's L2, or decoupled with
      ``train.optimizer.decoupled_weight_decay``).
    max_grad_norm: clip the tree's gradient to this global L2 norm first, per client (None: no
      clip; the run has none).
    """

    lr: float | None = None
    lr_scale: float = 1.0
    momentum: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None

    def chain(self, run: OptimizerConfig, round_lr: float, where: str = "phase") -> Chain:
        """The chain on a run with optimizer ``run`` in a round of lr ``round_lr``."""
        lr = (self.lr if self.lr is not None else round_lr) * self.lr_scale
        wd = run.weight_decay if self.weight_decay is None else self.weight_decay
        clip = [clip_by_global_norm(self.max_grad_norm)] if self.max_grad_norm is not None else []
        if run.name == "sgd":
            return chain(*clip, sgd(lr, run.momentum if self.momentum is None else self.momentum, wd))
        if run.name == "adam":
            if self.momentum:
                raise ValueError(f"{where}: momentum {self.momentum:g} is SGD's heavy-ball term, and "
                                 "train.optimizer.name is adam (its first-moment decay is betas[0]); a phase "
                                 "on an Adam run leaves momentum unset or 0")
            b1, b2 = run.betas
            return chain(*clip, adam(lr, b1, b2, run.eps, wd, run.decoupled_weight_decay))
        raise ValueError(f"{where}: unknown train.optimizer.name {run.name!r}")


#: what ``Phase.optimizer`` holds for one tree
OptimizerSpec = RunOptimizer | Chain | Transform


def _build(spec: Any, run: OptimizerConfig, round_lr: float, where: str) -> Chain:
    if isinstance(spec, RunOptimizer):
        return spec.chain(run, round_lr, where)
    if isinstance(spec, (Chain, Transform)):
        return chain(spec)
    raise TypeError(f"{where}: optimizer must be a RunOptimizer, a chain or a transformation, got "
                    f"{type(spec).__name__}")


def phase_optimizer(phase: Phase, run: OptimizerConfig, round_lr: float, trees: Iterable[str],
                    where: str = "phase") -> dict[str, Chain]:
    """One chain per tree the phase trains (``trees``), from ``phase.optimizer``: a
    :class:`RunOptimizer` or a chain for every tree, or ``{tree: either}`` (a tree not named
    gets ``RunOptimizer()``, the run's optimizer; naming a tree the phase does not train is an
    error). ``where`` names the method and phase in errors. Both executors build a phase's
    optimizer here."""
    trees = list(trees)
    spec = phase.optimizer
    if isinstance(spec, Mapping):
        extra = sorted(set(spec) - set(trees))
        if extra:
            raise ValueError(f"{where}: optimizer for {extra}, which the phase does not train ({sorted(trees)})")
        return {t: _build(spec.get(t, RunOptimizer()), run, round_lr, f"{where}, tree {t!r}") for t in trees}
    return {t: _build(spec, run, round_lr, f"{where}, tree {t!r}") for t in trees}


# ----- stacked leaves -------------------------------------------------------------------------

def rows(state: list[State], a: int) -> list[State]:
    """Views of the first ``a`` rows (clients) of every buffer (stacked executor)."""
    return [{slot: {k: b[:a] for k, b in bufs.items()} for slot, bufs in s.items()} for s in state]


def relayout_leaf_(state: list[State], leaf: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Replace every buffer of ``leaf`` by ``fn(buffer)`` where that is not None (the stacked
    executor's re-layout of a stack to its gradient's strides: same values)."""
    for s in state:
        for bufs in s.values():
            if leaf in bufs:
                moved = fn(bufs[leaf])
                if moved is not None:
                    bufs[leaf] = moved
