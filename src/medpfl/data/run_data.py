"""The data stages' jobs for a *data name*: the files a run reads (:meth:`medpfl.config.Params.data_name`).

A data name is a data set of ``data.datasets`` (its own files, as always), or, for a generated
data set with ``data.synthetic.<name>.seed_per_run: true``, ``<name>.gen<k>``: the same data set
drawn with generator seed ``k`` (``data.synthetic.<name>.seed + run seed - 1``). FedProx's
Synthetic(alpha, beta) generator (Li et al. 2020, "Federated Optimization in Heterogeneous
Networks", MLSys; :mod:`medpfl.data.fedprox_synthetic`) draws everything from one seed: the client
sizes, each client's model and feature distribution, its samples and its train/test split. A new
generator seed is therefore a new federation, and seeds that vary only training leave the data
set's own draw out of the spread over seeds.

The Snakefile (``workflow/rules/common.smk``) builds the download and preprocess jobs of every data
name here; the stages run unchanged: a ``.gen<k>`` name's job is its data set's job
(:func:`medpfl.data.sources.dataset_job`) with the generator seed replaced, so its files are
generated, preprocessed and partitioned as the data set's own, under their own paths
(``data/raw/<data name>.npz``, ``data/processed/<data name>.npz``, ``data/partitions/<data
name>/<partition>/``). A data set's own name gives exactly :func:`~medpfl.data.sources.dataset_job`
(and :func:`~medpfl.data.sources.download_job`): its stages' descriptions and files are unchanged.
"""

from __future__ import annotations

from medpfl.config import Params
from medpfl.data.sources import dataset_job, dataset_spec, download_job


def data_job(params: Params, name: str, download: bool = False) -> dict:
    """The preprocess job (``download``: the download job) of the data name ``name``: the data
    set's :func:`~medpfl.data.sources.dataset_job` (:func:`~medpfl.data.sources.download_job`),
    with ``synthetic.seed`` set to the name's generator seed for a ``.gen<k>`` name. ``dataset``
    stays the data set's name (the stages read the generator's alpha and beta from it). Raises
    :class:`medpfl.errors.ParamsError` for a ``.gen<k>`` name that no run of the study reads
    (:meth:`~medpfl.config.Params.resolve_data_name`)."""
    dataset, generator_seed = params.resolve_data_name(name)
    job = (download_job if download else dataset_job)(params, dataset)
    if generator_seed is not None:
        job["synthetic"] = {**job["synthetic"], "seed": generator_seed}
    return job


def raw_filename(params: Params, name: str) -> str:
    """The raw file of the data name ``name`` under ``data/raw/``: its data set's
    (:attr:`~medpfl.data.sources.DatasetSpec.raw_filename`, e.g. ``synthetic_0.5_0.5.npz``) with
    the data set's name replaced by ``name`` (``synthetic_0.5_0.5.gen1.npz``)."""
    dataset, _ = params.resolve_data_name(name)
    job = dataset_job(params, dataset)
    raw = dataset_spec(job["dataset"], job["custom"] or None, job.get("synthetic")).raw_filename
    if name != dataset:
        if not raw.startswith(dataset):  # a generated set's raw file is <name>.npz (DatasetSpec.raw_filename)
            raise ValueError(f"{name}: the raw file {raw!r} of {dataset!r} does not start with its name")
        raw = name + raw[len(dataset):]
    return raw
