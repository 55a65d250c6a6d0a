"""The server side of a deployed run: the simulator's engine with the clients at their sites.

:class:`FlowerClients` is the engine's client side (:mod:`medpfl.fl.clients`) for clients that
live at sites (:class:`medpfl.deploy.site.Site`) reached through a *transport*: Flower's grid in
a real deployment (:mod:`medpfl.deploy.app`), or :class:`InProcessTransport` (sites as objects
in this process, for tests). Each round it sends every site the download rows of the clients it
holds that train, and gets back their uploads and evaluation counts; in evaluation rounds it
sends the server state (and global model) and gets back the counts of every client's models.
The server never holds a client's state or personalized model.

Sites that do not answer within ``timeout`` seconds leave the round: their clients are listed
in the round log's ``missing_clients``, the others' uploads are aggregated, and a later round
reaches the site again (a restarted site keeps its state on its disk).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from medpfl.algorithms.base import Algorithm
from medpfl.errors import DeploymentError
from medpfl.fl.clients import EvalResult, TrainedRound
from medpfl.fl.program import Download, Federation, RoundInfo
from medpfl.fl.tree import tree_index, tree_map

log = logging.getLogger(__name__)


class Transport(Protocol):
    """Requests to sites and their replies. ``request({node: (kind, tree, config)}, timeout)``
    returns ``{node: (tree, config)}`` for the nodes that answered in time and an Exception for
    those that failed (a node absent from the result did not answer)."""

    def nodes(self) -> list[int]: ...

    def request(self, requests: dict[int, tuple[str, Any, dict]], timeout: float) -> dict[int, Any]: ...


class SecureTransport(Transport, Protocol):
    """A transport that can also run a round's training under secure aggregation (``secagg``):
    ``secure_train({node: (tree, config)}, timeout, weights, max_weight, clip)`` sends each node
    its ``train`` request and returns ``(mean, metrics)``: the weighted mean of the sites'
    update leaves (``weights[node]`` each; None when the protocol failed) and each contributing
    node's metrics (``{"reply": JSON}``, :func:`medpfl.deploy.secagg.site_update`) or the
    Exception it failed with. No single site's update is in what it returns."""

    def secure_train(self, requests: dict[int, tuple[Any, dict]], timeout: float, weights: dict[int, float],
                     max_weight: float, clip: float) -> tuple[list | None, dict[int, Any]]: ...


#: the least time ``hello`` and ``init`` wait for the sites (seconds)
SETUP_TIMEOUT_S = 300.0


def run_key(job: dict) -> str:
    """The name under which sites keep a job's client states: ``run-`` + a hash of the job."""
    from medpfl.fl.engine import fingerprint

    return "run-" + fingerprint({"job": job})


def round_config(rnd: RoundInfo) -> dict:
    """A :class:`RoundInfo` as a message's config (JSON-able)."""
    return {"round": rnd.round, "rounds": rnd.rounds, "lr": rnd.lr, "num_clients": rnd.num_clients,
            "seed": rnd.seed, "base_lr": rnd.base_lr, "batch_size": rnd.batch_size}


def counts_rows(counts: tuple, rows: list[int]) -> tuple:
    return tuple(c[rows] for c in counts)


