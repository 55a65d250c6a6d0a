"""One site of a deployment: its own data, its client(s), their state on its own disk.

A site answers the server's requests (:mod:`medpfl.deploy.server`) with the simulator's own
client code: :class:`~medpfl.fl.clients.LocalClients` over the site's data with the sequential
executor, the method built from the job exactly as ``medpfl train`` builds it. What leaves the
site is the method's declared upload (checked against ``upload_spec()`` here, before sending),
the evaluation counts of its models, and its clients' local train sizes; the client state
(personal heads, control variates, personal models) and every personalized model stay here.

Requests (``kind``, a tree, a config dict) and replies are plain Python; :mod:`medpfl.deploy.app`
carries them over Flower.

* ``hello``: ``{"clients": [ids], "num_samples": [n per id], "num_classes": C, "has_val",
  "has_global_test", "data_md5"}``;
* ``init`` (tree: the initial model; config: ``num_samples`` of all K clients): each held
  client's state at round 0, written to disk (kept if it is there already: a resumed run);
* ``train`` (tree: the round's download, per-client rows for the trainers held here; config:
  the round, the trainers, the round each trainer's state was last written ``from``): the local
  programs; reply tree ``{"uploads", "test", "val"}``, config ``bad_state``;
* ``evaluate`` (tree: the server state; config: which views, ``from`` per held client): the
  evaluation counts;
* ``finish``: every held client's personalized model saved to ``final_model.pt`` here.

State files: ``<state_dir>/<run key>/client<c>/round<r>.pt`` (``r = -1``: the initial state),
written atomically; ``from`` picks the one to load, so a server that resumes from an older
checkpoint finds the state that matches it. Files older than the server's ``keep_from`` are
deleted.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig
from medpfl.data.partition import PartitionError
from medpfl.data.preprocess import load_processed
from medpfl.data.schemas import SharedPartitionTable, validate
from medpfl.errors import ParamsError
from medpfl.fl.clients import LocalClients, initial_client_state
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import resolve_device
from medpfl.fl.executors import SequentialExecutor
from medpfl.fl.functional import make_forward, template_on
from medpfl.fl.payload import check_upload
from medpfl.fl.program import Download, Federation, RoundInfo
from medpfl.fl.tree import first_nonfinite, tree_index, tree_map, tree_stack
from medpfl.io import atomic_path, md5sum, read_parquet
from medpfl.models.zoo import build_model_for_data

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")


def build_method(job: dict, fdata: FederatedData, device: torch.device):
    """``(algorithm instance, TrainConfig, EvalConfig)`` for ``job`` (the ``medpfl train --job``
    dict) on ``fdata``, built as the train stage builds it. Raises ParamsError naming the key."""
    train = TrainConfig.model_validate(job["train"])
    evalc = EvalConfig.model_validate(job["eval"])
    algo_cls, mcfg = resolve_method(job["method"], {job["method"]: {"algorithm": job["algorithm"],
                                                                    **job["method_params"]}})
    try:
        template = build_model_for_data(train.model, fdata, train.model_args)
    except ValueError as e:
        raise ParamsError(f"method {job['method']!r} on data set {job['dataset']!r}: {e}") from None
    algo = algo_cls(mcfg, make_forward(template_on(template, device)), fdata.num_classes)
    return algo, train, evalc


def load_site_data(job: dict, arrays: Path, samples: Path, partition_table: Path, device: torch.device,
                   transform=None) -> FederatedData:
    """The site's data: the processed arrays and the partition table (a study's, or the site's
    own with its client id(s) only), validated with the pipeline's schemas. Raises
    DataError/TableError naming the file."""
    data = load_processed(arrays, samples)
    table = validate(SharedPartitionTable, read_parquet(partition_table), str(partition_table))
    k = int(table["client_id"].max()) + 1
    if k > job["num_clients"]:
        raise PartitionError(f"{partition_table}: client ids up to {k - 1}, but the job has {job['num_clients']} "
                             "clients")
    return FederatedData.build(data, table, device, pool=job.get("pool", "train"), transform=transform)


def prepare_site_files(raw: Path, out: Path, client_id: int, num_classes: int, n_channels: int,
                       layout: str = "medmnist", val: bool = False) -> dict[str, Path]:
    """A site's own file in an official layout (``layout``: as ``data.custom``, e.g. the
    MedMNIST ``.npz`` with ``train_images``/``train_labels``/``test_*``/``val_*``) turned into
    what a SuperNode reads: ``arrays.npz`` + ``samples.parquet`` (:func:`medpfl.data.preprocess.
    preprocess`, validated as in the pipeline) and ``partition.parquet`` holding one client,
    ``client_id``: its official train split as its local train split, its test split as its local
    test split, and its val split as a local val split with ``val`` (else left out). Returns the
    three paths. Raises DataError naming ``raw`` on a file that is not in the layout."""
    from medpfl.data.preprocess import preprocess
    from medpfl.data.schemas import PartitionTable
    from medpfl.io import write_parquet

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"arrays": out / "arrays.npz", "samples": out / "samples.parquet", "partition-table": out / "partition.parquet"}
    samples = preprocess(raw, paths["arrays"], paths["samples"], num_classes, n_channels, layout=layout)
    keep = ("train", "test", "val") if val else ("train", "test")
    rows = samples[samples["split"].isin(keep)]
    table = pd.DataFrame({"sample_id": rows["sample_id"].to_numpy(), "client_id": int(client_id),
                          "local_split": rows["split"].to_numpy(), "label": rows["label"].to_numpy()})
    if not (table["local_split"] == "train").any():
        raise ParamsError(f"{raw}: no train samples: the site's client would have nothing to train on")
    write_parquet(paths["partition-table"], validate(PartitionTable, table, str(paths["partition-table"])))
    return paths


class Site:
    """The site's side of a deployed run (see the module docstring).

    job: the ``medpfl train --job`` dict the server sent; clients: the client ids this site
    holds (None: every client with rows in the partition table); state_dir: where client states
    live (created). Raises ParamsError when a held client has no local train samples or an id
    outside the job's clients."""

    def __init__(self, job: dict, arrays: Path, samples: Path, partition_table: Path, clients: list[int] | None,
                 state_dir: Path, run_key: str, device: str = "cpu"):
        self.job = job
        self.device = resolve_device(device)
        train = TrainConfig.model_validate(job["train"])
        self.data = load_site_data(job, Path(arrays), Path(samples), Path(partition_table), self.device,
                                   transform=train.transform)
        self.algo, self.train_cfg, self.evalc = build_method(job, self.data, self.device)
        k = self.data.num_clients
        if clients is None:
            clients = [c for c in range(k) if len(self.data.client_train[c]) or len(self.data.client_test[c])]
        for c in clients:
            if not 0 <= c < k or len(self.data.client_train[c]) == 0:
                raise ParamsError(f"site: client {c} has no local train samples in {partition_table}")
        self.clients = [int(c) for c in clients]
        self.executor = SequentialExecutor(self.data, self.train_cfg, int(job["seed"]), self.evalc.batch_size)
        self.local = LocalClients(self.data, self.executor, self.evalc.batch_size, only=self.clients)
        self.data_md5 = md5sum(Path(partition_table))[:12] + md5sum(Path(arrays))[:12]
        if not _SAFE.match(run_key):
            raise ValueError(f"site: run key {run_key!r} is not a plain name")
        self.root = Path(state_dir) / f"{run_key}-{self.data_md5}"
        self.root.mkdir(parents=True, exist_ok=True)

    # ----- state files ------------------------------------------------------------------------
    def _path(self, client: int, rnd: int) -> Path:
        return self.root / f"client{client}" / f"round{rnd}.pt"

    def _save(self, client: int, rnd: int, state: dict) -> None:
        p = self._path(client, rnd)
        p.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(p) as tmp:
            torch.save(tree_map(lambda t: t.cpu(), state), tmp)

    def _load(self, client: int, rnd: int) -> dict:
        p = self._path(client, rnd)
        if not p.exists():
            raise FileNotFoundError(f"site: no state of client {client} after round {rnd} in {p.parent} (was the "
                                    "site's state folder deleted, or does the server resume another run?)")
        return tree_map(lambda t: t.to(self.device), torch.load(p, map_location="cpu", weights_only=False))

    def _prune(self, keep_from: dict[int, int]) -> None:
        for c, r0 in keep_from.items():
            folder = self.root / f"client{c}"
            for f in folder.glob("round*.pt") if folder.exists() else []:
                if int(f.stem[5:]) < r0:
                    f.unlink(missing_ok=True)

    def _states(self, clients: list[int], from_rounds: dict[int, int]) -> dict:
        return tree_stack([self._load(c, from_rounds[c]) for c in clients])

    # ----- requests ---------------------------------------------------------------------------
    def hello(self) -> dict:
        """What the server learns about this site: its client ids, their local train sizes, the
        number of classes, whether its clients have val splits and it holds the global test set,
        and a fingerprint of its data files (to tell sites apart in logs)."""
        d = self.data
        return {"clients": self.clients, "num_samples": [int(len(d.client_train[c])) for c in self.clients],
                "num_classes": int(d.num_classes), "has_val": bool(any(len(d.client_val[c]) for c in self.clients)),
                "has_global_test": bool(len(d.global_test)), "data_md5": self.data_md5}

    def init(self, params: dict, num_samples: list[int], seed: int) -> None:
        """Each held client's round-0 state (``init_client_state``, seeded as in the simulator),
        written unless it exists (a restarted run keeps it)."""
        fed = Federation(num_clients=len(num_samples), num_samples=tuple(int(n) for n in num_samples),
                         num_classes=self.data.num_classes)
        for c in self.clients:
            if not self._path(c, -1).exists():
                self._save(c, -1, initial_client_state(self.algo, params, c, fed, seed))

    def train(self, down: Download, trainers: list[int], rnd: RoundInfo, from_rounds: dict[int, int],
              score_val: bool, keep_from: dict[int, int]) -> tuple[dict, dict]:
        """The held trainers' local programs for round ``rnd`` from their states after
        ``from_rounds[c]``; each new state written as ``round<rnd.round>``. Returns ``(tree,
        config)``: tree ``{"uploads": stacked [t], "test": counts, "val": counts or {}}``; config
        ``{"bad_state": "client 3: ['theta']['w']" or ""}``. Raises UploadSpecError when an
        upload is not what the method declares (nothing is sent then)."""
        lc = self.local
        lc.only = list(trainers)
        lc.states = self._states(trainers, from_rounds)
        out = lc.train_round(self.algo, down, np.asarray(trainers, dtype=np.int64), rnd, score_val)
        check_upload(self.algo.name, self.algo.upload_spec(), out.uploads, len(trainers))  # the privacy boundary
        bad = ""
        for j, c in enumerate(trainers):
            row = tree_index(out.states, j)
            found = first_nonfinite({"": row})
            if found is not None:
                bad = bad or f"client {c}: {found[1]}"
            else:
                self._save(c, rnd.round, row)
        lc.commit()
        self._prune(keep_from)
        tree = {"uploads": out.uploads, "test": out.test, "val": out.val if out.val is not None else {}}
        return tree, {"bad_state": bad}

    def evaluate(self, server: dict, rnd: RoundInfo, from_rounds: dict[int, int], *, global_model: Any,
                 personalized: bool, val: bool, personalized_global: bool) -> dict:
        """Evaluation counts for every held client (rows in :attr:`clients` order): ``{view:
        (correct, count, loss)}`` for the views asked for."""
        lc = self.local
        lc.only = list(self.clients)
        lc.states = self._states(self.clients, from_rounds) if personalized else {}
        res = lc.evaluate(self.algo, server, rnd, global_model=global_model, personalized=personalized, val=val,
                          personalized_global=personalized_global and len(self.data.global_test) > 0)
        return {k: v for k, v in vars(res).items() if v is not None}

    def finish(self, server: dict, from_rounds: dict[int, int]) -> Path | None:
        """Every held client's personalized model (where the method has them) in
        ``final_model.pt`` under the site's run folder; returns its path (None: no personal
        models)."""
        if not self.algo.personalized:
            return None
        lc = self.local
        lc.only = list(self.clients)
        lc.states = self._states(self.clients, from_rounds)
        pm = lc.personalized_models(self.algo, server)
        out = self.root / "final_model.pt"
        with atomic_path(out) as tmp:
            torch.save({"algorithm": self.job["algorithm"], "clients": self.clients,
                        "personalized": tree_map(lambda t: t.cpu(), pm)}, tmp)
        return out
