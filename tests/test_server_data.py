"""Server data as part of the partition (``partitions.<name>.server_data``): drawn from the official
val split, in no client, stored as ``client_id = -1`` / ``local_split = "server"`` rows, exposed as
``FederatedData.server_idx``; a partition without it is exactly what it was."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from medpfl.compose import validate_params
from medpfl.config import ParamsError, partition_config
from medpfl.data.partition import PartitionError, build_partition, client_class_counts, partition_pool
from medpfl.data.schemas import PartitionTable, SharedPartitionTable, TableError, validate
from medpfl.fl.data import FederatedData


def _build(processed, **cfg):
    cfg = partition_config(**{"num_clients": 4, "alpha": 0.5, **cfg})
    pool = partition_pool(processed.samples, cfg)
    val = processed.samples[processed.samples["split"] == "val"]
    return build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "p",
                           val=(val["sample_id"].to_numpy(), val["label"].to_numpy()))


def test_server_rows_come_from_val_and_leave_the_clients_unchanged(synthetic_processed):
    s = synthetic_processed.samples
    plain = _build(synthetic_processed)
    with_server = _build(synthetic_processed, server_data={"fraction": 0.5})
    server = with_server[with_server["local_split"] == "server"]
    assert (server["client_id"] == -1).all() and len(server) == 20  # floor(0.5 * 40)
    val = s[s["split"] == "val"]
    assert set(server["sample_id"]) <= set(val["sample_id"])
    labels = dict(zip(s["sample_id"], s["label"]))
    assert (server["label"].to_numpy() == [labels[i] for i in server["sample_id"]]).all()
    # pool train: the clients' rows are those of the partition without server data
    pd.testing.assert_frame_equal(with_server[with_server["client_id"] >= 0].reset_index(drop=True), plain)
    assert (with_server["client_id"].iloc[-20:] == -1).all()  # after every client's rows
    assert client_class_counts(with_server, 4) == client_class_counts(plain, 4)
    counted = _build(synthetic_processed, server_data={"count": 7})
    assert (counted["local_split"] == "server").sum() == 7


def test_pool_all_removes_the_server_samples_before_partitioning(synthetic_processed):
    t = _build(synthetic_processed, pool="all", server_data={"count": 30})
    server = t.loc[t["local_split"] == "server", "sample_id"]
    clients = t.loc[t["client_id"] >= 0, "sample_id"]
    assert len(server) == 30 and not set(server) & set(clients)
    assert len(t) == len(synthetic_processed.samples)  # every sample once: 30 at the server, the rest in clients
    validate(PartitionTable, t, "t")


def test_shared_scheme_keeps_the_server_out_of_every_client(synthetic_processed):
    t = _build(synthetic_processed, scheme="per_client_dirichlet", size_start=40, size_stop=80, pool="all",
               server_data={"count": 10})
    validate(SharedPartitionTable, t, "t")
    server = set(t.loc[t["local_split"] == "server", "sample_id"])
    assert len(server) == 10 and not server & set(t.loc[t["client_id"] >= 0, "sample_id"])


def test_keys_are_validated_with_their_names(synthetic_processed):
    with pytest.raises(ValidationError, match="exactly one of fraction"):
        partition_config(server_data={"fraction": 0.5, "count": 3})
    with pytest.raises(ValidationError, match="exactly one of fraction"):
        partition_config(server_data={"source": "val"})
    with pytest.raises(ValidationError, match="source"):
        partition_config(server_data={"source": "test", "count": 3})
    with pytest.raises(ParamsError, match=r"partitions\.p\.server_data\.fraction"):
        validate_params({"partitions": [{"name": "p", "server_data": {"fraction": 1.5}}]})
    with pytest.raises(PartitionError, match=r"partitions\.p\.server_data\.count=41 exceeds the 40"):
        _build(synthetic_processed, server_data={"count": 41})
    with pytest.raises(PartitionError, match=r"partitions\.p\.server_data\.fraction=0.01 keeps no sample"):
        _build(synthetic_processed, server_data={"fraction": 0.01})
    cfg = partition_config(num_clients=4, alpha=0.5, server_data={"count": 3})
    pool = partition_pool(synthetic_processed.samples, cfg)
    with pytest.raises(PartitionError, match=r"partitions\.p\.server_data: source 'val', but this data set has no"):
        build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, "p")


def test_a_partition_without_server_data_dumps_as_before():
    assert "server_data" not in partition_config().job_dict()
    assert partition_config(server_data={"count": 3}).job_dict()["server_data"] == {"source": "val",
                                                                                      "fraction": None, "count": 3}


def test_schema_ties_client_minus_one_to_the_server_split():
    bad = pd.DataFrame({"sample_id": [1, 2], "client_id": [-1, 0], "local_split": ["train", "server"],
                        "label": [0, 1]})
    with pytest.raises(TableError, match="server_rows"):
        validate(PartitionTable, bad, "t")


def test_federated_data_exposes_server_idx_and_rejects_overlap(synthetic_processed):
    t = _build(synthetic_processed, server_data={"count": 12})
    fd = FederatedData.build(synthetic_processed, t, torch.device("cpu"))
    expect = t.loc[t["local_split"] == "server", "sample_id"].to_numpy()
    assert fd.has_server_data and fd.server_idx.tolist() == expect.tolist()
    assert fd.num_clients == 4
    assert not any(torch.isin(fd.server_idx, c).any() for c in fd.client_train + fd.client_test)
    plain = FederatedData.build(synthetic_processed, _build(synthetic_processed), torch.device("cpu"))
    assert not plain.has_server_data and plain.server_idx.numel() == 0
    clash = t.copy()
    clash.loc[clash.index[-1], "sample_id"] = int(t.loc[t["client_id"] == 0, "sample_id"].iloc[0])
    with pytest.raises(ValueError, match="server samples"):
        FederatedData.build(synthetic_processed, clash, torch.device("cpu"))


def test_draw_is_seeded(synthetic_processed):
    a = _build(synthetic_processed, server_data={"count": 10})
    b = _build(synthetic_processed, server_data={"count": 10})
    c = _build(synthetic_processed, seed=2, server_data={"count": 10})
    ids = [x.loc[x["local_split"] == "server", "sample_id"].to_numpy() for x in (a, b, c)]
    assert np.array_equal(ids[0], ids[1]) and not np.array_equal(ids[0], ids[2])


def test_partition_stage_writes_server_rows_and_stats(tmp_path, capsys):
    import json

    from medpfl.cli import main
    from medpfl.data.preprocess import preprocess
    from medpfl.data.synthetic import write_synthetic_npz
    from medpfl.io import read_json, read_parquet

    write_synthetic_npz(tmp_path / "s.npz", 4, 3, 28, (200, 30, 40), seed=3)
    preprocess(tmp_path / "s.npz", tmp_path / "a.npz", tmp_path / "s.parquet", 4, 3)
    for name, extra in (("plain", {}), ("srv", {"server_data": {"source": "val", "count": 12}})):
        cfg = partition_config(num_clients=3, alpha=1.0, **extra).job_dict()
        job = json.dumps({"dataset": "s", "name": name, "config": cfg})
        assert main(["partition", "--job", job, "--arrays", str(tmp_path / "a.npz"), "--samples",
                     str(tmp_path / "s.parquet"), "--out-dir", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    assert "3 clients" in out and "server data 12 unlabeled samples" in out
    plain, srv = (read_parquet(tmp_path / n / "partition.parquet") for n in ("plain", "srv"))
    assert (srv["local_split"] == "server").sum() == 12
    pd.testing.assert_frame_equal(srv[srv["client_id"] >= 0].reset_index(drop=True), plain)
    stats = read_json(tmp_path / "srv" / "client_stats.json")
    assert sum(stats["server"]) == 12 and set(stats["clients"]) == {"0", "1", "2"}
    assert "server" not in read_json(tmp_path / "plain" / "client_stats.json")