class FlowerClients:
    """The engine's client side over a :class:`Transport` (see the module docstring).

    job: the ``medpfl train --job`` dict (sent to every site, which builds the method from it);
    checkpointing: whether the engine writes checkpoints (then sites keep the client states the
    last checkpoint refers to, for a resumed server). Raises :class:`DeploymentError` when the
    sites do not hold each of the job's clients exactly once."""

    name = "flower"
    reports_missing = True

    def __init__(self, transport: Transport, job: dict, run_key: str, timeout: float = 600.0,
                 checkpointing: bool = True, device: torch.device | str = "cpu", secagg: bool = False,
                 secagg_clip: float | None = None):
        from medpfl.deploy.secagg import DEFAULT_CLIP

        self.transport = transport
        #: SecAgg+ of the model upload (:mod:`medpfl.deploy.secagg`); needs one client per site
        self.secagg = bool(secagg)
        self.secagg_clip = float(DEFAULT_CLIP if secagg_clip is None else secagg_clip)
        self.job = job
        self.run_key = run_key
        self.timeout = timeout
        #: hello and init wait longer: a site builds its data and method on the first request
        self.setup_timeout = max(timeout, SETUP_TIMEOUT_S)
        self.checkpointing = checkpointing
        self.device = torch.device(device)
        k = int(job["num_clients"])
        self._connect(k)
        self.last = np.full(k, -1, dtype=np.int64)  # the round after which each client's state was last written
        self.keep = self.last.copy()  # as the last checkpoint has it: the sites keep these
        self._pending: list[int] = []
        self._round = -1

    # ----- sites ------------------------------------------------------------------------------
    def _connect(self, k: int) -> None:
        """Ask every site which clients it holds (``hello``); builds the federation."""
        nodes = self.transport.nodes()
        if not nodes:
            raise DeploymentError("no site is connected to the SuperLink")
        replies = self.transport.request({n: ("hello", {}, self._base()) for n in nodes}, self.setup_timeout)
        node_of: dict[int, int] = {}
        num_samples: dict[int, int] = {}
        classes, has_val, has_gt = set(), False, True
        for n, rep in replies.items():
            if isinstance(rep, Exception):
                raise DeploymentError(f"site (node {n}) refused the job: {rep}")
            cfg = rep[1]
            for c, ns in zip(cfg["clients"], cfg["num_samples"]):
                if c in node_of:
                    raise DeploymentError(f"client {c} is held by two sites (nodes {node_of[c]} and {n})")
                node_of[int(c)], num_samples[int(c)] = n, int(ns)
            classes.add(int(cfg["num_classes"]))
            has_val |= bool(cfg["has_val"])
            has_gt &= bool(cfg["has_global_test"])
        missing = sorted(set(range(k)) - set(node_of))
        if missing:
            raise DeploymentError(f"the job has {k} clients, but no connected site holds client(s) {missing} "
                                  f"({len(replies)} site(s) answered); start their SuperNodes (node config "
                                  "client-ids) and run again")
        if len(classes) != 1:
            raise DeploymentError(f"the sites disagree on the number of classes: {sorted(classes)}")
        if self.secagg:
            self._one_client_per_site(node_of)
        self.node_of = node_of
        self._known = set(nodes)
        self.federation = Federation(num_clients=k, num_samples=tuple(num_samples[c] for c in range(k)),
                                     num_classes=classes.pop())
        self.has_val = has_val
        self.has_global_test = has_gt

    def _refresh(self) -> None:
        """Sites that (re)connected since the last round: a restarted SuperNode comes back under
        a new node id, so ask the new nodes which clients they hold (``hello``) and route those
        clients to them. Raises DeploymentError when a new node claims a client already held by
        a node that is still connected."""
        nodes = set(self.transport.nodes())
        new = sorted(nodes - set(self._known))
        self._known = nodes
        if not new:
            return
        replies = self.transport.request({n: ("hello", {}, self._base()) for n in new}, self.setup_timeout)
        for n, rep in replies.items():
            if isinstance(rep, Exception):
                log.warning("a new site (node %d) refused the job: %s", n, rep)
                continue
            for c in rep[1]["clients"]:
                old = self.node_of.get(int(c))
                if old is not None and old in nodes and old != n:
                    raise DeploymentError(f"client {c} is held by two connected sites (nodes {old} and {n})")
                if old != n:
                    log.info("client %d is now at node %d (was %s)", c, n, old)
                self.node_of[int(c)] = n
        if self.secagg:
            self._one_client_per_site({c: n for c, n in self.node_of.items() if n in nodes})

    @staticmethod
    def _one_client_per_site(node_of: dict[int, int]) -> None:
        """secagg: a site's weight and update are its one client's (the secure sum is over sites)."""
        held: dict[int, list[int]] = {}
        for c, n in node_of.items():
            held.setdefault(n, []).append(c)
        several = {n: sorted(cs) for n, cs in held.items() if len(cs) > 1}
        if several:
            n, cs = next(iter(sorted(several.items())))
            raise DeploymentError(f"secagg: the site of node {n} holds clients {cs}; secure aggregation sums one "
                                  "update per site, so each site must hold exactly one client (node config "
                                  "client-ids)")

    def _base(self) -> dict:
        return {"job": self.job, "run_key": self.run_key}

    def _by_node(self, clients) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in clients:
            out.setdefault(self.node_of[int(c)], []).append(int(c))
        return out

    def _request(self, requests: dict[int, tuple[str, Any, dict]], what: str,
                 timeout: float | None = None) -> dict[int, Any]:
        """Replies of the nodes that answered; a site's error is raised (it is the job's fault:
        a bad upload, a diverged state), a silent node is left out with a warning."""
        t0 = time.perf_counter()
        timeout = self.timeout if timeout is None else timeout
        replies = self.transport.request(requests, timeout)
        ok = {}
        for n in requests:
            rep = replies.get(n)
            if rep is None:
                log.warning("%s: the site of node %d did not answer within %.0f s; its clients leave this round",
                            what, n, timeout)
            elif isinstance(rep, Exception):
                raise DeploymentError(f"{what}: the site of node {n} failed: {rep}") from rep
            else:
                ok[n] = rep
        log.debug("%s: %d of %d sites answered in %.2f s", what, len(ok), len(requests), time.perf_counter() - t0)
        return ok

    # ----- the client side --------------------------------------------------------------------
    def init_states(self, algo: Algorithm, params: dict, seed: int) -> None:
        """Every site builds its clients' round-0 states from the initial model (sent once)."""
        cfg = {**self._base(), "num_samples": list(self.federation.num_samples), "seed": int(seed)}
        nodes = sorted(set(self.node_of.values()))
        got = self._request({n: ("init", {"params": params}, cfg) for n in nodes}, "init", self.setup_timeout)
        if len(got) != len(nodes):
            raise DeploymentError(f"init: {len(nodes) - len(got)} site(s) did not answer; every site must hold "
                                  "its clients' initial state before round 1")
        self.last[:] = -1
        self.keep = self.last.copy()

    def _from(self, clients) -> dict[str, int]:
        return {str(c): int(self.last[c]) for c in clients}

    def _keep(self, clients) -> dict[str, int]:
        keep = self.keep if self.checkpointing else self.last
        return {str(c): int(keep[c]) for c in clients}

    def train_round(self, algo: Algorithm, down: Download, trainers: np.ndarray, rnd: RoundInfo,
                    score_val: bool, trainer_index: torch.Tensor | None = None) -> TrainedRound:
        # trainer_index (the engine's device copy of ``trainers``) is not needed: the sites index their own states
        self._refresh()
        if self.secagg:
            return self._secure_train_round(algo, down, trainers, rnd, score_val)
        pos = {int(c): j for j, c in enumerate(trainers)}
        groups = self._by_node(trainers)
        requests = {}
        for n, cs in groups.items():
            rows = torch.as_tensor([pos[c] for c in cs], dtype=torch.int64)
            tree = {"shared": down.shared, "synced": down.synced, "per_client": tree_index(down.per_client, rows)}
            cfg = {**self._base(), "rnd": round_config(rnd), "trainers": cs, "from": self._from(cs),
                   "keep_from": self._keep(cs), "score_val": bool(score_val), "to_all": bool(down.to_all)}
            requests[n] = ("train", tree, cfg)
        replies = self._request(requests, f"round {rnd.round + 1} training")
        answered = [c for c in (int(c) for c in trainers) if self.node_of[c] in replies]
        missing = tuple(sorted(set(int(c) for c in trainers) - set(answered)))
        bad = next((rep[1]["bad_state"] for rep in replies.values() if rep[1].get("bad_state")), None)
        # the sites' rows one after another, then picked into the trainers' order
        nodes_ok = [n for n in groups if n in replies]
        where = {c: i for i, c in enumerate(c for n in nodes_ok for c in groups[n])}
        pick = [where[c] for c in answered]
        if nodes_ok:
            cat = tree_map(lambda *xs: torch.cat(xs), *[replies[n][0]["uploads"] for n in nodes_ok])
            uploads = tree_map(lambda t: t.to(self.device), tree_index(cat, torch.as_tensor(pick, dtype=torch.int64)))
        else:
            uploads = {}
        test = self._cat([replies[n][0]["test"] for n in nodes_ok], pick)
        val = self._cat([replies[n][0]["val"] for n in nodes_ok], pick) if score_val else None
        self._pending = answered
        self._round = rnd.round
        return TrainedRound(uploads, test, val, {}, bad_state=bad, missing=missing)

    def _secure_train_round(self, algo: Algorithm, down: Download, trainers: np.ndarray, rnd: RoundInfo,
                            score_val: bool) -> TrainedRound:
        """The round's local training with the model upload summed under SecAgg+: the server gets
        the sites' weighted mean update only, and hands the engine m rows each equal to it with
        weights of ones (:func:`medpfl.deploy.secagg.mean_uploads`)."""
        from medpfl.deploy.secagg import counts_from_json, mean_uploads, protocol_params, secagg_weight

        trainers = [int(c) for c in trainers]
        pos = {c: j for j, c in enumerate(trainers)}
        protocol_params(len(trainers))  # raises for a round with fewer than 2 sites
        requests, weights = {}, {}
        for c in trainers:
            n = self.node_of[c]
            rows = torch.as_tensor([pos[c]], dtype=torch.int64)
            tree = {"shared": down.shared, "synced": down.synced, "per_client": tree_index(down.per_client, rows)}
            cfg = {**self._base(), "rnd": round_config(rnd), "trainers": [c], "from": self._from([c]),
                   "keep_from": self._keep([c]), "score_val": bool(score_val), "to_all": bool(down.to_all)}
            requests[n] = (tree, cfg)
            weights[n] = float(secagg_weight(algo, self.federation.num_samples[c]))
        max_weight = max(weights.values())
        t0 = time.perf_counter()
        mean, metrics = self.transport.secure_train(requests, self.timeout, weights, max_weight, self.secagg_clip)
        what = f"round {rnd.round + 1} training (secagg)"
        failed = {n: e for n, e in metrics.items() if isinstance(e, Exception)}
        if failed:
            n, e = next(iter(sorted(failed.items())))
            raise DeploymentError(f"{what}: the site of node {n} failed: {e}") from e
        if mean is None:
            raise DeploymentError(f"{what}: secure aggregation did not complete ({len(metrics)} of {len(requests)} "
                                  "sites sent their masked update; fewer than its reconstruction threshold)")
        log.debug("%s: %d of %d sites in %.2f s", what, len(metrics), len(requests), time.perf_counter() - t0)
        answered = [c for c in trainers if self.node_of[c] in metrics]
        missing = tuple(sorted(set(trainers) - set(answered)))
        for c in missing:
            log.warning("%s: the site of client %d sent no masked update; it leaves this round", what, c)
        replies = {self.node_of[c]: json.loads(metrics[self.node_of[c]]["reply"]) for c in answered}
        bad = next((r["bad_state"] for r in replies.values() if r.get("bad_state")), None)
        uploads = mean_uploads(algo, down.shared, mean, len(answered), self.device) if answered else {}
        order = list(range(len(answered)))
        test = self._cat([counts_from_json(replies[self.node_of[c]]["test"]) for c in answered], order)
        val = (self._cat([counts_from_json(replies[self.node_of[c]]["val"]) for c in answered], order)
               if score_val else None)
        self._pending = answered
        self._round = rnd.round
        return TrainedRound(uploads, test, val, {}, bad_state=bad, missing=missing)

    def _cat(self, parts: list[tuple], pick: list[int]) -> tuple:
        if not parts:
            z = torch.zeros(0, self.federation.num_classes or 1, dtype=torch.float64)
            return z, z.clone(), torch.zeros(0, dtype=torch.float64)
        cat = tuple(torch.cat([p[i] for p in parts]).to(self.device) for i in range(3))
        return counts_rows(cat, pick)

    def commit(self) -> None:
        for c in self._pending:
            self.last[c] = self._round
        self._pending = []

    def evaluate(self, algo: Algorithm, server: dict, rnd: RoundInfo, *, global_model: Any, personalized: bool,
                 val: bool, personalized_global: bool) -> EvalResult:
        k = self.federation.num_clients
        groups = self._by_node(range(k))
        # the server optimizer's moments are the server's own: not sent
        tree = {"server": {key: v for key, v in server.items() if key != "server_optimizer"} if personalized else {},
                "global_model": global_model if global_model is not None else {}}
        requests = {n: ("evaluate", tree, {**self._base(), "rnd": round_config(rnd), "from": self._from(cs),
                                           "global_model": global_model is not None, "personalized": personalized,
                                           "val": bool(val), "personalized_global": bool(personalized_global)})
                    for n, cs in groups.items()}
        replies = self._request(requests, f"round {rnd.round + 1} evaluation")
        nodes = [n for n in groups if n in replies]
        clients = [c for n in nodes for c in groups[n]]
        order = sorted(range(len(clients)), key=lambda i: clients[i])
        out = EvalResult(clients=sorted(clients))
        for view in ("global_test", "global_val", "personalized_test", "personalized_val", "personalized_global"):
            parts = [replies[n][0].get(view) for n in nodes]
            if parts and all(p is not None and len(p) for p in parts):
                setattr(out, view, self._cat(parts, order))
        return out

    def finish(self, server: dict) -> None:
        """Every site saves its clients' personalized models (they stay there)."""
        groups = self._by_node(range(self.federation.num_clients))
        tree = {"server": {key: v for key, v in server.items() if key != "server_optimizer"}}
        self._request({n: ("finish", tree, {**self._base(), "from": self._from(cs)}) for n, cs in groups.items()},
                      "finish")

    def state_dict(self) -> Any:
        self.keep = self.last.copy()
        return {"last": self.last.copy(), "node_of": dict(self.node_of)}

    def load_state_dict(self, blob: Any) -> None:
        self.last = np.asarray(blob["last"], dtype=np.int64).copy()
        self.keep = self.last.copy()


