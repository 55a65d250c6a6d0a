"""The Flower apps: ``server_app`` (a Flower ``ServerApp``) and ``client_app`` (a ``ClientApp``).

The ServerApp runs :func:`medpfl.deploy.server.run_deployed` with a transport over Flower's
``Grid``; the ClientApp answers each request with a :class:`medpfl.deploy.site.Site` built from
the SuperNode's node config. There is no per-method code here: the method is the job's, built
at both ends from the same registry as ``medpfl train``.

Run config (``flwr run ... --run-config``; ``medpfl deploy run`` writes it), every path absolute:
``job`` (the ``medpfl train --job`` JSON file), ``arrays``, ``samples``, ``partition-table``
(the server's copy of the processed data set: the model's input shape and the global test
set), ``out-dir``, ``parent`` (the study's MLflow parent file, or empty), ``timeout`` (seconds a
round waits for the sites), ``secagg`` (bool: the model upload summed under SecAgg+,
:mod:`medpfl.deploy.secagg`), ``secagg-clip`` (its clipping range).

Node config (``flower-supernode --node-config``; ``medpfl deploy site`` writes it): ``arrays``,
``samples``, ``partition-table`` (the site's data: a study's partition for tests and demos, or
the site's own processed files), ``client-ids`` (comma-separated; empty: every client in the
site's partition table), ``state-dir`` (where the site keeps its clients' states),
``device`` (default ``cpu``).

Message types: ``query.hello``, ``query.init``, ``train.plain``, ``evaluate``, ``query.finish``;
every message holds an ``ArrayRecord`` ``"arrays"`` (the tree's leaves, :mod:`medpfl.deploy.wire`)
and a ``ConfigRecord`` ``"meta"`` (the tree's structure and the request's config as JSON).

With ``secagg``, a round's training runs through Flower's ``SecAggPlusWorkflow`` instead
(:meth:`GridTransport.secure_train`): its four stages are messages of type ``train`` exactly,
answered by the ClientApp's default train handler under ``secaggplus_mod``; the ``train``
request travels in the legacy ``FitIns`` (the tree's leaves as parameters, ``treespec``,
``dtypes`` and ``config`` as config strings) and the site answers with a legacy ``FitRes``: its
update leaves as parameters (masked by the mod before they leave), its weight as
``num_examples`` and its evaluation counts as the metric ``reply`` (JSON).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from medpfl.deploy.wire import dumps, pack, unpack
from medpfl.errors import DeploymentError

log = logging.getLogger(__name__)

#: seconds between two pulls of the replies
POLL_S = 0.25
#: Flower's error code for a message to a node the SuperLink regards as offline
NODE_UNAVAILABLE = 5
#: request kind -> Flower message type ("<category>" or "<category>.<action>")
MESSAGE_TYPES = {"hello": "query.hello", "init": "query.init", "train": "train.plain", "evaluate": "evaluate",
                 "finish": "query.finish"}


def to_content(tree: Any, config: dict) -> RecordDict:
    """A request or reply as a Flower ``RecordDict``."""
    arrays, meta = pack(tree)
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                       "meta": ConfigRecord({"treespec": meta["treespec"], "dtypes": json.dumps(meta["dtypes"]),
                                             "config": dumps(config)})})


def from_content(content: RecordDict) -> tuple[Any, dict]:
    """The inverse of :func:`to_content`: ``(tree on the CPU, config)``."""
    ar, meta = content["arrays"], content["meta"]
    arrays = {k: ar[k].numpy() for k in ar.keys()}
    tree = unpack(arrays, {"treespec": meta["treespec"], "dtypes": json.loads(meta["dtypes"])})
    return tree, json.loads(meta["config"])


class GridTransport:
    """:class:`medpfl.deploy.server.SecureTransport` over a Flower ``Grid`` (the ServerApp's);
    ``context``: the ServerApp's (SecAgg+ needs it)."""

    def __init__(self, grid: Grid, context: Context | None = None):
        self.grid = grid
        self.context = context
        self._group = 0

    def nodes(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def request(self, requests: dict[int, tuple[str, Any, dict]], timeout: float) -> dict[int, Any]:
        """Push one message per node, then pull replies every :data:`POLL_S` seconds until all
        have answered or ``timeout`` has passed (``Grid.send_and_receive`` polls every 3 s).
        Replies are matched to their node by the message they answer: an error the SuperLink
        itself sends (node offline, message expired) comes from node id 1, not the site."""
        self._group += 1
        msgs = [Message(content=to_content(tree, cfg), dst_node_id=int(n), message_type=MESSAGE_TYPES[kind],
                        group_id=str(self._group), ttl=max(timeout, 60.0))
                for n, (kind, tree, cfg) in requests.items()]
        out: dict[int, Any] = {}
        for n, rep in push_and_pull(self.grid, msgs, timeout):
            if not rep.has_error():
                out[n] = from_content(rep.content)
            elif rep.error.code != NODE_UNAVAILABLE:  # offline (code 5): it did not answer, the round goes on
                out[n] = DeploymentError(f"[code {rep.error.code}] {rep.error.reason}")
        return out

    def secure_train(self, requests: dict[int, tuple[Any, dict]], timeout: float, weights: dict[int, float],
                     max_weight: float, clip: float) -> tuple[list | None, dict[int, Any]]:
        """One round's training under SecAgg+ (``SecAggPlusWorkflow`` with a strategy that picks
        exactly these nodes and gives each its own ``FitIns``); see
        :class:`medpfl.deploy.server.SecureTransport`. What this process receives: public keys,
        encrypted shares, masked vectors, each site's weight and metrics, and the mean."""
        from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
        from flwr.server import ServerConfig
        from flwr.server.client_manager import SimpleClientManager
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.strategy import FedAvg
        from flwr.server.workflow import SecAggPlusWorkflow
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

        from medpfl.deploy.secagg import protocol_params

        if self.context is None:
            raise DeploymentError("secagg: the transport has no ServerApp context")
        self._group += 1
        cm = SimpleClientManager()
        proxies = {int(n): GridClientProxy(node_id=int(n), grid=self.grid, run_id=self.context.run_id)
                   for n in requests}
        for proxy in proxies.values():
            cm.register(proxy)
        fitins = {}
        for n, (tree, cfg) in requests.items():
            arrays, meta = pack(tree)
            cfg = {**cfg, "secagg": {"weight": float(weights[n]), "max_weight": float(max_weight), "clip": float(clip)}}
            fitins[int(n)] = FitIns(ndarrays_to_parameters([arrays[f"p{i}"] for i in range(len(arrays))]),
                                    {"treespec": meta["treespec"], "dtypes": json.dumps(meta["dtypes"]),
                                     "config": dumps(cfg)})

        class Picked(FedAvg):
            """These nodes, each with its own FitIns; keeps what the workflow hands back."""

            results: list = []

            def configure_fit(self, server_round, parameters, client_manager):
                return [(proxies[n], fitins[n]) for n in sorted(fitins)]

            def aggregate_fit(self, server_round, results, failures):
                Picked.results = list(results)
                return (results[0][1].parameters if results else None), {}

        n = len(requests)
        strategy = Picked(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0,
                          min_evaluate_clients=0)
        Picked.results = []
        lctx = LegacyContext(self.context, config=ServerConfig(num_rounds=1), strategy=strategy, client_manager=cm)
        lctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord([np.zeros(1, dtype=np.float32)])
        lctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: self._group,
                                                                       Key.START_TIME: time.time()})
        errors: dict[int, Exception] = {}
        SecAggPlusWorkflow(**protocol_params(n), max_weight=float(max_weight), clipping_range=float(clip),
                           timeout=timeout)(_FastGrid(self.grid, errors), lctx)
        out: dict[int, Any] = dict(errors)
        mean = None
        if Picked.results:
            mean = [np.asarray(a, dtype=np.float64) for a in parameters_to_ndarrays(Picked.results[0][1].parameters)]
            for proxy, res in Picked.results:
                out[int(proxy.node_id)] = {k: str(v) for k, v in res.metrics.items()}
        return mean, out


