"""Evaluation batched by memory (``eval.memory_fraction``; issue 32).

By default every evaluation forward takes ``eval.batch_size`` samples (on the stacked executor:
spread over the models evaluated together, in chunks of ``train.stack_clients`` models). With
``eval.memory_fraction: f`` the evaluation of the global model and of the personalized models
takes as many samples per forward, and as many models per vmapped forward, as fit in ``f`` times
the device's free memory at that moment: on a GPU, hundreds of clients' personalized models are
scored in a few large forwards instead of many 1024-sample ones.

What a forward needs is measured once per run and model, from three probe forwards of the run's
own models (:func:`probe_cost`), as the affine model ``bytes(m, n) = base + per_model * m +
per_sample * n`` for ``m`` models and ``n`` samples in all (``per_model``: what vmapping over the
models adds, e.g. a grouped convolution's stacked weights; ``per_sample``: the activations). The
peak is read from the CUDA allocator on a GPU (``torch.cuda.max_memory_allocated``) and, elsewhere,
from the storages that the forward's operators create and keep alive (:class:`LiveBytes`). Free
memory is ``torch.cuda.mem_get_info`` on a GPU and the host's available memory
(``psutil.virtual_memory().available``) on a CPU.

Only how samples are grouped into forwards changes: the counts (correct, count per class) are
those of fixed batches, and the loss sums (float64 sums of float32 per-sample losses) agree
within float tolerance (a kernel may pick another algorithm for another batch size;
``tests/test_eval_memory.py``). Passes and per-sample contexts, which are part of training, keep
``eval.batch_size``."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

#: samples per probe forward (the smaller of the two per-sample probes)
PROBE_SAMPLES = 16


def free_bytes(device: torch.device | str) -> int:
    """Free memory on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA (free device
    memory, other processes' allocations excluded), the host's available memory
    (``psutil.virtual_memory().available``) otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    import psutil

    return int(psutil.virtual_memory().available)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created by the operators run under this mode and alive at
    the same time (``peak``; ``live`` now). A storage is counted once, at its size
    (``untyped_storage().nbytes()``), when an operator first returns a tensor on it, and released
    when every tensor an operator returned on it is freed (views share their base's storage).
    Inputs that existed before the mode are not counted. Device-independent: a CPU stand-in for
    the CUDA allocator's peak (it does not see allocator rounding or library workspaces)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage key -> [nbytes, number of live tensors]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0:  # an empty storage
                continue
            entry = self._refs.get(key)
            if entry is None:
                entry = self._refs[key] = [st.nbytes(), 0]
                self.live += entry[0]
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        return out


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak bytes that ``fn()`` allocates above what was allocated before it, its output
    included: the CUDA allocator's peak on CUDA, :class:`LiveBytes` elsewhere."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del out
        return int(peak)
    with LiveBytes() as mode:
        out = fn()
        peak = mode.peak
        del out
    return int(peak)


@dataclass(frozen=True)
class ForwardCost:
    """Bytes of an evaluation forward of ``m`` models on ``n`` samples in all:
    ``base + per_model * m + per_sample * n`` (each >= 0)."""

    base: float
    per_model: float
    per_sample: float

    def bytes(self, m: int, n: int) -> float:
        """The modelled bytes of one forward of ``m`` models on ``n`` samples in all."""
        return self.base + self.per_model * m + self.per_sample * n

    def plan(self, budget: float, m: int, longest: int) -> tuple[int, int]:
        """``(models per forward, samples per model per forward)`` for ``m`` models whose largest
        index set has ``longest`` samples, within ``budget`` bytes: of the pairs that fit, the
        one with the fewest forwards, ``ceil(m / models) * ceil(longest / samples)`` (the most
        models among equals), samples per model at most ``longest``. At least ``(1, 1)`` (a
        budget below one model on one sample gets the smallest forward there is)."""
        m, longest = max(1, m), max(1, longest)
        room = budget - self.base
        best = (math.inf, 1, 1)
        for mc in range(1, m + 1):
            per = room - self.per_model * mc
            if mc > 1 and per < self.per_sample * mc:  # not one sample each: more models fit no better
                break
            n = longest if self.per_sample <= 0 else max(1, min(longest, int(per // (self.per_sample * mc))))
            forwards = -(-m // mc) * -(-longest // n)
            if forwards <= best[0]:
                best = (forwards, mc, n)
        return best[1], best[2]


def probe_cost(forward: Callable[[Any, torch.Tensor], torch.Tensor], models: Any, x: Callable[[torch.Tensor], torch.Tensor],
               ids: torch.Tensor, device: torch.device | str) -> ForwardCost:
    """The :class:`ForwardCost` of ``forward(models_rows, x(sample ids))`` (a vmapped predict:
    models stacked [r, ...], inputs [r, s, ...], the input's own bytes included) from three probe
    forwards on ``ids`` (int64 sample ids, cycled where fewer than needed), with
    ``P = PROBE_SAMPLES``: 2 models on P samples each (peak ``a``), 2 models on 2P each (``b``),
    4 models on P each (``c``; rows of ``models`` cycled where it has fewer):
    ``per_sample = (b - a) / 2P``, ``per_model = (c - b) / 2`` (the models' own bytes included: the
    probe copies its rows as a chunked evaluation does), ``base = a - 2 per_model -
    2P per_sample``, each clamped at 0. Every probe stacks at least 2 models: a vmapped forward of
    one model may take another kernel (a plain convolution, not a grouped one) with smaller
    activations, so one model costs at most what the model says. Raises ValueError on an empty
    ``ids``."""
    if ids.numel() == 0:
        raise ValueError("probe_cost: no samples to probe with")
    p = PROBE_SAMPLES
    pick = ids[torch.arange(4 * p, device=ids.device) % ids.numel()]
    have = tree_leaves(models)[0].shape[0]
    rows = torch.arange(4, device=ids.device) % have

    def run(r: int, per: int) -> Callable[[], Any]:
        s = pick[:r * per].view(r, per)
        # the rows' copy inside the measured call: an evaluation in chunks copies each chunk's models
        return lambda: forward(tree_map(lambda t: t.index_select(0, rows[:r]), models), x(s))

    a = measure_peak_bytes(run(2, p), device)
    b = measure_peak_bytes(run(2, 2 * p), device)
    c = measure_peak_bytes(run(4, p), device)
    per_sample = max(0.0, (b - a) / (2 * p))
    per_model = max(0.0, (c - b) / 2)
    base = max(0.0, a - 2 * per_model - 2 * p * per_sample)
    return ForwardCost(base, per_model, per_sample)


def budget_bytes(device: torch.device | str, fraction: float) -> float:
    """``fraction`` of :func:`free_bytes` on ``device``."""
    return fraction * free_bytes(device)


class EvalSizer:
    """How an executor groups its evaluation samples into forwards.

    ``memory_fraction`` None: ``batch_size`` samples per forward (the default). Else: as many as
    fit in ``memory_fraction`` of :func:`free_bytes` at the call, by the run's
    :class:`ForwardCost`, probed once per method (``predict``) with the first models evaluated.
    ``last``: the latest choice, ``(models per forward, samples per model per forward, budget
    bytes)``, for logs and benchmarks."""

    def __init__(self, batch_size: int, memory_fraction: float | None, device: torch.device | str):
        self.batch_size = int(batch_size)
        self.memory_fraction = memory_fraction
        self.device = torch.device(device)
        self._costs: dict[int, ForwardCost] = {}
        self.last: tuple[int, int, float] | None = None

    @property
    def by_memory(self) -> bool:
        return self.memory_fraction is not None

    def cost(self, predict: Callable, models: Any | Callable[[], Any], x: Callable, ids: torch.Tensor) -> ForwardCost:
        """The cached :class:`ForwardCost` of ``vmap(predict)``, probed on first use with
        ``models`` (stacked; or a callable that returns them, called only then)."""
        key = id(predict.__self__) if hasattr(predict, "__self__") else id(predict)
        if key not in self._costs:
            rows = models() if callable(models) else models
            self._costs[key] = probe_cost(torch.vmap(predict), rows, x, ids, self.device)
        return self._costs[key]

    def one(self, predict: Callable, params: Any, x: Callable, groups: list[torch.Tensor]) -> int:
        """Samples per forward of one model (``params``, unstacked) on the index sets ``groups``
        (int64 tensors, evaluated together): ``batch_size`` without a fraction or samples."""
        n_all = sum(len(g) for g in groups)
        if not self.by_memory or n_all == 0:
            return self.batch_size
        probe = next(g for g in groups if len(g))
        cost = self.cost(predict, lambda: tree_map(lambda t: t.unsqueeze(0), params), x, probe)
        budget = budget_bytes(self.device, self.memory_fraction)
        _, n = cost.plan(budget, 1, n_all)
        self.last = (1, n, budget)
        return n

    def stacked(self, predict: Callable, models: Any, x: Callable, groups: list[torch.Tensor]) -> tuple[int, int]:
        """``(models per forward, samples per model per forward)`` for the stacked ``models``
        (leading dim m = ``len(groups)``) on their index sets ``groups``."""
        m = len(groups)
        longest = max((len(g) for g in groups), default=0)
        if not self.by_memory:
            return m, max(1, self.batch_size // max(m, 1))
        nonempty = [g for g in groups if len(g)]
        if not nonempty:
            return max(m, 1), 1
        cost = self.cost(predict, models, x, nonempty[0])
        budget = budget_bytes(self.device, self.memory_fraction)
        mc, n = cost.plan(budget, m, longest)
        self.last = (mc, n, budget)
        return mc, n