# ----- in-process sites (tests, and a single-machine dry run) -----------------------------------
class InProcessTransport:
    """Sites as :class:`~medpfl.deploy.site.Site` objects in this process, reached by the same
    requests and replies as over Flower (trees packed and unpacked by :mod:`medpfl.deploy.wire`,
    so what crosses is exactly what Flower would carry). ``make_site(node, job, run_key)`` builds
    node ``node``'s site the first time it is asked; ``down``: nodes that do not answer."""

    def __init__(self, node_ids: list[int], make_site: Callable[[int, dict, str], Any]):
        self.node_ids = list(node_ids)
        self.make_site = make_site
        self.sites: dict[int, Any] = {}
        self.down: set[int] = set()
        self.bytes_sent = 0
        self.secure_rounds = 0

    def nodes(self) -> list[int]:
        return list(self.node_ids)

    def request(self, requests: dict[int, tuple[str, Any, dict]], timeout: float) -> dict[int, Any]:
        from medpfl.deploy.wire import pack, unpack

        out = {}
        for n, (kind, tree, cfg) in requests.items():
            if n in self.down:
                continue
            arrays, meta = pack(tree)
            self.bytes_sent += sum(a.nbytes for a in arrays.values())
            try:
                rtree, rcfg = handle(self._site(n, cfg), kind, unpack(arrays, meta), cfg)
            except Exception as e:  # noqa: BLE001 - a site's failure is its reply
                out[n] = e
                continue
            a2, m2 = pack(rtree)
            out[n] = (unpack(a2, m2), rcfg)
        return out

    def secure_train(self, requests: dict[int, tuple[Any, dict]], timeout: float, weights: dict[int, float],
                     max_weight: float, clip: float) -> tuple[list | None, dict[int, Any]]:
        """:class:`SecureTransport`'s round with an exact weighted mean in float64 standing in for
        SecAgg+ (no masking, no quantisation): what :class:`FlowerClients` gets is the same
        shape as over Flower, the mean and each site's metrics."""
        from medpfl.deploy.wire import pack, unpack

        total, sums, metrics = 0.0, None, {}
        for n, (tree, cfg) in requests.items():
            if n in self.down:
                continue
            arrays, meta = pack(tree)
            self.bytes_sent += sum(a.nbytes for a in arrays.values())
            try:
                leaves, met = secure_handle(self._site(n, cfg), unpack(arrays, meta), cfg, weights[n], max_weight, clip)
            except Exception as e:  # noqa: BLE001 - a site's failure is its reply
                metrics[n] = e
                continue
            w = float(weights[n])
            sums = [w * a for a in leaves] if sums is None else [s_ + w * a for s_, a in zip(sums, leaves)]
            total += w
            metrics[n] = met
        self.secure_rounds += 1
        return (None if sums is None else [s_ / total for s_ in sums]), metrics

    def _site(self, n: int, cfg: dict):
        if n not in self.sites:
            self.sites[n] = self.make_site(n, cfg["job"], cfg["run_key"])
        return self.sites[n]