class _FastGrid:
    """The grid as SecAgg+ sees it: ``send_and_receive`` pulls every :data:`POLL_S` seconds
    (Flower's waits 3 s between pulls) and notes each node's error reply in ``errors`` (an
    offline node, code 5, is left out: it did not answer); everything else is the grid's."""

    def __init__(self, grid: Grid, errors: dict[int, Exception]):
        self._grid = grid
        self._errors = errors

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        out = []
        for n, rep in push_and_pull(self._grid, messages, 3600.0 if timeout is None else timeout):
            if not rep.has_error():
                out.append(rep)
            elif rep.error.code != NODE_UNAVAILABLE:  # the workflow drops the node either way
                self._errors.setdefault(n, DeploymentError(f"[code {rep.error.code}] {rep.error.reason}"))
        return out


def push_and_pull(grid: Grid, messages, timeout: float) -> list[tuple[int, Message]]:
    """Push ``messages``, then pull the replies every :data:`POLL_S` seconds until all have
    answered or ``timeout`` seconds have passed (``Grid.send_and_receive`` waits 3 s between
    pulls). Returns ``(destination node, reply)`` per reply: a reply is matched to its message by
    ``reply_to_message_id``, since an error the SuperLink itself sends (node offline, message
    expired) comes from node id 1, not the site."""
    messages = list(messages)
    ids = list(grid.push_messages(messages))
    dst = {mid: int(m.metadata.dst_node_id) for mid, m in zip(ids, messages)}
    pending, out = set(ids), []
    deadline = time.monotonic() + timeout
    while pending:
        for rep in grid.pull_messages(list(pending)):
            mid = rep.metadata.reply_to_message_id
            if mid in pending:
                pending.discard(mid)
                out.append((dst[mid], rep))
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return out


