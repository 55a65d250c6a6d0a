"""Secure aggregation (Flower's SecAgg+) of a method's model upload in a deployment.

With the run config ``secagg`` on, each round's model upload is summed under SecAgg+ (Bell et
al., CCS 2020; ``flwr.server.workflow.SecAggPlusWorkflow`` with ``flwr.client.mod.
secaggplus_mod``): every site sends its update masked, and the server learns only the weighted
mean of the sites' updates, never one site's. What it still sees in plaintext: each site's weight
(its client's local train size, which the server knows from ``hello`` anyway) and the site's
evaluation counts (as without SecAgg+).

The server then hands the engine m rows each equal to that mean, with weights of ones (the trick
of DP-FedAvg in :meth:`medpfl.fl.privacy.UploadPipeline.receive`), so the method's own
``aggregate`` (a weighted mean of identical rows) returns the mean and runs unchanged. That is
exact only for the methods :func:`secagg_not_applicable` lets through.

What a site sends: the update Δ = upload − reference (the download the upload started from,
:class:`~medpfl.algorithms.base.ModelUpload`) in float64, integer leaves (BatchNorm's
``num_batches_tracked``) divided by :data:`INT_SCALE`; the server adds the mean update to the
reference (rounding integer leaves). SecAgg+ quantises each site's ``w/max_weight · Δ`` into
2^22 steps over ``[-clip, clip]`` (``secagg-clip``); a site whose update would leave that range
stops the round with an error naming ``secagg-clip`` (SecAgg+ itself would clip silently).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.errors import DeploymentError, ParamsError

#: integer leaves of an update are sent divided by this (their steps stay far below 0.5 after
#: quantisation: clip · 2 / 2^22 · INT_SCALE ≈ 0.04 for clip = 8)
INT_SCALE = 1e4
#: the default clipping range of a site's scaled update (run config ``secagg-clip``)
DEFAULT_CLIP = 8.0


#: where the reason a method takes no upload transforms (:data:`medpfl.fl.privacy.NOT_APPLICABLE`)
#: is not the reason it takes no SecAgg+
_WHY = {"scaffold": ("its upload holds the control-variate update besides the model, and its server averages the "
                     "two with different weights (SecAgg+ here gives one weighted mean of one model upload)")}


def secagg_not_applicable(algo: Algorithm) -> str | None:
    """Why SecAgg+ cannot aggregate ``algo``'s uploads exactly, or None when it can.

    SecAgg+ gives the server one weighted mean of the sites' vectors, with per-site weights it
    sees. The engine can hand that mean to the method's own ``aggregate`` (m identical rows,
    weights of ones) only when the server reads the uploads through that mean alone:

    * the method declares a model upload (``type(algo).model_upload``, see
      :class:`~medpfl.algorithms.base.ModelUpload`) weighted by ``num_samples`` alone (not
      FedKPer's ``score``, FedAS's ``fisher_trace``: per-client values the mean would hide);
    * its ``upload_spec()`` holds exactly that upload and ``num_samples`` (not SCAFFOLD's
      control-variate deltas or anything else read per client);
    * every client that trains is aggregated (``training_clients`` not overridden: pFedMe
      trains all clients and averages the sampled ones);
    * its aggregation weights are n_k / Σn (FedAvg's) or uniform (``weighting: uniform`` of
      APFL and FedBN): :func:`secagg_weight` gives each site the matching weight.
    """
    from medpfl.fl.privacy import not_applicable_reason

    cls = type(algo)
    why = not_applicable_reason(cls)
    if why is not None:
        return _WHY.get(algo.name) or why.split(";")[0]
    decl = cls.model_upload
    if tuple(decl.weights) != ("num_samples",):
        extra = [w for w in decl.weights if w != "num_samples"]
        return (f"its server weights each client's upload by {', '.join(extra)}, a per-client value the secure "
                "sum would have to reveal")
    keys = set(algo.upload_spec())
    if keys != {decl.upload, "num_samples"}:
        extra = sorted(keys - {decl.upload, "num_samples"})
        return (f"its upload holds {', '.join(extra)} besides the averaged {decl.upload!r}, which its server reads "
                "per client")
    if cls.training_clients is not Algorithm.training_clients:
        return "clients that train are not all aggregated (its training_clients), so the secure sum would mix them in"
    if getattr(algo.cfg, "weighting", "num_samples") not in ("num_samples", "uniform"):
        return f"its weighting {algo.cfg.weighting!r} is neither num_samples nor uniform"
    return None


def check_secagg(algo: Algorithm, method: str) -> None:
    """Raises :class:`~medpfl.errors.ParamsError`, one line naming ``secagg``, the method and
    why, when :func:`secagg_not_applicable` refuses it."""
    why = secagg_not_applicable(algo)
    if why is not None:
        named = f"method {method!r}" + (f" ({algo.name})" if algo.name != method else "")
        raise ParamsError(f"secagg: secure aggregation (SecAgg+) cannot run with {named}: {why}; run it without "
                          "--secagg (run config secagg=false)")


def secagg_weight(algo: Algorithm, num_samples: int) -> int:
    """The weight a site's update carries in the secure mean: its client's local train size,
    or 1 for a method with ``weighting: uniform``."""
    return 1 if getattr(algo.cfg, "weighting", "num_samples") == "uniform" else int(num_samples)


def protocol_params(n: int) -> dict[str, Any]:
    """SecAgg+'s ``num_shares`` and ``reconstruction_threshold`` for ``n`` sites: every site
    holds a share of every other's secrets; n // 2 + 1 of them (at least 2) rebuild one, so up
    to n - n // 2 - 1 sites may drop out after sending their masked vector. Two sites: both
    (Flower takes integers only above 2, fractions of n otherwise)."""
    if n < 2:
        raise DeploymentError(f"secagg: a round needs at least 2 training sites, got {n} (with one, the mean is its "
                              "upload); raise train.participation")
    if n == 2:
        return {"num_shares": 1.0, "reconstruction_threshold": 1.0}
    return {"num_shares": n, "reconstruction_threshold": n // 2 + 1}


# ----- the site's side ----------------------------------------------------------------------------
def site_update(algo: Algorithm, down_shared: dict, reply: tuple[dict, dict], weight: float, max_weight: float,
                clip: float, client: int) -> tuple[list[np.ndarray], dict[str, str]]:
    """A site's contribution to the secure mean from its ``train`` reply ``(tree, config)``
    (:meth:`medpfl.deploy.site.Site.train`, one client): ``(update leaves, metrics)``.

    Leaves: Δ = upload − reference per tensor of the model upload in sorted key order, float64,
    integer leaves divided by :data:`INT_SCALE`. Metrics: ``{"reply": JSON}`` with the test/val
    counts and ``bad_state``; a non-finite update is sent as zeros with ``bad_state`` set (the
    server's divergence guard stops the run). Raises DeploymentError naming ``secagg-clip``
    when ``weight/max_weight · |Δ|`` exceeds ``clip``."""
    decl = type(algo).model_upload
    tree, cfg = reply
    up, ref = tree["uploads"][decl.upload], down_shared[decl.reference]
    bad = cfg.get("bad_state") or ""
    leaves = []
    for k in sorted(up):
        d = up[k][0].detach().cpu().to(torch.float64) - ref[k].detach().cpu().to(torch.float64)
        if not (up[k].is_floating_point() or up[k].is_complex()):
            d = d / INT_SCALE
        leaves.append(d.numpy().copy())
    if not all(np.isfinite(a).all() for a in leaves):
        bad = bad or f"client {client}: upload {decl.upload!r} is not finite"
        leaves = [np.zeros_like(a) for a in leaves]
    top = max((float(np.abs(a).max()) for a in leaves if a.size), default=0.0) * weight / max_weight
    if top > clip:
        raise DeploymentError(f"secagg: client {client}'s update reaches {top:.4g} (weight {weight:g} / max_weight "
                              f"{max_weight:g} × |Δ|), beyond the clipping range {clip:g}; SecAgg+ would clip it "
                              "silently: raise secagg-clip (medpfl deploy run --secagg-clip)")

    def rows(c):
        return [t.tolist() for t in c] if c is not None and len(c) else None

    val = tree.get("val")
    metrics = {"reply": json.dumps({"test": rows(tree["test"]), "val": rows(val) if isinstance(val, tuple) else None,
                                    "bad_state": bad}, allow_nan=False)}
    return leaves, metrics


# ----- the server's side --------------------------------------------------------------------------
def mean_uploads(algo: Algorithm, down_shared: dict, mean: list[np.ndarray], m: int, device) -> dict[str, Any]:
    """The engine's uploads from the secure mean of the updates: m rows each equal to
    reference + mean (integer leaves rounded), ``num_samples`` ones (DP-FedAvg's trick,
    :meth:`medpfl.fl.privacy.UploadPipeline.receive`), so the method's weighted mean returns it."""
    decl = type(algo).model_upload
    ref = down_shared[decl.reference]
    keys = sorted(ref)
    if len(mean) != len(keys):
        raise DeploymentError(f"secagg: the secure mean has {len(mean)} tensors, the model upload {len(keys)}")
    rows = {}
    for k, a in zip(keys, mean):
        r = ref[k]
        d = torch.as_tensor(np.asarray(a, dtype=np.float64)).reshape(r.shape)
        if r.is_floating_point():
            v = (r.detach().cpu().to(torch.float64) + d).to(r.dtype)
        else:
            v = torch.round(r.detach().cpu().to(torch.float64) + d * INT_SCALE).to(r.dtype)
        rows[k] = v.to(device).unsqueeze(0).expand(m, *r.shape)
    return {decl.upload: rows, "num_samples": torch.ones(m, dtype=torch.float32, device=device)}


def counts_from_json(rows) -> tuple | None:
    """The inverse of the metrics' counts: ``(correct, count, loss)`` float64 tensors, or None."""
    if rows is None:
        return None
    return tuple(torch.as_tensor(r, dtype=torch.float64) for r in rows)
