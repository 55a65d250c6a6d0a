"""The Flower apps: ``server_app`` (a Flower ``ServerApp``) and ``client_app`` (a ``ClientApp``).

The ServerApp runs :func:`medpfl.deploy.server.run_deployed` with a transport over Flower's
``Grid``; the ClientApp answers each request with a :class:`medpfl.deploy.site.Site` built from
the SuperNode's node config. There is no per-method code here: the method is the job's, built
at both ends from the same registry as ``medpfl train``.

Run config (``flwr run ... --run-config``; ``medpfl deploy run`` writes it), every path absolute:
``job`` (the ``medpfl train --job`` JSON file), ``arrays``, ``samples``, ``partition-table``
(the server's copy of the processed data set: the model's input shape and the global test
set), ``out-dir``, ``parent`` (the study's MLflow parent file, or empty), ``timeout`` (seconds a
round waits for the sites).

Node config (``flower-supernode --node-config``; ``medpfl deploy site`` writes it): ``arrays``,
``samples``, ``partition-table`` (the site's data: a study's partition for tests and demos, or
the site's own processed files), ``client-ids`` (comma-separated; empty: every client in the
site's partition table), ``state-dir`` (where the site keeps its clients' states),
``device`` (default ``cpu``).

Message types: ``query.hello``, ``query.init``, ``train``, ``evaluate``, ``query.finish``; every
message holds an ``ArrayRecord`` ``"arrays"`` (the tree's leaves, :mod:`medpfl.deploy.wire`) and
a ``ConfigRecord`` ``"meta"`` (the tree's structure and the request's config as JSON).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
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
MESSAGE_TYPES = {"hello": "query.hello", "init": "query.init", "train": "train", "evaluate": "evaluate",
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
    """:class:`medpfl.deploy.server.Transport` over a Flower ``Grid`` (the ServerApp's)."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self._group = 0

    def nodes(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def request(self, requests: dict[int, tuple[str, Any, dict]], timeout: float) -> dict[int, Any]:
        """Push one message per node, then pull replies every :data:`POLL_S` seconds until all
        have answered or ``timeout`` has passed (``Grid.send_and_receive`` polls every 3 s).
        Replies are matched to their node by the message they answer: an error the SuperLink
        itself sends (node offline, message expired) comes from node id 1, not the site."""
        self._group += 1
        order = list(requests.items())
        msgs = [Message(content=to_content(tree, cfg), dst_node_id=int(n), message_type=MESSAGE_TYPES[kind],
                        group_id=str(self._group), ttl=max(timeout, 60.0))
                for n, (kind, tree, cfg) in order]
        ids = list(self.grid.push_messages(msgs))
        node_of = {mid: int(n) for mid, (n, _) in zip(ids, order)}
        pending = set(ids)
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for rep in self.grid.pull_messages(list(pending)):
                mid = rep.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                n = node_of[mid]
                if rep.has_error():
                    out[n] = DeploymentError(f"[code {rep.error.code}] {rep.error.reason}")
                else:
                    out[n] = from_content(rep.content)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        # a node the SuperLink reports offline (code 5) did not answer: the round goes on without it
        return {n: r for n, r in out.items()
                if not (isinstance(r, DeploymentError) and str(r).startswith(f"[code {NODE_UNAVAILABLE}]"))}


# ----- the ServerApp --------------------------------------------------------------------------
server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    from medpfl.deploy.server import run_deployed

    cfg = context.run_config
    job = json.loads(Path(str(cfg["job"])).read_text())
    parent = str(cfg.get("parent", "") or "")
    run_deployed(job, cfg["arrays"], cfg["samples"], cfg["partition-table"], cfg["out-dir"], GridTransport(grid),
                 parent_file=Path(parent) if parent else None, timeout=float(cfg.get("timeout", 600)))


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


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    return _answer("train", msg, context)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return _answer("evaluate", msg, context)


@client_app.query("finish")
def _finish(msg: Message, context: Context) -> Message:
    return _answer("finish", msg, context)
