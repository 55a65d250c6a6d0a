"""The stacked executor: all of a round's clients run their local program as one vectorised
computation.

Client trees and optimizer buffers are stacked along a leading client dimension ``m``; every
per-client hook of the method (``begin``, ``sample_context``, the phase objectives, passes,
``finish``, ``personalized_model``, ``predict``) runs under ``torch.func.vmap`` over clients
(convolutions with per-client weights become grouped convolutions, linear layers batched
matmuls), and one ``autograd.grad`` of the summed loss gives every client its own gradient.
What is shared and what is per client is declared, never inferred: the ``shared`` part of the
download and ``shared_context`` enter with ``in_dims=None`` (e.g. FedKPer's teacher runs as one
ordinary batched forward); the ``per_client`` download, the client states and everything
``begin`` returns enter with ``in_dims=0``.

Clients with different numbers of steps in a phase are handled exactly: the clients are sorted
by their step count, so at every step those that still have batches are a prefix of the stack
and the step runs on views of those rows only (a client that has finished is not touched, and
no compute is spent on it); a client's partial last batch of an epoch carries per-sample
weights ``1/b`` on its ``b`` real samples and 0 on padding, and BatchNorm statistics use the real
samples only. The per-client arithmetic is that of the sequential executor, up to float
summation order. With ``train.cuda_graphs`` (or the private ``_fixed_shape_steps``) every step
runs all m rows instead, finished clients masked and restored (:meth:`StackedExecutor._run_phase_fixed`),
so that a step has one shape and can be captured (:mod:`medpfl.fl.graphs`). A method whose program cannot be vectorised (``not_stackable_because``, or a
phase with an ``until`` rule) runs on the sequential executor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import vmap

from medpfl.algorithms.base import Algorithm
from medpfl.fl.executors import SequentialExecutor, _grad
from medpfl.fl.optim import relayout_leaf_, rows as state_rows
from medpfl.fl.program import (Download, Pass, Phase, RoundInfo, device_plan_bounds, device_plan_steps, device_plans,
                                pass_plan, phase_plan)
from medpfl.fl.graphs import _StaticStep, _phase_signature
from medpfl.fl.tree import tree_clone, tree_index, tree_leaves, tree_map


def _tree_cat(parts: list[Any]) -> Any:
    """Stacked trees (leading dim m_i each) -> one stacked tree, rows in order."""
    return parts[0] if len(parts) == 1 else tree_map(lambda *xs: torch.cat(xs), parts[0], *parts[1:])


def _rows(tree: Any, dims: Any, a: int) -> Any:
    """The first ``a`` clients of the per-client leaves (dims 0); shared leaves (None) unchanged."""
    if dims is None:
        return tree
    if isinstance(tree, dict):
        return {k: _rows(v, dims[k] if isinstance(dims, dict) else dims, a) for k, v in tree.items()}
    return tree_map(lambda t: t[:a], tree)


def _row0(tree: Any, dims: Any) -> Any:
    """The first client's slice of the per-client leaves; shared leaves unchanged."""
    if dims is None:
        return tree
    if isinstance(tree, dict):
        return {k: _row0(v, dims[k] if isinstance(dims, dict) else dims) for k, v in tree.items()}
    return tree_map(lambda t: t[0], tree)


def _permute(tree: Any, dims: Any, perm: torch.Tensor) -> Any:
    """Rows of the per-client leaves in the order ``perm``; shared leaves unchanged."""
    if dims is None:
        return tree
    if isinstance(tree, dict):
        return {k: _permute(v, dims[k] if isinstance(dims, dict) else dims, perm) for k, v in tree.items()}
    return tree_index(tree, perm)


