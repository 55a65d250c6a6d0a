"""pandera schemas for every table that crosses a stage boundary.

``validate(schema, df, path)`` raises :class:`TableError` naming the file and listing the
failing checks, instead of pandera's multi-page report.
"""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")

import pandas as pd  # noqa: E402
import pandera.pandas as pa  # noqa: E402
from pandera.typing import Series  # noqa: E402

from medpfl.errors import TableError  # noqa: F401  (defined in medpfl.errors; importable here as before)

SPLITS = ["train", "val", "test"]
# a client's local splits in a partition table: val only with the ``ratios`` local rule; "server":
# the server's unlabeled data (``partitions.<name>.server_data``), on rows with client_id -1
LOCAL_SPLITS = ["train", "test", "val", "server"]
SERVER_CLIENT = -1  # the client_id of the server's rows
NATURAL_SPLITS = ["train", "test"]  # the local splits a generated federated set gives its samples
VIEWS = ["global_test", "global_on_local", "local_after_training", "personalized_on_local", "local_on_global_test",
         "local_after_training_val", "global_on_val", "personalized_on_val"]


class SampleTable(pa.DataFrameModel):
    """One row per image of a preprocessed data set (``data/processed/<name>.samples.parquet``).

    A generated federated set (Synthetic(alpha, beta)) adds ``natural_client`` and
    ``natural_split``: the client and local split the generator gave each sample. A folder data
    set with subjects (patients: PTB-XL, ADFTD, ICBHI, SPRSound) adds ``subject_id`` (int64,
    the source's subject/patient id), which the ``subject`` partition scheme assigns whole.
    """

    sample_id: Series[int] = pa.Field(ge=0, unique=True)
    split: Series[str] = pa.Field(isin=SPLITS)
    index_in_split: Series[int] = pa.Field(ge=0)
    label: Series[int] = pa.Field(ge=0)
    natural_client: Optional[Series[int]] = pa.Field(ge=0)
    natural_split: Optional[Series[str]] = pa.Field(isin=NATURAL_SPLITS)
    subject_id: Optional[Series[int]] = pa.Field(ge=0)

    class Config:
        strict = True
        coerce = True
        unique = ["split", "index_in_split"]


class PartitionTable(pa.DataFrameModel):
    """One row per pool sample (the official train split, or every split with ``pool: all``):
    which client holds it and in which local split, ``train``, ``test`` or ``val`` (val only
    with the ``ratios`` local rule). With the ``official_test`` local rule the local test rows
    are official-test samples instead (``sample_id`` is unique across the sample table's
    splits, so ids never collide). With ``server_data`` the server's unlabeled samples (drawn
    from the official val split, in no client) are rows with ``client_id = -1`` and
    ``local_split = "server"``, after every client's rows."""

    sample_id: Series[int] = pa.Field(ge=0, unique=True)
    client_id: Series[int] = pa.Field(ge=SERVER_CLIENT)
    local_split: Series[str] = pa.Field(isin=LOCAL_SPLITS)
    label: Series[int] = pa.Field(ge=0)

    class Config:
        strict = True
        coerce = True

    @pa.dataframe_check
    def server_rows(cls, df: pd.DataFrame) -> Series[bool]:
        """client_id -1 exactly on the ``server`` rows."""
        return (df["client_id"] == SERVER_CLIENT) == (df["local_split"] == "server")


class SharedPartitionTable(pa.DataFrameModel):
    """A partition whose clients may share samples (``per_client_dirichlet``: each client is
    drawn from the whole pool): a sample id may appear under several clients, but at most once
    per client. The training stage reads every partition table with this schema (a disjoint
    table passes it too); disjointness is checked by the partition stage, per scheme. Server rows
    (``client_id = -1``, ``local_split = "server"``) as in :class:`PartitionTable`; a server
    sample is in no client (checked by the partition stage and again by the training stage)."""

    sample_id: Series[int] = pa.Field(ge=0)
    client_id: Series[int] = pa.Field(ge=SERVER_CLIENT)
    local_split: Series[str] = pa.Field(isin=LOCAL_SPLITS)
    label: Series[int] = pa.Field(ge=0)

    class Config:
        strict = True
        coerce = True
        unique = ["client_id", "sample_id"]

    @pa.dataframe_check
    def server_rows(cls, df: pd.DataFrame) -> Series[bool]:
        """client_id -1 exactly on the ``server`` rows."""
        return (df["client_id"] == SERVER_CLIENT) == (df["local_split"] == "server")


