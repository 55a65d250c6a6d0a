"""The static-step layer of ``train.cuda_graphs`` (issue 32): per-run buffers for the stacked
executor's fixed-shape local steps, and their capture as CUDA graphs.

The step itself (forward, ``autograd.grad``, optimizer, the ``torch.where`` restore of finished
clients) is :meth:`medpfl.fl.stacked.StackedExecutor._masked_step`; this module only keeps the
tensors it reads in memory that lives for the run (:class:`_StaticStep`), warms up, captures
with :func:`torch.cuda.graph` and replays. Without CUDA the capture is replaced by a plain call
(:class:`_PlainCall`), so the buffers, copies and cache run and are tested on the CPU.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from medpfl.algorithms.base import Algorithm
    from medpfl.fl.program import Phase

log = logging.getLogger(__name__)


def _numbers(fn: Any, depth: int = 2) -> tuple:
    """The Python numbers and strings a callable closes over (its closure cells, a partial's
    arguments, a bound method's ``__self__`` is not walked), ``depth`` levels into nested callables."""
    out: list = []
    if fn is None or depth < 0:
        return ()
    if isinstance(fn, functools.partial):
        vals = [*fn.args, *fn.keywords.values()]
        fn = fn.func
    else:
        vals = []
    fn = getattr(fn, "__func__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            vals.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for v in vals:
        if isinstance(v, (bool, int, float, str)):
            out.append(v)
        elif callable(v) and not isinstance(v, torch.Tensor):
            out.append(_numbers(v, depth - 1))
    return tuple(out)


def _phase_signature(ph: Phase, opts: dict, loss_fn: Any) -> tuple:
    """What a captured step bakes in as Python numbers, beyond the buffers it reads: the phase's
    optimizer chains less their final scale (``-lr`` is a device scalar, written every phase) and
    the numbers in the closures of its objective, projection and vmapped loss. A change (a
    round-dependent coefficient in a closure) makes :class:`_StaticStep` capture again. Numbers a
    method reads from its own attributes are not seen: such a number must reach the objective
    through the context (a tensor) when it changes between rounds."""
    chains = tuple((tn, str(c.transforms[:-1] if c.final_scale is not None else c.transforms))
                   for tn, c in sorted(opts.items()))
    return chains, _numbers(ph.loss), _numbers(ph.project), _numbers(loss_fn)


class _PlainCall:
    """The stand-in for a captured graph where there is no capture (CPU, tests): ``replay()``
    calls the step."""

    def __init__(self, step: Any):
        self.step = step

    def replay(self) -> None:
        self.step()


class _StaticStep:
    """One static local step of the stacked executor with fixed shapes, for one key (method,
    phase, m clients, batch size B), kept by the executor for the whole run: the tensors a step
    reads and writes live in buffers allocated on first use and reused every round.

    Buffers (``store``, by path): the stacked trees ``[m, ...]`` and optimizer buffers (copied in
    at the start of each phase by :meth:`load`, copied out at its end by the caller), the
    per-client and shared context, and the step's inputs: the sample ids int64 [m, B], the
    per-sample weights float32 [m, B], the ``active`` mask bool [m] and the gathered per-sample
    context [m, B, ...] (device-to-device copies before each step). ``allocations`` counts the
    buffers allocated (a shape, dtype or device change reallocates and drops the graph).

    :meth:`run` runs one real step: the first ``warmup`` steps of the run eagerly (on a side
    stream on CUDA, as :func:`torch.cuda.graph` requires; a leaf re-laid out to its gradient's
    strides there is registered back with :meth:`save`), then captures the step once
    (``torch.cuda.graph``: forward, ``autograd.grad``, optimizer, selection) and replays it for
    this and every later step, in every later round. ``capture=False``: the capture is replaced
    by :class:`_PlainCall` (the same buffers, copies and cache; what the CPU tests exercise).
    A step that cannot be captured (a host read or a dynamic shape in the method's objective)
    raises ValueError naming the method, the phase and ``train.cuda_graphs``.
    """

    def __init__(self, key: tuple, device: torch.device, capture: bool, warmup: int = 2):
        self.key = key
        self.device = torch.device(device)
        self.capture = capture
        self.warmup = warmup
        self.store: dict[tuple, torch.Tensor] = {}
        self.allocations = 0
        self.warmed = 0
        self.graph: Any = None
        self.loaded: set[tuple] = set()  # the buffer paths loaded in the current phase
        self.graph_paths: frozenset[tuple] = frozenset()  # ... when the graph was captured

    def begin_phase(self) -> None:
        """Start a phase's loads (:meth:`load`); a graph captured over other buffer paths (a tree
        or context entry that came or went) is dropped at the next :meth:`run`."""
        self.loaded = set()

    def load(self, name: str, tree: Any) -> Any:
        """``tree`` (nested dicts / lists of tensors) copied into this step's buffers under
        ``name``; returns the same structure holding the buffers. Non-tensor leaves pass through."""
        return self._into((name,), tree)

    def _into(self, path: tuple, x: Any) -> Any:
        if isinstance(x, dict):
            return {k: self._into(path + (k,), v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._into(path + (i,), v) for i, v in enumerate(x))
        if not isinstance(x, torch.Tensor):
            return x
        self.loaded.add(path)
        buf = self.store.get(path)
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype or buf.device != x.device:
            buf = self.store[path] = torch.empty_like(x)
            self.allocations += 1
            self.graph, self.warmed = None, 0  # a captured graph reads the old buffers
        buf.copy_(x)
        return buf

    def check_signature(self, signature: tuple) -> None:
        """Drop the graph (the next steps warm up and capture again) when the Python numbers the
        step bakes in changed since it was captured (:func:`_phase_signature`)."""
        if signature != getattr(self, "signature", signature) and self.graph is not None:
            log.info("train.cuda_graphs: %s: the phase's constants changed; capturing its step again", self.key)
            self.graph, self.warmed = None, 0
        self.signature = signature

    def save(self, name: str, tree: Any, path: tuple | None = None) -> None:
        """Register the tensors of ``tree`` as the buffers under ``name`` (after a warm-up step
        replaced a leaf by a re-laid-out copy, :func:`_like_grad`)."""
        path = (name,) if path is None else path
        if isinstance(tree, dict):
            for k, v in tree.items():
                self.save(name, v, path + (k,))
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                self.save(name, v, path + (i,))
        elif isinstance(tree, torch.Tensor):
            self.store[path] = tree

    def run(self, step: Any, algo: Algorithm, ph: Phase, after_eager: Any) -> None:
        """One real step: eager (warm-up; then ``after_eager()``), or a replay of the graph,
        captured first if need be."""
        if self.graph is not None and self.loaded != self.graph_paths:
            self.graph, self.warmed = None, 0
        if self.graph is None and self.warmed < self.warmup:
            if self.capture:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream(self.device).wait_stream(side)
            else:
                step()
            self.warmed += 1
            after_eager()
            return
        if self.graph is None:
            self.graph = self._capture(step, algo, ph) if self.capture else _PlainCall(step)
            self.graph_paths = frozenset(self.loaded)
        self.graph.replay()

    def _capture(self, step: Any, algo: Algorithm, ph: Phase) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except RuntimeError as e:
            raise ValueError(f"train.cuda_graphs: method {algo.name!r}, phase {ph.name!r}: its local step cannot be "
                             f"captured as a CUDA graph ({e}); a host read or a shape that depends on values in its "
                             "objective cannot be captured: set train.cuda_graphs: false for this method") from e
        return graph
