"""What a method declares about a round, and the batch plans the executors draw from it.

A client's round is a small *program* run by the executor, identically in the sequential and
the stacked executor (:mod:`medpfl.fl.executors`, :mod:`medpfl.fl.stacked`):

1. ``begin``: the client's trainable trees and its context, from what it received and its state;
2. passes ``when="before"``: sums over the local train set (e.g. class prototypes), into the context;
3. ``sample_context``: per-sample tensors over the local train set (e.g. a teacher's logits);
4. the phases, in order: optimizer steps on some trainable trees (:class:`Phase`, :mod:`medpfl.fl.optim`);
5. passes ``when="after"``: sums over the local train set (train accuracy, Fisher information);
6. ``finish``: the upload, the client's new state and the model its local test split scores.

Everything here is declarative: a :class:`Phase` names the trees and the parts of them that it
trains, its objective and its schedule; the executors own the loop, the optimizer, the data
and the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch

from medpfl.fl.optim import OptimizerSpec, RunOptimizer
from medpfl.fl.sampling import derive_seed

#: a selector of the leaves of a tree that a phase trains: None = every floating-point leaf
#: that is not a model buffer; "body" / "head" = that named part of the model; a tuple = names
Selector = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Federation:
    """What a method's set-up hooks (``init_server``, ``init_client_state``) may read about the
    federation, fixed for the run: num_clients K; num_samples: each client's local train size
    (K ints, client order; empty where a caller does not know them, e.g. a unit test of one
    hook); num_classes C (None where unknown). Passed to the hooks so that a method never keeps
    run facts on ``self`` between hooks."""

    num_clients: int
    num_samples: tuple[int, ...] = ()
    num_classes: int | None = None

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"Federation: num_clients must be >= 1, got {self.num_clients}")
        if self.num_samples and len(self.num_samples) != self.num_clients:
            raise ValueError(f"Federation: {len(self.num_samples)} sample counts for {self.num_clients} clients")


@dataclass(frozen=True)
class RoundInfo:
    """What every hook may read about the current round (shared by all clients).

    round: 0-based round index; rounds: total rounds of the run; lr: the round's learning rate
    (``train.optimizer.lr * lr_decay**round``); base_lr: ``train.optimizer.lr`` (so a method can
    decay a learning rate of its own the same way: ``own_lr * lr / base_lr``); num_clients: K;
    seed: the run's training seed; batch_size: ``train.batch_size`` (a phase taking several
    batches per step, e.g. Per-FedAvg's two, sizes its own from it).
    """

    round: int
    rounds: int
    lr: float
    num_clients: int
    seed: int = 0
    base_lr: float | None = None
    batch_size: int | None = None

    @property
    def decay(self) -> float:
        """``lr / base_lr`` (1 when base_lr is unknown)."""
        return self.lr / self.base_lr if self.base_lr else 1.0


@dataclass(frozen=True)
class Until:
    """Train epoch after epoch until the std of the last ``window`` epoch losses (the loss of
    each epoch's last batch) is below ``threshold``, at most ``max_epochs`` epochs (FedALA's
    first adaptive local aggregation, Zhang et al. AAAI 2023 Sec. 3.3). Sequential executor only."""

    window: int
    threshold: float
    max_epochs: int


@dataclass(frozen=True)
class Phase:
    """One stage of a client's local program: optimizer steps on named trainable trees over its
    local train set.

    name: unique within the program; it keys the batch order (the first phase named ``train``
      draws the same batches as before phases existed) and ``info["steps"][name]``.
    trainable: ``{tree name: selector}``; only these leaves get gradients and optimizer steps
      (momentum, weight decay); every other leaf is a constant of the phase (FedBABU's frozen
      head, LoRA's frozen backbone).
    loss: ``loss(trees, ctx, batch) -> scalar``; None: the method's ``local_loss``.
    epochs: local epochs (None: ``train.local_epochs``), or ``fn(ctx) -> int64 scalar`` per
      client (0 skips the phase for that client, e.g. a stage that needs a previous visit).
    steps: if set, exactly this many mini-batches (the epochs' batches truncated or repeated).
    batch_size: None = ``train.batch_size``.
    optimizer: the step of every tree it trains (:mod:`medpfl.fl.optim`): a
      :class:`~medpfl.fl.optim.RunOptimizer` (the run's ``train.optimizer`` with this phase's lr,
      lr_scale, momentum, weight_decay, max_grad_norm; default: the run's, at the round's lr),
      an explicit chain (``sgd(lr)``: plain SGD whatever the run's optimizer), or ``{tree:
      either}`` per trained tree (a tree not named: ``RunOptimizer()``). Buffers (momentum,
      Adam's moments) start at zero in every phase; each tree's chain has its own.
    subset: train on a contiguous window of ``int(subset * n)`` of the local train set at a
      seeded random offset (FedALA's ``rand_percent``); shuffle: reshuffle every epoch (else in order).
    init: ``fn(trees, ctx) -> trees`` applied before the phase (e.g. start the personal copy
      from the trained global one); the executor copies the result, so aliasing is harmless.
    project: ``fn(trees) -> {tree: {leaf: tensor}}`` applied after every step to the trained
      leaves it returns (e.g. clamp FedALA's weights to [0, 1]).
    until: an early-stopping rule over epochs (:class:`Until`), or ``fn(ctx) -> bool`` choosing
      per client whether the rule applies (else ``epochs`` epochs). Sequential executor only.
    """

    name: str = "train"
    trainable: Mapping[str, Selector] = field(default_factory=lambda: {"model": None})
    loss: Callable[..., torch.Tensor] | None = None
    epochs: int | Callable[[dict], torch.Tensor] | None = None
    steps: int | None = None
    batch_size: int | None = None
    optimizer: OptimizerSpec | Mapping[str, OptimizerSpec] = RunOptimizer()
    subset: float = 1.0
    shuffle: bool = True
    init: Callable[[dict, dict], dict] | None = None
    project: Callable[[dict], dict] | None = None
    until: Until | None = None
    until_applies: Callable[[dict], torch.Tensor] | None = None


@dataclass(frozen=True)
class Pass:
    """A sum over the client's local train set with its current trees (no parameter update).

    fn: ``fn(trees, ctx, batch) -> dict[str, Tensor]``; the executor sums the returned tensors
      over the batches. ``batch`` holds ``x`` (float [B, C, H, W]), ``y`` (int64 [B]) and ``w``
      (float [B]: 1/b on the b real samples of the batch, 0 on padding): use ``w`` (or ``w > 0``)
      so that padded samples add nothing. ``fn`` may differentiate (``torch.func.grad``), e.g.
      a Fisher diagonal from squared mini-batch gradients.
    when: "before" puts the sums into ``ctx[name]`` before the phases; "after" into ``info[name]``
      for ``finish``.
    batch_size: None = the evaluation batch size (then the sums must not depend on it), "train" =
      ``train.batch_size`` (e.g. a Fisher diagonal from mini-batch gradients); max_samples: only the first batches, until
      more than this many samples were seen (FedCurv's Fisher sample size); shuffle: a seeded
      order (as a shuffled DataLoader), else the stored order.
    """

    name: str
    fn: Callable[..., dict[str, torch.Tensor]]
    when: Literal["before", "after"] = "after"
    batch_size: int | Literal["train"] | None = None
    max_samples: int | None = None
    shuffle: bool = False


@dataclass
class Download:
    """What the server sends this round. ``shared``: the same to every recipient (vmap in_dims
    None); ``per_client``: one row per sampled client (leading dim m, in schedule order).
    ``to_all``: the shared part is broadcast to all K clients, not just the sampled ones (a method
    whose clients must stay in sync, e.g. by applying the same compressed update), and is counted
    K times in ``bytes_down``. ``synced``: what every client already holds because it received
    every earlier ``to_all`` broadcast (e.g. the previous global model the update applies to);
    handed to the clients like ``shared`` but not sent again, so not counted (only with ``to_all``)."""

    shared: dict[str, Any] = field(default_factory=dict)
    per_client: dict[str, Any] = field(default_factory=dict)
    to_all: bool = False
    synced: dict[str, Any] = field(default_factory=dict)

    def received_dims(self) -> dict[str, Any]:
        """vmap in_dims of :meth:`received`."""
        return {**{k: None for k in self.shared}, **{k: None for k in self.synced}, **{k: 0 for k in self.per_client}}

    def received(self) -> dict[str, Any]:
        """``{**shared, **synced, **per_client}``; raises ValueError on a key in two parts or
        ``synced`` without ``to_all``."""
        keys = [*self.shared, *self.synced, *self.per_client]
        if len(set(keys)) != len(keys):
            raise ValueError(f"download: a key is in more than one of shared/synced/per_client: {sorted(keys)}")
        if self.synced and not self.to_all:
            raise ValueError("download: 'synced' needs to_all (only clients that receive every broadcast are in sync)")
        return {**self.shared, **self.synced, **self.per_client}

    def shared_received(self) -> dict[str, Any]:
        """What every recipient gets alike (``shared`` and ``synced``): ``shared_context``'s input."""
        return {**self.shared, **self.synced}


def select(tree: Mapping[str, torch.Tensor], selector: Selector, parts: Mapping[str, tuple[str, ...]],
           buffers: tuple[str, ...], where: str) -> list[str]:
    """The leaf names of ``tree`` that ``selector`` trains (see :data:`Selector`).

    Raises ValueError naming ``where`` when a selector names a part or a leaf that is absent.
    """
    if selector is None:
        return [k for k, v in tree.items() if k not in buffers and v.is_floating_point()]
    if isinstance(selector, str):
        if selector not in parts:
            raise ValueError(f"{where}: unknown model part {selector!r}; the model has {sorted(parts)}")
        if not parts[selector]:
            raise ValueError(f"{where}: trains the model part {selector!r}, which this model does not have (it "
                             f"is empty, e.g. the body of mlr); choose a train.model with a {selector}")
        names = [k for k in parts[selector] if k in tree and k not in buffers]
    else:
        names = list(selector)
    missing = [k for k in names if k not in tree]
    if missing or not names:
        raise ValueError(f"{where}: selects {missing or 'nothing'} from a tree with leaves {sorted(tree)[:8]}...")
    return names


def phase_plan(n: int, batch_size: int, epochs: int, seed: int, round_idx: int, client: int, phase: Phase | str
               ) -> torch.Tensor:
    """Mini-batch positions for one client's phase (or pass): int64 ``[steps, batch_size]`` into
    its local train set, -1 on padding (``DataLoader(drop_last=False)`` semantics).

    Each epoch is a fresh ``torch.randperm`` from a generator keyed by (seed, round, client) for
    the phase named ``train`` and by (seed, round, client, name) for any other; ``shuffle=False``
    keeps the stored order.
    ``subset`` < 1 takes a contiguous window of ``int(subset * n)`` positions at a seeded random
    offset, the same window every epoch. ``steps`` truncates or cycles the epochs' batches.
    """
    ph = phase if isinstance(phase, Phase) else Phase(name=phase)
    if n < 1:
        raise ValueError(f"client {client} has no local train samples")
    salt = ("batches", seed, round_idx, client) if ph.name == "train" else ("batches", seed, round_idx, client, ph.name)
    g = torch.Generator().manual_seed(derive_seed(*salt))
    offset, size = 0, n
    if ph.subset < 1.0:
        size = max(1, int(ph.subset * n))
        offset = int(torch.randint(0, n - size + 1, (1,), generator=g))
    per_epoch = -(-size // batch_size)
    epochs_needed = epochs if ph.steps is None else max(1, -(-ph.steps // per_epoch))
    plan = torch.full((epochs_needed, per_epoch * batch_size), -1, dtype=torch.int64)
    for e in range(epochs_needed):
        order = torch.randperm(size, generator=g) if ph.shuffle else torch.arange(size)
        plan[e, :size] = order + offset
    plan = plan.view(epochs_needed * per_epoch, batch_size)
    if ph.steps is not None:
        plan = plan[: ph.steps]
    return plan


def pass_plan(n: int, batch_size: int, seed: int, round_idx: int, client: int, p: Pass) -> torch.Tensor:
    """Batch positions of a :class:`Pass` over ``n`` samples: one epoch, stored or seeded order,
    truncated after the first batch that brings the count above ``max_samples``."""
    plan = phase_plan(n, batch_size, 1, seed, round_idx, client, Phase(name=f"pass:{p.name}", shuffle=p.shuffle))
    if p.max_samples is not None:
        seen = torch.cumsum((plan >= 0).sum(1), 0)
        over = torch.nonzero(seen > p.max_samples)
        if len(over):
            plan = plan[: int(over[0]) + 1]
    return plan


# ----- batch plans drawn on the device (train.sampling.plans: device) ---------------------------
def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_INT64_MAX = (1 << 63) - 1


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``k`` bits (torch's ``>>`` is arithmetic on int64)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function (Steele, Lea & Flood, OOPSLA 2014; the finaliser of Java's
    ``SplittableRandom``) on int64 tensors, any shape, any device: ``z = x + 0x9E3779B97F4A7C15;
    z = (z ^ z>>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>>27) * 0x94D049BB133111EB; z ^ z>>>31``,
    in two's-complement wrap-around arithmetic (torch's int64 add and multiply wrap)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def phase_key(phase: Phase | str) -> int:
    """The phase's part of a device-drawn plan's key: 0 for the phase named ``train`` (as
    :func:`phase_plan` keys it without its name), else 63 bits of the name's hash."""
    name = phase.name if isinstance(phase, Phase) else phase
    return 0 if name == "train" else derive_seed("phase", name)


def device_plan_steps(n: int, batch_size: int, epochs: int, phase: Phase) -> int:
    """Steps of a device-drawn plan (as :func:`phase_plan`'s): ``epochs * ceil(n / batch_size)``,
    or ``phase.steps`` where set; 0 for ``epochs <= 0``."""
    if epochs <= 0:
        return 0
    return phase.steps if phase.steps is not None else epochs * -(-n // batch_size)


def device_plans(sizes: torch.Tensor, epochs: torch.Tensor, seeds: torch.Tensor, clients: torch.Tensor,
                 round_idx: int, batch_size: int, phase: Phase, width: int, max_epochs: int, max_steps: int
                 ) -> torch.Tensor:
    """Every client's batch plan of one phase in one batched computation on the device of the
    inputs (``train.sampling.plans: device``): int64 ``[m, max_steps, batch_size]``, row j client
    ``clients[j]``'s plan (positions into its local train set, -1 on padding), laid out as
    :func:`phase_plan` lays it out (each epoch a permutation of its ``n_j`` positions in
    ``ceil(n_j / batch_size)`` batches, the last one partial; ``phase.steps`` truncates or cycles
    the epochs' batches), padded with -1 after its ``device_plan_steps`` steps.

    Each epoch's order is ``argsort`` of ``mix64(key ^ (epoch << 32 | position))`` over the
    client's positions, with ``key = mix64(mix64(mix64(mix64(seed) ^ round) ^ client) ^
    phase_key)``: a function of (seed, round, client, phase, epoch) only, so a client draws the
    same plan alone, in any chunk and beside any other clients or seeds (stacked seeds, both
    executors). Not :func:`phase_plan`'s draws (another generator): a run with ``device`` plans
    is another sample of batches than the default's. ``shuffle=False`` keeps the stored order.
    No value is read on the host: ``width`` (the largest ``n_j``), ``max_epochs`` (the most
    epochs any client draws, ``ceil(phase.steps / ceil(n_j / batch_size))`` with ``steps``) and
    ``max_steps`` are the caller's host integers.

    sizes, epochs, seeds, clients: int64 [m] on one device. Raises ValueError for a phase with
    ``subset < 1`` (its window is drawn on the host: :func:`phase_plan`).
    """
    if phase.subset < 1.0:
        raise ValueError(f"phase {phase.name!r}: a subset window is drawn on the host (phase_plan)")
    dev = sizes.device
    m, b = sizes.shape[0], batch_size
    pos = torch.arange(width, device=dev, dtype=torch.int64)                        # [L]
    ep = torch.arange(max(max_epochs, 1), device=dev, dtype=torch.int64)            # [E]
    n = sizes.view(m, 1, 1)
    valid = pos.view(1, 1, -1) < n                                                  # [m, 1, L]
    if phase.shuffle:
        key = mix64(mix64(mix64(mix64(seeds) ^ round_idx) ^ clients) ^ phase_key(phase))  # [m]
        u = mix64(key.view(m, 1, 1) ^ ((ep.view(1, -1, 1) << 32) | pos.view(1, 1, -1)))   # [m, E, L]
        order = torch.argsort(torch.where(valid, u, _INT64_MAX), dim=-1, stable=True)
    else:
        order = pos.expand(m, ep.shape[0], width)
    per_epoch = (sizes + b - 1) // b                                                # [m]
    step = ep.view(1, -1, 1) * per_epoch.view(m, 1, 1) + pos.view(1, 1, -1) // b     # [m, E, L]
    if phase.steps is not None:
        epochs_needed = (phase.steps + per_epoch - 1) // per_epoch
        keep = (valid & (ep.view(1, -1, 1) < epochs_needed.view(m, 1, 1)) & (step < phase.steps)
                & (epochs.view(m, 1, 1) > 0))
    else:
        keep = valid & (ep.view(1, -1, 1) < epochs.view(m, 1, 1))
    dump = max_steps * b
    flat = torch.where(keep, step * b + pos.view(1, 1, -1) % b, dump)
    plan = torch.full((m, dump + 1), -1, dtype=torch.int64, device=dev)
    plan.scatter_(1, flat.reshape(m, -1), torch.where(keep, order, -1).reshape(m, -1))
    return plan[:, :dump].view(m, max_steps, b)


def device_plan_bounds(sizes: list[int], epochs: list[int], batch_size: int, phase: Phase) -> tuple[int, int, int]:
    """``(width, max_epochs, max_steps)`` of :func:`device_plans` for clients of ``sizes`` drawing
    ``epochs`` (host integers)."""
    per = [-(-n // batch_size) for n in sizes]
    need = [(-(-phase.steps // p) if phase.steps is not None else e) if e > 0 else 0 for p, e in zip(per, epochs)]
    steps = [device_plan_steps(n, batch_size, e, phase) for n, e in zip(sizes, epochs)]
    return max(sizes, default=1), max(need, default=1), max(steps, default=0)
