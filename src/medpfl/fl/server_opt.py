"""Server optimizers: FedAvgM, FedAdagrad, FedAdam and FedYogi as a server-side transformation of
the aggregated update (``train.server_optimizer``; :class:`medpfl.config.ServerOptimizerConfig`).

The method aggregates as it always does (``algo.aggregate``). Its new global model x̄ and the
previous global model x_t give the round's update on the model's trainable parameters

    Δ_t = x̄ − x_t

(Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2: Δ_t = the mean of the
client updates x_i − x_t, which for FedAvg's weighted mean is x̄ − x_t; for any other aggregate
it is whatever step the method's server took), and the server optimizer replaces x̄ by x_{t+1}:

    FedAvgM     u_t = β u_{t−1} + Δ_t                             x_{t+1} = x_t + η u_t
    FedAdagrad  m_t = β1 m_{t−1} + (1 − β1) Δ_t,  v_t = v_{t−1} + Δ_t²
    FedYogi     m_t as above,  v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)
    FedAdam     m_t as above,  v_t = β2 v_{t−1} + (1 − β2) Δ_t²
                (adaptive ones)                                   x_{t+1} = x_t + η m_t / (√v_t + τ)

element-wise, with u_{−1} = m_{−1} = 0 and v_{−1} = τ² (Algorithm 2 requires v_{−1} ≥ τ²; τ² is
its smallest value). The adaptive rules are Algorithm 2's, without Adam's bias correction (the
paper has none; the authors' experiments ran Keras' Adam and Adagrad, which correct Adam's bias,
start v at 0 and use β2 = 0.999: not reproduced). FedAvgM is server SGD with momentum, the FedOpt
paper's FedAvgM (Sec. 5; Keras SGD with momentum 0.9 in the authors' code, which for a constant η
is this rule) and Hsu, Qi & Brown 2019 ("Measuring the effects of non-identical data distribution
for federated visual classification", arXiv 1909.06335: v ← βv + Δw, w ← w − v with Δw the
averaged update in gradient sign, i.e. this rule at η = 1). With β = 0 and η = 1 FedAvgM returns
x_t + (x̄ − x_t), computed in float64: x̄ itself
(to the bit whenever x̄ − x_t is exact in float64, i.e. unless a value moves across ~29 binary
orders of magnitude in one round).

What is optimized: the names ``algo.forward.trainable`` (the model's trainable floating-point
parameters). Buffers (BatchNorm running mean and variance, ``num_batches_tracked``) are taken from
the aggregate as they are, not optimized: they are statistics, not the result of a gradient step.
Other entries of the server state (SCAFFOLD's c, FedCurv's sums) are the method's, untouched.

State: ``server["server_optimizer"]`` (:data:`STATE_KEY`), ``{"u": tree}`` (FedAvgM) or ``{"m":
tree, "v": tree}`` (adaptive), each tree the optimized parameters' names and shapes in their dtype
(float32), so the engine checkpoints it with the server state and a resumed run continues it. It
is created at the first server step (from x_t) and read from the server state *before* the
aggregate at each step, so a method's ``aggregate`` that returns a fresh dict cannot drop it. The
arithmetic of a step runs in float64 (float32 on MPS, which has no float64) and is stored back in
the parameters' dtype.

Which methods: those with a global model (``has_global_model`` and ``aggregates``), except those
in :data:`NOT_APPLICABLE`, whose clients or server state hold copies of the global model that a
step after ``aggregate`` would leave stale (FedKD, FedMIC, FedGKD with its teacher buffer).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from medpfl.config import ServerOptimizerConfig
from medpfl.errors import ParamsError

#: the server-state key holding the optimizer's state (checkpointed with the server state)
STATE_KEY = "server_optimizer"

#: methods (by registered name, also for their subclasses) a server optimizer would break, with
#: the reason; a callable gets the method's config and returns the reason or None
NOT_APPLICABLE: dict[str, Callable[[Any], str | None]] = {
    "fedkd": lambda cfg: ("its clients rebuild the global model from the broadcast compressed update (prev + "
                          "update, synced), so a server step after aggregate would leave their copies stale"),
    "fedmic": lambda cfg: ("its clients rebuild the global student from the broadcast update (prev + update, "
                           "synced), so a server step after aggregate would leave their copies stale"),
    "fedgkd": lambda cfg: (("its teacher buffer stores each new global model inside aggregate, before a server "
                            "step, so the teacher would average models no client received (it applies with "
                            "kl_weight: 0 or buffer_size: 1)")
                           if cfg.kl_weight > 0 and cfg.buffer_size > 1 else None),
}


def not_applicable_reason(algo_cls: type, cfg: Any, algo: Any = None) -> str | None:
    """Why a server optimizer cannot run with this method (class ``algo_cls``, config ``cfg``;
    ``algo``: the built method, unused since capabilities are class declarations), or None."""
    # capabilities are class-level declarations (Algorithm.aggregates, has_global_model)
    if not algo_cls.aggregates or not algo_cls.has_global_model:
        return "it has no global model (has_global_model is false) for a server optimizer to step"
    for klass in algo_cls.__mro__:
        rule = NOT_APPLICABLE.get(getattr(klass, "name", "") or "")
        if rule is not None:
            return rule(cfg)
    return None


def check_applicable(method: str, algo_cls: type, cfg: Any, key: str, optimizer: str, algo: Any = None) -> None:
    """Raises :class:`~medpfl.errors.ParamsError` (one line naming ``method``, its algorithm and
    ``key``) when a server optimizer cannot run with this method; nothing otherwise."""
    why = not_applicable_reason(algo_cls, cfg, algo)
    if why is None:
        return
    algo_name = getattr(algo_cls, "name", algo_cls.__name__)
    named = f"method {method!r}" + (f" ({algo_name})" if algo_name != method else "")
    raise ParamsError(f"{key}: {optimizer} cannot run with {named}: {why}; remove the key or set "
                      f"method_params.{method}.train.server_optimizer: null")


class ServerOptimizer:
    """One server optimizer over the parameters ``names`` (str) of a model state.

    cfg: a resolved :class:`~medpfl.config.ServerOptimizerConfig` (every key of its optimizer
    set). Pure tree functions: :meth:`init_state`, :meth:`step`; the engine calls :meth:`apply`
    on two server states. Raises ValueError when a name is missing from the model or is not a
    floating-point tensor."""

    def __init__(self, cfg: ServerOptimizerConfig, names: Iterable[str]):
        self.cfg = cfg
        self.names = tuple(names)
        self.adaptive = cfg.name != "fedavgm"

    def _check(self, model: dict[str, torch.Tensor]) -> None:
        for k in self.names:
            if k not in model:
                raise ValueError(f"server optimizer {self.cfg.name}: parameter {k!r} is not in the global model")
            if not model[k].is_floating_point():
                raise ValueError(f"server optimizer {self.cfg.name}: parameter {k!r} is {model[k].dtype}, "
                                 "not floating point")

    def init_state(self, model: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The state before the first step, from the global model x_0 (its optimized entries):
        ``{"u": 0}`` (FedAvgM) or ``{"m": 0, "v": τ²}`` (Algorithm 2's m_{−1}, v_{−1}), each
        shaped and typed as the parameter."""
        self._check(model)
        zeros = {k: torch.zeros_like(model[k]) for k in self.names}
        if not self.adaptive:
            return {"u": zeros}
        tau2 = self.cfg.tau ** 2
        return {"m": zeros, "v": {k: torch.full_like(model[k], tau2) for k in self.names}}

    def step(self, x: dict[str, torch.Tensor], aggregate: dict[str, torch.Tensor],
             state: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(x_{t+1}, new state)`` from the global model ``x`` (x_t), the method's ``aggregate``
        (x̄, same names and shapes) and the state (:meth:`init_state`'s layout). Optimized names:
        x_{t+1} by the module's rules with Δ_t = x̄ − x_t; every other entry of x_{t+1} is x̄'s as
        it is (buffers). Inputs are not modified."""
        self._check(x)
        c = self.cfg
        out = dict(aggregate)
        new: dict[str, dict[str, torch.Tensor]] = {k: {} for k in state}
        for k in self.names:
            xk = x[k]
            wide = torch.float32 if xk.device.type == "mps" else torch.float64
            x64 = xk.to(wide)
            d = aggregate[k].to(wide) - x64
            if not self.adaptive:  # Hsu et al. 2019; FedOpt's FedAvgM (server SGD with momentum)
                u = c.momentum * state["u"][k].to(wide) + d
                out[k] = (x64 + c.lr * u).to(xk.dtype)
                new["u"][k] = u.to(xk.dtype)
                continue
            m = c.beta1 * state["m"][k].to(wide) + (1 - c.beta1) * d  # Alg. 2: m_t
            v = state["v"][k].to(wide)
            d2 = d * d
            if c.name == "fedadagrad":
                v = v + d2
            elif c.name == "fedyogi":
                v = v - (1 - c.beta2) * d2 * torch.sign(v - d2)
            else:  # fedadam
                v = c.beta2 * v + (1 - c.beta2) * d2
            out[k] = (x64 + c.lr * m / (torch.sqrt(v) + c.tau)).to(xk.dtype)
            new["m"][k] = m.to(xk.dtype)
            new["v"][k] = v.to(xk.dtype)
        return out, new

    def apply(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """The engine's call, right after ``aggregate``: ``after`` (the method's next server state)
        with ``"model"`` replaced by the optimizer's x_{t+1} and :data:`STATE_KEY` by its new
        state; x_t and the state come from ``before`` (the server state the round started from;
        the state is created there at the first step)."""
        state = before.get(STATE_KEY)
        if state is None:
            state = self.init_state(before["model"])
        model, state = self.step(before["model"], after["model"], state)
        return {**after, "model": model, STATE_KEY: state}


def make_server_optimizer(cfg: ServerOptimizerConfig | None, algo: Any) -> ServerOptimizer | None:
    """The server optimizer of a run (None for ``train.server_optimizer: null``) over ``algo``'s
    trainable parameters. Raises :class:`~medpfl.errors.ParamsError` naming the method and
    ``train.server_optimizer`` when it cannot run with ``algo`` (:func:`check_applicable`)."""
    if cfg is None:
        return None
    check_applicable(algo.name, type(algo), algo.cfg, "train.server_optimizer", cfg.name, algo=algo)
    return ServerOptimizer(cfg, algo.forward.trainable)


__all__ = ["NOT_APPLICABLE", "STATE_KEY", "ServerOptimizer", "check_applicable", "make_server_optimizer",
           "not_applicable_reason"]