def handle(site, kind: str, tree: Any, cfg: dict) -> tuple[Any, dict]:
    """One request at a site: ``(reply tree, reply config)`` (see :mod:`medpfl.deploy.site`)."""
    if kind == "hello":
        return {}, site.hello()
    if kind == "init":
        site.init(tree["params"], cfg["num_samples"], cfg["seed"])
        return {}, {}
    frm = {int(c): int(r) for c, r in cfg.get("from", {}).items()}
    if kind == "train":
        rnd = RoundInfo(**cfg["rnd"])
        down = Download(shared=tree["shared"], per_client=tree["per_client"], to_all=cfg["to_all"],
                        synced=tree["synced"])
        keep = {int(c): int(r) for c, r in cfg["keep_from"].items()}
        return site.train(down, [int(c) for c in cfg["trainers"]], rnd, frm, cfg["score_val"], keep)
    if kind == "evaluate":
        rnd = RoundInfo(**cfg["rnd"])
        gm = tree["global_model"] if cfg["global_model"] else None
        res = site.evaluate(tree["server"], rnd, frm, global_model=gm, personalized=cfg["personalized"],
                            val=cfg["val"], personalized_global=cfg["personalized_global"])
        return res, {}
    if kind == "finish":
        path = site.finish(tree["server"], frm)
        return {}, {"final_model": str(path) if path else ""}
    raise ValueError(f"unknown request {kind!r}")