def _like_grad(stack: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """A stack of matrices ``stack`` ([m, r, c], any float dtype) copied into the memory layout of
    ``grad`` ([a, r, c], a <= m, the gradient of its first ``a`` rows), row-major or with each
    matrix transposed: same shape, dtype and values, new strides. None when it already has that
    layout, the gradient has neither layout (expanded, sliced) or the leaf is not a matrix.

    Why: under ``vmap`` autograd returns a linear layer's batched weight gradient [a, out, in]
    with the strides of a transposed [a, in, out], and the in-place SGD step ``w -= lr * g``
    then reads ``g`` across cache lines (``python -m benchmarks.stacked_layout`` times that add
    both ways). Keeping the stack in the gradient's layout makes the step a streaming add
    (FedAvg rounds on the MNIST MLP 1.32x faster, same benchmark). Values are copied exactly,
    but the matmuls then read the weight transposed, which may round differently: the
    pFedKD-WCL MNIST records (MLR, MLP) came out bit-identical, cnn4's parameters within 1e-6
    after a round (its 512x3136 layer, ``tests/test_engine.py``). Only matrices are re-laid out;
    convolution weights were not measured.
    """
    if grad.dim() != 3 or grad.stride()[1:] == stack.stride()[1:]:  # once laid out: nothing per step
        return None
    if grad.transpose(1, 2).is_contiguous():
        return None if stack.transpose(1, 2).is_contiguous() else stack.transpose(1, 2).contiguous().transpose(1, 2)
    if grad.is_contiguous():
        return None if stack.is_contiguous() else stack.contiguous()
    return None


def _leaf_dtype(tree: dict, names: Any) -> torch.dtype:
    """The floating dtype of the trained leaves ``names`` of ``tree`` (float32 when none is
    floating): the dtype of the step's ``-lr`` tensor, so that a float64 run steps with the
    float64 lr, as the sequential executor's ``add_(u, alpha=-lr)`` does."""
    for k in names:
        v = tree[k]
        if v.is_floating_point():
            return v.dtype
    return torch.float32


def _pad_ids(groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index sets (int64 [n_j] each, on one device) -> (ids int64 [m, L] padded with each set's
    first id, valid bool [m, L]), L = the longest set. Device ops only (no value is read on the
    host and nothing is copied from it: the lengths are the tensors' shapes)."""
    width = max(len(g) for g in groups)
    ids = torch.stack([torch.cat([g, g[:1].expand(width - len(g))]) if len(g) < width else g for g in groups])
    valid = torch.stack([torch.cat([torch.ones(len(g), dtype=torch.bool, device=g.device),
                                    torch.zeros(width - len(g), dtype=torch.bool, device=g.device)])
                         for g in groups])
    return ids, valid


def local_steps() -> contextlib.AbstractContextManager:
    """The context the stacked executor runs a round's local steps in: from the first step of
    its first phase to the last step of its last (:meth:`StackedExecutor.train_clients`,
    :meth:`StackedExecutor.adapt_models`), after every host-side preparation (batch plans, their
    one host-to-device copy, per-client epochs). A no-op; the placement test
    (``tests/test_device_placement.py``) replaces it to fail on any host synchronisation in
    there (:meth:`medpfl.fl.emulated_device.EmulatedDevice.no_sync`, and
    ``torch.cuda.set_sync_debug_mode("error")`` on a GPU)."""
    return contextlib.nullcontext()


class _Plan:
    """Per-client batch plans of one phase or pass, sorted by decreasing step count: at step s the
    clients that still have batches are the first ``n_active[s]`` rows.

    Built on the host (``host``: int64 [m, S, B], -1 on padding; ``order``); :meth:`place`
    puts the device tensors (``pos``, ``weights``, ``perm``, ``inverse``) from a device copy of
    ``host`` and ``order`` (:func:`_to_device`: one copy for every plan of the round)."""

    def __init__(self, plans: list[torch.Tensor], batch_size: int):
        m = len(plans)
        self._sort([p.shape[0] for p in plans])
        plan = torch.full((m, self.steps, batch_size), -1, dtype=torch.int64)
        for r, j in enumerate(self.order):
            plan[r, : self.steps_k[j]] = plans[j]
        self.host = plan

    def _sort(self, steps_k: list[int]) -> None:
        """The row order by decreasing step count (``order``, ``identity``), the longest count
        (``steps``) and the active rows per step (``n_active``) from each client's ``steps_k``."""
        m = len(steps_k)
        self.steps_k = steps_k
        self.order = sorted(range(m), key=lambda j: -steps_k[j])
        self.identity = self.order == list(range(m))
        self.steps = steps_k[self.order[0]] if m else 0
        self.n_active = [sum(1 for j in self.order if steps_k[j] > s) for s in range(self.steps)]

    def host_parts(self) -> list[torch.Tensor]:
        """What :meth:`place` needs on the device, as host tensors (int64)."""
        return [self.host, torch.as_tensor(self.order, dtype=torch.int64), torch.as_tensor(self.steps_k, dtype=torch.int64)]

    def place(self, plan: torch.Tensor, perm: torch.Tensor, steps: torch.Tensor) -> "_Plan":
        """The device tensors from the device copies of :meth:`host_parts` (device ops only)."""
        m = perm.shape[0]
        valid = plan >= 0
        self.weights = valid.to(torch.float32) / valid.sum(-1, keepdim=True).clamp(min=1)  # 1/b on a batch's b samples
        self.pos = plan.clamp(min=0)
        self.perm = perm
        self.inverse = torch.empty_like(perm)
        self.inverse[perm] = torch.arange(m, device=perm.device)
        self.steps_dev = steps  # int64 [m]: each client's step count, client order
        return self


class _DevicePlan(_Plan):
    """A :class:`_Plan` drawn on the device (``train.sampling.plans: device``): the host holds only
    the clients' keys (sizes, epochs, seeds, client ids) and the step counts; :meth:`place` draws
    every client's plan in one batched computation
    (:func:`~medpfl.fl.program.device_plans`) from the keys' device copy and sorts its rows."""

    def __init__(self, sizes: list[int], epochs: list[int], seeds: list[int], clients: list[int], batch_size: int,
                 round_idx: int, phase: Phase):
        m = len(sizes)
        self._sort([device_plan_steps(n, batch_size, e, phase) for n, e in zip(sizes, epochs)])
        self.keys = torch.tensor([sizes, epochs, seeds, clients], dtype=torch.int64).view(4, m)
        self.bounds = device_plan_bounds(sizes, epochs, batch_size, phase)
        self.batch_size, self.round_idx, self.phase = batch_size, round_idx, phase

    def host_parts(self) -> list[torch.Tensor]:
        return [self.keys, torch.as_tensor(self.order, dtype=torch.int64), torch.as_tensor(self.steps_k, dtype=torch.int64)]

    def place(self, keys: torch.Tensor, perm: torch.Tensor, steps: torch.Tensor) -> "_Plan":
        plan = device_plans(keys[0], keys[1], keys[2], keys[3], self.round_idx, self.batch_size, self.phase,
                            *self.bounds)
        return super().place(plan if self.identity else plan[perm], perm, steps)


def _to_device(plans: list[_Plan], device: torch.device) -> list[_Plan]:
    """Every plan's device tensors from one host-to-device copy (a pageable copy synchronises
    the host with the device on CUDA: once per call, not once per phase)."""
    parts = [t for p in plans for t in p.host_parts()]
    flat = torch.cat([t.reshape(-1) for t in parts]).to(device)
    views = iter(flat.split([t.numel() for t in parts]))
    for p in plans:
        plan, perm, steps = (next(views).view(t.shape) for t in p.host_parts())
        p.place(plan, perm, steps)
    return plans


class StackedExecutor(SequentialExecutor):
    """Vectorised over the round's clients; same results as :class:`SequentialExecutor`."""

    name = "stacked"

    def _step_scalar(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """A 0-dim tensor of ``dtype`` on the data's device, kept by the executor under ``key``
        (the same memory every phase and round; the caller writes its value in place with
        ``zero_``/``fill_``, device ops without a host synchronisation). The step loop's step
        counter (``"count"``, int64) and each trained tree's final scale ``-lr`` (the dtype of that
        tree's trained leaves: float32, or float64 in a float64 run, as the sequential path's
        Python float is rounded by the leaves' kernels): no
        Python number changes from one local step to the next (CUDA-graph capture, issue 32)."""
        store = self.__dict__.setdefault("_step_scalars", {})
        t = store.get(key)
        if t is None or t.dtype != dtype or t.device.type != torch.device(self.data.device).type:
            t = store[key] = torch.zeros((), dtype=dtype, device=self.data.device)
        return t

    def _gather_sctx(self, sctx: dict, pos: torch.Tensor, a: int) -> dict:
        out = {}
        bs = pos.shape[1]
        for k, v in sctx.items():
            idx = pos.view(a, bs, *([1] * (v.dim() - 2))).expand(a, bs, *v.shape[2:])
            out[k] = torch.gather(v[:a], 1, idx)
        return out

    @torch.no_grad()
    def _sample_context_stacked(self, algo: Algorithm, ctx: dict, cdims: dict, ids: torch.Tensor) -> dict:
        fn = vmap(algo.sample_context, in_dims=(cdims, 0))
        parts: dict[str, list[torch.Tensor]] = {}
        chunk = max(1, self.eval_batch_size // max(1, ids.shape[0]))
        for s in range(0, ids.shape[1], chunk):
            for k, v in fn(ctx, self.data.x(ids[:, s:s + chunk])).items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v, dim=1) for k, v in parts.items()}

    def _run_pass_stacked(self, algo: Algorithm, p: Pass, trees: dict, ctx: dict, cdims: dict, ids: torch.Tensor,
                          sizes: list[int], clients: list[int], rnd: RoundInfo, seeds: list[int] | None = None
                          ) -> dict[str, torch.Tensor]:
        m = len(clients)
        bs = self._pass_batch_size(p, max(1, self.eval_batch_size // m))
        seeds = self._row_seeds(seeds, m)
        plan, = _to_device([_Plan([pass_plan(n, bs, sd, rnd.round, c, p) for n, c, sd in zip(sizes, clients, seeds)],
                                  bs)], ids.device)
        t = trees if plan.identity else tree_index(trees, plan.perm)
        c = ctx if plan.identity else _permute(ctx, cdims, plan.perm)
        i = ids if plan.identity else ids[plan.perm]
        sample_ids = torch.gather(i.unsqueeze(1).expand(m, plan.steps, i.shape[1]), 2, plan.pos)
        fn = vmap(p.fn, in_dims=(0, cdims, 0))
        total: Any = None
        with torch.no_grad():
            for s in range(plan.steps):
                a = plan.n_active[s]
                sid = sample_ids[:a, s]
                batch = {"x": self.data.x(sid), "y": self.data.labels[sid], "w": plan.weights[:a, s]}
                out = fn(tree_map(lambda x: x[:a], t), _rows(c, cdims, a), batch)
                if total is None:
                    total = tree_map(lambda v: torch.zeros((m, *v.shape[1:]), dtype=v.dtype, device=v.device), out)
                tree_map(lambda acc, v: acc[:a].add_(v), total, out)
        return total if plan.identity else tree_index(total, plan.inverse)

    def _row_seeds(self, seeds: list[int] | None, m: int) -> list[int]:
        """The run seed of each of the m rows: ``seeds`` (stacked seeds,
        :mod:`medpfl.fl.seed_stack`) or this executor's seed for every row."""
        if seeds is None:
            return [self.seed] * m
        if len(seeds) != m:
            raise ValueError(f"{len(seeds)} row seeds for {m} clients")
        return [int(v) for v in seeds]

    def _phase_plans(self, algo: Algorithm, phases: list[Phase], ctx: dict, cdims: dict, sizes: list[int],
                     clients: list[int], rnd: RoundInfo, seeds: list[int] | None = None) -> list[_Plan]:
        """Every phase's batch plan (:class:`_Plan`), built on the host before the round's first
        local step and put on the device by one copy; per-client epochs (``Phase.epochs`` a
        callable) read on the host in one go (one synchronisation for all phases). ``seeds``:
        each row's run seed (None: this executor's), the seed of its plans."""
        for ph in phases:
            if ph.until is not None:
                raise ValueError(f"method {algo.name!r}, phase {ph.name!r}: an 'until' rule runs on the sequential "
                                 "executor only (declare not_stackable_because)")
        m = len(clients)
        seeds = self._row_seeds(seeds, m)
        dynamic = [ph for ph in phases if callable(ph.epochs)]
        read = {}
        if dynamic:  # one host read for every phase whose epochs depend on the client's context
            values = torch.stack([vmap(ph.epochs, in_dims=(cdims,))(ctx).reshape(m) for ph in dynamic]).cpu().tolist()
            read = {ph.name: [int(e) for e in v] for ph, v in zip(dynamic, values)}
        plans = []
        for ph in phases:
            epochs = read[ph.name] if callable(ph.epochs) else [self._epochs(ph)] * m
            bs = self._batch_size(ph)
            if self.device_plans(ph):  # train.sampling.plans: device: drawn in one batched computation there
                plans.append(_DevicePlan(sizes, [int(e) for e in epochs], seeds, clients, bs, rnd.round, ph))
                continue
            per_client = [phase_plan(n, bs, e, sd, rnd.round, c, ph) if e > 0
                          else torch.empty(0, bs, dtype=torch.int64)
                          for n, e, c, sd in zip(sizes, epochs, clients, seeds)]
            plans.append(_Plan(per_client, bs))
        return _to_device(plans, self.data.device)

    def _run_phase_stacked(self, algo: Algorithm, ph: Phase, plan: _Plan, trees: dict, ctx: dict, cdims: dict,
                           sctx: dict, ids: torch.Tensor, rnd: RoundInfo) -> dict:
        """The phase's optimizer steps on every client at once (``plan``: :meth:`_phase_plans`);
        returns the trees. No host synchronisation (the step counts are ``plan``'s)."""
        m = ids.shape[0]
        if ph.init is not None:
            trees = tree_clone(vmap(ph.init, in_dims=(0, cdims))(trees, ctx))
        names = self._trained_names(algo, ph, trees)
        opts = self._optimizers(algo, ph, names, rnd)
        if plan.steps == 0:
            return trees
        t = trees if plan.identity else tree_index(trees, plan.perm)
        t = {tn: dict(tree) for tn, tree in t.items()}  # leaves may be re-laid out below; the caller's dicts stay
        c = ctx if plan.identity else _permute(ctx, cdims, plan.perm)
        sc = sctx if plan.identity else tree_index(sctx, plan.perm)
        i = ids if plan.identity else ids[plan.perm]
        sample_ids = torch.gather(i.unsqueeze(1).expand(m, plan.steps, i.shape[1]), 2, plan.pos)  # [m, S, B]
        flat = [(tn, k) for tn in names for k in names[tn]]
        states = {tn: opts[tn].init({k: t[tn][k] for k in names[tn]}) for tn in names}  # stacked [m, ...]
        # the step number and the lr as device tensors (optim.Chain.step_): the same kernel arguments every step
        count = self._step_scalar("count", torch.int64).zero_()
        # the scale in the leaves' dtype: -lr rounded as the sequential path's Python float is (float64 runs)
        scales = {tn: self._step_scalar(f"scale/{tn}", _leaf_dtype(t[tn], names[tn])).fill_(opts[tn].final_scale)
                  for tn in names if opts[tn].final_scale is not None}
        objective = ph.loss or algo.local_loss
        loss_fn = vmap(objective, in_dims=(0, cdims, 0))
        project = vmap(ph.project) if ph.project is not None else None
        if self.fixed_shape:
            t = self._run_phase_fixed(algo, ph, plan, t, c, sc, sample_ids, names, opts, states, count, scales,
                                      loss_fn, project)
            return t if plan.identity else tree_index(t, plan.inverse)
        labels = self.data.labels
        for s in range(plan.steps):
            a = plan.n_active[s]
            sid = sample_ids[:a, s]
            batch = {"x": self.data.x(sid), "y": labels[sid], "w": plan.weights[:a, s]}
            batch.update(self._gather_sctx(sc, plan.pos[:a, s], a))
            if a > 1:
                # leaves sharing storage with the stack: in-place SGD and BatchNorm updates land in it
                rows = {tn: {k: (v[:a].detach().requires_grad_() if k in names.get(tn, ()) else v[:a])
                             for k, v in tree.items()} for tn, tree in t.items()}
                with self.autocast():
                    loss = loss_fn(rows, _rows(c, cdims, a), batch).sum()
                grads = _grad(algo, ph, loss, [rows[tn][k] for tn, k in flat])
            else:
                # one client left (the long tail of an unbalanced round): the plain, unbatched step
                one = {tn: {k: (v[0].detach().requires_grad_() if k in names.get(tn, ()) else v[0])
                            for k, v in tree.items()} for tn, tree in t.items()}
                with self.autocast():
                    loss = objective(one, _row0(c, cdims), {k: v[0] for k, v in batch.items()})
                grads = [g.unsqueeze(0) for g in _grad(algo, ph, loss, [one[tn][k] for tn, k in flat])]
                rows = {tn: {k: one[tn][k].unsqueeze(0) for k in names[tn]} for tn in names}
            g: dict[str, dict[str, torch.Tensor]] = {tn: {} for tn in names}
            for (tn, k), gk in zip(flat, grads):
                g[tn][k] = gk
                moved = _like_grad(t[tn][k], gk)
                if moved is not None:  # once per phase (and back for a lone tail client): see _like_grad
                    t[tn][k] = moved
                    rows[tn][k] = moved[: gk.shape[0]]
                    relayout_leaf_(states[tn], k, lambda b, gk=gk: _like_grad(b, gk))  # its buffers too
            count.add_(1)
            for tn in names:  # the active rows, in place (views of the stacks)
                opts[tn].step_({k: rows[tn][k] for k in names[tn]}, g[tn], state_rows(states[tn], a), count=count,
                               per_client=True, scale=scales.get(tn))
            if project is not None:
                with torch.no_grad():
                    view = {tn: {k: t[tn][k][:a] for k in t[tn]} for tn in t}
                    for tn, leaves in project(view).items():
                        for k, v in leaves.items():
                            t[tn][k][:a].copy_(v)
        t = {tn: {k: v.detach().contiguous() for k, v in tree.items()} for tn, tree in t.items()}  # laid back
        return t if plan.identity else tree_index(t, plan.inverse)

    # ----- fixed-shape steps and CUDA graphs (issue 32) --------------------------------------
    #: private switch: fixed-shape masked steps without CUDA graphs (tests, benchmarks); on
    #: whenever ``train.cuda_graphs`` is
    _fixed_shape_steps = False
    #: private switch: the static-step layer (buffers allocated once per run, graph cache) with
    #: the capture replaced by a plain call, on any device (the CPU tests of that layer)
    _static_steps = False

    @property
    def fixed_shape(self) -> bool:
        """Every local step runs all m rows of the stack with an ``active`` mask (see
        :meth:`_run_phase_fixed`): ``train.cuda_graphs``, or the private ``_fixed_shape_steps``."""
        return bool(getattr(self.train, "cuda_graphs", False)) or self._fixed_shape_steps or self._static_steps

    @property
    def static_steps(self) -> bool:
        """Steps run on per-run static buffers through :class:`_StaticStep` (captured as CUDA
        graphs on a CUDA device with ``train.cuda_graphs``; a plain call otherwise)."""
        return bool(getattr(self.train, "cuda_graphs", False)) or self._static_steps

    def _run_phase_fixed(self, algo: Algorithm, ph: Phase, plan: _Plan, t: dict, c: dict, sc: dict,
                         sample_ids: torch.Tensor, names: dict, opts: dict, states: dict, count: torch.Tensor,
                         scales: dict, loss_fn: Any, project: Any) -> dict:
        """The phase's steps with a fixed shape: every step runs all m rows (sorted order, as
        ``plan``) whatever the number of clients still training. ``active`` (bool [m]) is
        ``steps_k > s`` computed on the device from the step counter ``count`` (0-dim int64, no
        host read); a finished client's batch is its padded row (weights 0), its gradient is
        computed and discarded: its parameters, BatchNorm buffers and optimizer buffers are
        restored with ``torch.where`` after the step (a selection, so a NaN in a discarded row
        cannot leak; never a multiplication by the mask). The active rows see the arithmetic of
        the shrinking path (same batches, weights, counts and lr); only the batched kernels'
        sizes differ, i.e. fp32 summation order. Returns the trees (sorted rows), laid back
        contiguous, new tensors (never the static buffers)."""
        m, bs = sample_ids.shape[0], sample_ids.shape[2]
        flat = [(tn, k) for tn in names for k in names[tn]]
        buffers = set(algo.forward.buffers)
        # what a step may change in place: the trained leaves and the BatchNorm buffers of every tree
        mutable = {tn: [k for k in tree if k in names.get(tn, ()) or k in buffers] for tn, tree in t.items()}
        steps_sorted = plan.steps_dev[plan.perm]  # int64 [m], sorted order (device op)
        labels = self.data.labels

        def gather_sctx(s: int) -> dict:
            return self._gather_sctx(sc, plan.pos[:, s], m) if sc else {}

        st = None
        if self.static_steps:
            key = (algo.name, ph.name, m, bs)
            st = self.__dict__.setdefault("_static_cache", {}).get(key)
            if st is None:
                st = self._static_cache[key] = _StaticStep(key, self.data.device,
                                                           capture=self._capture_on_device())
            st.check_signature(_phase_signature(ph, opts, loss_fn))
            st.begin_phase()
            t, c, states = st.load("trees", t), st.load("ctx", c), st.load("states", states)
            sid = st.load("sid", sample_ids[:, 0])
            w = st.load("w", plan.weights[:, 0])
            active = st.load("active", steps_sorted > count)
            sbatch = st.load("sctx", gather_sctx(0))
        else:
            sid, w, active, sbatch = sample_ids[:, 0], plan.weights[:, 0], steps_sorted > count, gather_sctx(0)

        def step() -> None:
            batch = {"x": self.data.x(sid), "y": labels[sid], "w": w, **sbatch}
            self._masked_step(algo, ph, t, c, states, batch, active, names, flat, mutable, opts, count, scales,
                              loss_fn, project)

        for s in range(plan.steps):
            if st is None:
                if s:
                    sid, w, active, sbatch = sample_ids[:, s], plan.weights[:, s], steps_sorted > count, gather_sctx(s)
                step()
                continue
            if s:  # the step's inputs into the static buffers: device-to-device copies
                sid.copy_(sample_ids[:, s])
                w.copy_(plan.weights[:, s])
                torch.gt(steps_sorted, count, out=active)
                for k, v in gather_sctx(s).items():
                    sbatch[k].copy_(v)
            st.run(step, algo, ph, lambda: (st.save("trees", t), st.save("states", states)))
        return {tn: {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tree.items()}
                for tn, tree in t.items()}

    def _capture_on_device(self) -> bool:
        """Real CUDA-graph capture: ``train.cuda_graphs`` on a CUDA device (else a plain call)."""
        return bool(getattr(self.train, "cuda_graphs", False)) and torch.device(self.data.device).type == "cuda"

    def _masked_step(self, algo: Algorithm, ph: Phase, t: dict, c: dict, states: dict, batch: dict,
                     active: torch.Tensor, names: dict, flat: list, mutable: dict, opts: dict, count: torch.Tensor,
                     scales: dict, loss_fn: Any, project: Any) -> None:
        """One fixed-shape step on all m rows of the stacks ``t`` (in place): forward, one
        ``autograd.grad`` of the summed loss, the optimizer on every row, the projection, then
        the rows where ``active`` (bool [m]) is False put back as they were before the step
        (``torch.where``: parameters, BatchNorm buffers, optimizer buffers). Increments
        ``count``. Device ops only: what a CUDA graph captures."""
        m = active.shape[0]

        def keep(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        def select_(dst: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
            # dst <- new on the active rows, old on the others (a selection: NaN-safe)
            dst.copy_(torch.where(active.view(m, *([1] * (dst.dim() - 1))), new, old))

        before = {tn: {k: keep(t[tn][k]) for k in ks} for tn, ks in mutable.items()}
        before_states = {tn: [{slot: {k: keep(b) for k, b in bufs.items()} for slot, bufs in s.items()}
                              for s in states[tn]] for tn in names}
        rows = {tn: {k: (v.detach().requires_grad_() if k in names.get(tn, ()) else v) for k, v in tree.items()}
                for tn, tree in t.items()}
        # a captured step cannot use autocast's cache of casts (torch.cuda.graph's notes): off there
        amp = (torch.autocast(self.data.device.type, dtype=torch.bfloat16, cache_enabled=False)
               if self.train.precision == "bf16" and self.static_steps else self.autocast())
        with amp:
            loss = loss_fn(rows, c, batch).sum()
        grads = _grad(algo, ph, loss, [rows[tn][k] for tn, k in flat])
        g: dict[str, dict[str, torch.Tensor]] = {tn: {} for tn in names}
        for (tn, k), gk in zip(flat, grads):
            g[tn][k] = gk
            moved = _like_grad(t[tn][k], gk)
            if moved is not None:  # once per run on the static buffers (see _StaticStep.save), once per phase else
                t[tn][k] = moved
                rows[tn][k] = moved
                relayout_leaf_(states[tn], k, lambda b, gk=gk: _like_grad(b, gk))
        count.add_(1)
        for tn in names:
            opts[tn].step_({k: rows[tn][k] for k in names[tn]}, g[tn], states[tn], count=count, per_client=True,
                           scale=scales.get(tn))
        if project is not None:
            with torch.no_grad():
                for tn, leaves in project({tn: dict(tree) for tn, tree in t.items()}).items():
                    for k, v in leaves.items():
                        if k in mutable.get(tn, ()):
                            t[tn][k].copy_(v)  # finished rows restored below
                        else:
                            select_(t[tn][k], v, t[tn][k])

        with torch.no_grad():
            for tn, ks in mutable.items():
                for k in ks:
                    select_(t[tn][k], t[tn][k], before[tn][k])
            for tn in names:
                for s, old in zip(states[tn], before_states[tn]):
                    for slot, bufs in s.items():
                        for k, b in bufs.items():
                            select_(b, b, old[slot][k])

    def _chunks(self, m: int) -> list[slice]:
        """Consecutive row ranges of at most ``train.stack_clients`` rows (one range when unset)."""
        size = getattr(self.train, "stack_clients", None) or max(m, 1)
        return [slice(a, min(a + size, m)) for a in range(0, m, size)] or [slice(0, 0)]

    def train_clients(self, algo: Algorithm, down: Download, states: dict[str, Any], clients: np.ndarray,
                      rnd: RoundInfo, seeds: list[int] | None = None, row_context: dict[str, Any] | None = None
                      ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """As :meth:`SequentialExecutor.train_clients`, the m clients vmapped together, or in
        consecutive chunks of ``train.stack_clients`` clients (each chunk one vmapped program;
        a client's batch plans depend on (seed, round, client) only, so chunking changes no
        draw, only which rows share a batched kernel). Returns stacked ``(eval models, uploads,
        new states)`` with leading dim m, rows in ``clients`` order.

        Stacked seeds (:mod:`medpfl.fl.seed_stack`) give every row its own run seed (``seeds``,
        m ints: the seed of its batch plans) and, in place of ``algo.shared_context`` of the
        shared download, ``row_context``: that context computed per seed and laid out per row
        (leading dim m, vmapped with ``in_dims=0``); ``down`` then has no shared part."""
        chunks = self._chunks(len(clients))
        seeds = self._row_seeds(seeds, len(clients))
        if len(chunks) == 1:
            return self._train_stacked(algo, down, states, clients, rnd, seeds, row_context)
        outs = []
        for sl in chunks:
            rows = torch.arange(sl.start, sl.stop, device=self.data.device)
            sub = Download(shared=down.shared, per_client=tree_index(down.per_client, rows), to_all=down.to_all,
                           synced=down.synced)
            outs.append(self._train_stacked(algo, sub, tree_index(states, rows), clients[sl], rnd, seeds[sl],
                                            None if row_context is None else tree_index(row_context, rows)))
        return tuple(_tree_cat([o[i] for o in outs]) for i in range(3))

    def _train_stacked(self, algo: Algorithm, down: Download, states: dict[str, Any], clients: np.ndarray,
                       rnd: RoundInfo, seeds: list[int] | None = None, row_context: dict[str, Any] | None = None
                       ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        data, dev = self.data, self.data.device
        cl = [int(c) for c in clients]
        m = len(cl)
        seeds = self._row_seeds(seeds, m)
        groups = [data.client_train[c] for c in cl]
        sizes = [len(g) for g in groups]
        cid = torch.as_tensor(cl, device=dev)  # the round's one copy of its trainers' ids
        hist = data.train_hist[cid]
        # a client's train size is the sum of its label histogram (single-label data; float32 counts,
        # exact below 2**24): read on the device, not copied from the host sizes
        info: dict[str, Any] = {"client": cid, "num_samples": hist.sum(-1), "label_hist": hist}
        received = down.received()
        trees, cctx = vmap(algo.begin, in_dims=(down.received_dims(), 0, 0, None))(received, states, info, rnd)
        trees = tree_clone(trees)
        # stacked seeds: each seed's shared context, laid out per row (in_dims 0)
        shared_ctx = algo.shared_context(down.shared_received(), rnd) if row_context is None else row_context
        clash = set(shared_ctx) & set(cctx)
        if clash:
            raise ValueError(f"method {algo.name!r}: context keys {sorted(clash)} are both shared and per-client")
        ctx = {**shared_ctx, **cctx}
        shared_dim = None if row_context is None else 0
        cdims: dict[str, Any] = {**{k: shared_dim for k in shared_ctx}, **{k: 0 for k in cctx}}
        ids, _ = _pad_ids(groups)
        passes = algo.passes(rnd)
        for p in passes:
            if p.when == "before":
                ctx[p.name] = self._run_pass_stacked(algo, p, trees, ctx, cdims, ids, sizes, cl, rnd, seeds)
                cdims[p.name] = 0
        sctx = self._sample_context_stacked(algo, ctx, cdims, ids)
        phases = algo.phases(rnd)
        self._check_phases(algo, phases)
        plans = self._phase_plans(algo, phases, ctx, cdims, sizes, cl, rnd, seeds)
        with local_steps():
            for ph, plan in zip(phases, plans):
                trees = self._run_phase_stacked(algo, ph, plan, trees, ctx, cdims, sctx, ids, rnd)
        info["steps"] = {ph.name: plan.steps_dev for ph, plan in zip(phases, plans)}
        for p in passes:
            if p.when == "after":
                info[p.name] = self._run_pass_stacked(algo, p, trees, ctx, cdims, ids, sizes, cl, rnd, seeds)
        uploads, new_states, models = vmap(algo.finish, in_dims=(0, cdims, 0, 0, None))(trees, ctx, states, info, rnd)
        return models, uploads, new_states

    def adapt_models(self, algo: Algorithm, phases: list[Phase], models: Any, clients: np.ndarray,
                     rnd: RoundInfo) -> Any:
        """As :meth:`SequentialExecutor.adapt_models`, all m clients as one vmapped program (or
        one per chunk of ``train.stack_clients``)."""
        chunks = self._chunks(len(clients))
        if len(chunks) == 1:
            return self._adapt_stacked(algo, phases, models, clients, rnd)
        dev = self.data.device
        return _tree_cat([self._adapt_stacked(algo, phases, tree_index(models, torch.arange(sl.start, sl.stop, device=dev)),
                                              clients[sl], rnd) for sl in chunks])

    def _adapt_stacked(self, algo: Algorithm, phases: list[Phase], models: Any, clients: np.ndarray,
                       rnd: RoundInfo) -> Any:
        self._check_phases(algo, phases)
        cl = [int(c) for c in clients]
        groups = [self.data.client_train[c] for c in cl]
        ids, _ = _pad_ids(groups)
        trees = {"model": tree_clone(models)}
        plans = self._phase_plans(algo, phases, {}, {}, [len(g) for g in groups], cl, rnd)
        with local_steps():
            for ph, plan in zip(phases, plans):
                trees = self._run_phase_stacked(algo, ph, plan, trees, {}, {}, {}, ids, rnd)
        return trees["model"]

    @torch.no_grad()
    def evaluate_models(self, algo: Algorithm, models: Any, groups: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model j on ``groups[j]``, all models at once (or in chunks of ``train.stack_clients``
        models), ``eval_batch_size`` samples per forward in all; with ``eval.memory_fraction``,
        as many models and samples per forward as fit in that fraction of the free memory
        (:class:`medpfl.fl.memory.EvalSizer`; ``train.stack_clients`` then does not apply).
        Returns ``(correct [m, C], count [m, C], loss_sum [m])`` (float64)."""
        m = len(groups)
        if self.eval_sizer.by_memory:
            mc, per = self.eval_sizer.stacked(algo.predict, models, self.data.x, groups)
            chunks = [slice(a, min(a + mc, m)) for a in range(0, m, mc)] or [slice(0, 0)]
        else:
            chunks, per = self._chunks(m), None
        if len(chunks) == 1:
            return self._evaluate_stacked(algo, models, groups, per)
        dev = self.data.device
        outs = [self._evaluate_stacked(algo, tree_index(models, torch.arange(sl.start, sl.stop, device=dev)),
                                       groups[sl], per) for sl in chunks]
        return tuple(torch.cat([o[i] for o in outs]) for i in range(3))

    @torch.no_grad()
    def _evaluate_stacked(self, algo: Algorithm, models: Any, groups: list[torch.Tensor], chunk: int | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The m models of ``models`` on ``groups``, ``chunk`` samples per model per forward
        (None: ``eval_batch_size // m``)."""
        data, c = self.data, self.data.num_classes
        m = len(groups)
        ids, valid = _pad_ids(groups)
        fwd = vmap(algo.predict)
        correct = torch.zeros(m, c, dtype=torch.float64, device=data.device)
        count = torch.zeros_like(correct)
        loss = torch.zeros(m, dtype=torch.float64, device=data.device)
        chunk = chunk or max(1, self.eval_batch_size // m)
        rows = torch.arange(m, device=data.device).unsqueeze(1)
        for s in range(0, ids.shape[1], chunk):
            b, ok = ids[:, s:s + chunk], valid[:, s:s + chunk].to(torch.float64)
            y = data.labels[b]
            logits = fwd(models, data.x(b))
            hit = (logits.argmax(-1) == y).to(torch.float64) * ok
            key = (rows * c + y).reshape(-1)
            count.view(-1).index_add_(0, key, ok.reshape(-1))
            correct.view(-1).index_add_(0, key, hit.reshape(-1))
            ce = F.cross_entropy(logits.reshape(-1, c).float(), y.reshape(-1), reduction="none").view_as(ok)
            loss += (ce.to(torch.float64) * ok).sum(1)
        return correct, count, loss

    def personalized_models(self, algo: Algorithm, states: dict[str, Any], server: dict[str, Any]) -> Any:
        if not tree_leaves(states):  # no per-client state (e.g. Per-FedAvg: the global model, adapted at evaluation)
            k = self.data.num_clients
            one = algo.personalized_model(states, server)
            return tree_map(lambda t: t.unsqueeze(0).expand(k, *t.shape).clone(), one)
        return tree_clone(vmap(algo.personalized_model, in_dims=(0, None))(states, server))