# ----- the ServerApp --------------------------------------------------------------------------
server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    from medpfl.deploy.server import run_deployed

    cfg = context.run_config
    job = json.loads(Path(str(cfg["job"])).read_text())
    parent = str(cfg.get("parent", "") or "")
    run_deployed(job, cfg["arrays"], cfg["samples"], cfg["partition-table"], cfg["out-dir"],
                 GridTransport(grid, context), parent_file=Path(parent) if parent else None,
                 timeout=float(cfg.get("timeout", 600)), secagg=_flag(cfg.get("secagg", False)),
                 secagg_clip=float(cfg.get("secagg-clip", 0) or 0) or None)


def _flag(v) -> bool:
    """A run-config boolean (``true``, or the strings "true"/"1")."""
    return v if isinstance(v, bool) else str(v).strip().lower() in ("true", "1", "yes")


# ----- the ClientApp --------------------------------------------------------------------------
client_app = ClientApp()
_SITES: dict[tuple, Any] = {}  # one Site per (run, node config) while this process lives


def _site(context: Context, cfg: dict):
    from medpfl.deploy.site import Site

    nc = context.node_config
    ids = str(nc.get("client-ids", "") or "").strip()
    clients = [int(c) for c in ids.replace(";", ",").split(",") if c.strip()] or None
    key = (cfg["run_key"], tuple(sorted(nc.items())))
    if key not in _SITES:
        missing = [k for k in ("arrays", "samples", "partition-table", "state-dir") if not nc.get(k)]
        if missing:
            raise DeploymentError(f"site: node config lacks {', '.join(missing)} (flower-supernode --node-config; "
                                  "see docs/deployment.md)")
        _SITES[key] = Site(cfg["job"], Path(str(nc["arrays"])), Path(str(nc["samples"])),
                           Path(str(nc["partition-table"])), clients, Path(str(nc["state-dir"])), cfg["run_key"],
                           device=str(nc.get("device", "cpu")))
    return _SITES[key]


def _answer(kind: str, msg: Message, context: Context) -> Message:
    from medpfl.deploy.server import handle

    tree, cfg = from_content(msg.content)
    rtree, rcfg = handle(_site(context, cfg), kind, tree, cfg)
    return Message(to_content(rtree, rcfg), reply_to=msg)


@client_app.query("hello")
def _hello(msg: Message, context: Context) -> Message:
    return _answer("hello", msg, context)


@client_app.query("init")
def _init(msg: Message, context: Context) -> Message:
    return _answer("init", msg, context)


@client_app.train("plain")
def _train(msg: Message, context: Context) -> Message:
    return _answer("train", msg, context)


@client_app.train(mods=[secaggplus_mod])
def _secure_train(msg: Message, context: Context) -> Message:
    """The ``train`` request under SecAgg+ (called by ``secaggplus_mod`` in its stage "collect
    masked vectors" only): the same local program as ``train.plain`` (state saved, the upload
    checked against the method's spec before anything is sent), then the site's update as a
    legacy ``FitRes``, which the mod masks before it leaves."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat

    from medpfl.deploy.server import secure_handle

    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    leaves = parameters_to_ndarrays(fitins.parameters)
    c = fitins.config
    tree = unpack({f"p{i}": a for i, a in enumerate(leaves)},
                  {"treespec": str(c["treespec"]), "dtypes": json.loads(str(c["dtypes"]))})
    cfg = json.loads(str(c["config"]))
    sa = cfg["secagg"]
    update, metrics = secure_handle(_site(context, cfg), tree, cfg, sa["weight"], sa["max_weight"], sa["clip"])
    log.info("secagg: round %s, client %s: update of %d tensors handed to SecAgg+ (weight %g)",
             cfg["rnd"]["round"] + 1, cfg["trainers"][0], len(update), sa["weight"])
    fitres = FitRes(status=Status(Code.OK, "ok"), parameters=ndarrays_to_parameters(update),
                    num_examples=int(round(sa["weight"])), metrics=metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return _answer("evaluate", msg, context)


@client_app.query("finish")
def _finish(msg: Message, context: Context) -> Message:
    return _answer("finish", msg, context)