def secure_handle(site, tree: Any, cfg: dict, weight: float, max_weight: float, clip: float
                  ) -> tuple[list[np.ndarray], dict[str, str]]:
    """A ``train`` request under secagg at a site holding one client: the same local program as
    :func:`handle` (state saved, upload checked against the spec before anything leaves), then
    the site's update leaves and metrics for the secure sum (:func:`medpfl.deploy.secagg.site_update`)."""
    from medpfl.deploy.secagg import site_update

    if len(cfg["trainers"]) != 1:
        raise DeploymentError(f"secagg: a site trains one client per round, asked for {cfg['trainers']}")
    reply = handle(site, "train", tree, cfg)
    return site_update(site.algo, tree["shared"], reply, weight, max_weight, clip, int(cfg["trainers"][0]))


def run_deployed(job: dict, arrays, samples, partition_table, out_dir, transport: Transport,
                 parent_file=None, timeout: float = 600.0, secagg: bool = False, secagg_clip: float | None = None
                 ) -> None:
    """One job on the sites behind ``transport``, end to end, with the outputs of ``medpfl
    train`` in ``out_dir`` (``records.parquet``, ``rounds.parquet`` with ``missing_clients``,
    ``job.json``, ``final_model.pt`` with the global model; checkpoints and resume) and, with
    ``parent_file``, an MLflow run under the study's parent tagged ``execution: flower``.

    The server reads ``arrays``/``samples``/``partition_table`` for the model's input shape and
    the global test set only; every client's training and evaluation runs at its site.
    ``secagg``: the model upload summed under SecAgg+ (:mod:`medpfl.deploy.secagg`; ``transport``
    must be a :class:`SecureTransport`), ``secagg_clip`` its clipping range.
    Raises DeploymentError when the sites do not cover the job's clients, ParamsError naming
    ``secagg`` for a method it cannot aggregate, and whatever ``medpfl train`` raises."""
    from pathlib import Path

    from medpfl.errors import ParamsError
    from medpfl.train import run_training

    t = job.get("train") or {}
    if t.get("upload") or t.get("dp"):
        raise ParamsError("train.upload / train.dp: not available in a deployment yet (the engine applies these "
                          "client-side transforms where the uploads arrive, which in a deployment is the server: the "
                          "server would see each site's raw update); remove them from the job")
    key = run_key(job)

    def factory(fdata, algo, train):
        if secagg:
            from medpfl.deploy.secagg import check_secagg

            check_secagg(algo, job["method"])
        return FlowerClients(transport, job, key, timeout=timeout, checkpointing=bool(train.checkpoint_every),
                             device=fdata.device, secagg=secagg, secagg_clip=secagg_clip)

    run_training(job, Path(arrays), Path(samples), Path(partition_table), Path(out_dir), parent_file,
                 clients_factory=factory,
                 extra_tags={"execution": "flower", **({"secagg": "secaggplus"} if secagg else {})})