class EvalRecords(pa.DataFrameModel):
    """One row per (round, view, client): a model evaluated on a test set.

    view: ``global_test`` (global model, global test set; client_id -1),
    ``global_on_local`` (global model, each client's local test split),
    ``local_after_training`` (the model of a client that trained this round, right after local training, its local
    test split), ``personalized_on_local`` (each client's personalized model, its local test
    split), ``local_on_global_test`` (a client's own model on the global test set; Local only,
    final round). With validation splits in the partition, on evaluation rounds:
    ``local_after_training_val`` (the ``local_after_training`` models on the clients' validation
    splits: the FHBench protocol's model selection), ``global_on_val`` and ``personalized_on_val``.
    """

    round: Series[int] = pa.Field(ge=0)
    view: Series[str] = pa.Field(isin=VIEWS)
    client_id: Series[int] = pa.Field(ge=-1)
    n_samples: Series[int] = pa.Field(ge=1)
    correct: Series[int] = pa.Field(ge=0)
    accuracy: Series[float] = pa.Field(ge=0.0, le=1.0)
    balanced_accuracy: Series[float] = pa.Field(ge=0.0, le=1.0)
    loss: Series[float] = pa.Field(ge=0.0, nullable=True)

    class Config:
        strict = True
        coerce = True
        unique = ["round", "view", "client_id"]

    @pa.dataframe_check
    def correct_le_n(cls, df: pd.DataFrame) -> Series[bool]:
        return df["correct"] <= df["n_samples"]


class RoundLog(pa.DataFrameModel):
    """One row per round: the schedule, communication and timing."""

    round: Series[int] = pa.Field(ge=0, unique=True)
    lr: Series[float] = pa.Field(gt=0.0)
    sampled_clients: Series[str]
    num_sampled: Series[int] = pa.Field(ge=1)
    bytes_up: Series[int] = pa.Field(ge=0)
    bytes_down: Series[int] = pa.Field(ge=0)
    #: the same uploads counted dense (every compressed leaf at the size of the full tensor it
    #: encodes; bytes_up / bytes_up_dense is the round's compression ratio); absent in runs made
    #: before it was recorded, null in the earlier rounds of a run resumed from such a checkpoint
    bytes_up_dense: Optional[Series[pd.Int64Dtype]] = pa.Field(ge=0, nullable=True)
    train_seconds: Series[float] = pa.Field(ge=0.0)
    eval_seconds: Series[float] = pa.Field(ge=0.0)
    round_seconds: Series[float] = pa.Field(ge=0.0)
    #: the process's peak memory up to this round (CUDA: allocated tensors; CPU: RSS); absent in
    #: runs made before it was recorded, null in the earlier rounds of a run resumed from such a
    #: checkpoint
    peak_memory_bytes: Optional[Series[pd.Int64Dtype]] = pa.Field(ge=0, nullable=True)
    #: DP-FedAvg (``train.dp``): the privacy spent after this round, ε at the run's δ (opacus'
    #: accountant; ``medpfl.fl.privacy``); absent in runs without ``train.dp``
    epsilon: Optional[Series[float]] = pa.Field(ge=0.0, nullable=True)
    #: a deployment (``medpfl.deploy``): the client ids, space-separated, whose site did not answer
    #: this round's training or evaluation in time (empty: none); absent in simulated runs
    missing_clients: Optional[Series[str]] = pa.Field(nullable=True)

    class Config:
        strict = True
        coerce = True


def validate(schema: type[pa.DataFrameModel], df: pd.DataFrame, path: str = "<table>") -> pd.DataFrame:
    """Validate ``df`` lazily against ``schema``; raise :class:`TableError` naming ``path``."""
    try:
        return schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as e:
        fc = e.failure_cases
        lines = []
        for (col, check), grp in fc.groupby(["column", "check"], dropna=False, sort=False):
            examples = ", ".join(map(str, grp["failure_case"].head(3).tolist()))
            lines.append(f"  - column {col!s}: {check} (e.g. {examples}; {len(grp)} failing)")
        raise TableError(f"{path}: table does not match schema {schema.__name__}:\n" + "\n".join(lines)) from None
    except pa.errors.SchemaError as e:
        raise TableError(f"{path}: table does not match schema {schema.__name__}: {e}") from None
