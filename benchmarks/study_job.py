"""Run a few rounds of one training job of a study config through ``medpfl.train`` in a
temporary folder, for the benchmarks that time the engine on a study's data (the study's data
stage must have run: ``snakemake data_all --cores all --configfile config/<study>.yaml``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd

from medpfl.compose import load_params
from medpfl.config import train_job
from medpfl.train import run_training

ROOT = Path(__file__).resolve().parents[1]


def run_study_job(config: str, dataset: str, partition: str, method: str, rounds: int,
                  root: Path = ROOT, **train: object) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(job, rounds.parquet, records.parquet) of ``rounds`` rounds of ``method`` (seed 1) in
    ``config/<config>.yaml`` on ``dataset``/``partition``, with ``train`` overriding the job's
    train section (no checkpoints). Raises FileNotFoundError when the data stage has not run."""
    params = load_params(root / "params.yaml", [root / "config" / f"{config}.yaml"])
    job = train_job(params, dataset, partition, method, 1)
    job["train"].update(rounds=rounds, checkpoint_every=0, **train)
    processed = root / "data" / "processed"
    with tempfile.TemporaryDirectory() as out:
        run_training(job, processed / f"{dataset}.npz", processed / f"{dataset}.samples.parquet",
                     root / "data" / "partitions" / dataset / partition / "partition.parquet", Path(out))
        return job, pd.read_parquet(Path(out) / "rounds.parquet"), pd.read_parquet(Path(out) / "records.parquet")
