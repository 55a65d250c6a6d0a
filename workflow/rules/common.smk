# Helpers shared by the rule files. Parameters are validated here, once, before any job runs;
# a typo in params.yaml or an overlay fails with the dotted key's name.
import shlex
import shutil
from pathlib import Path

from medpfl.compose import validate_params
from medpfl.config import canonical_json, partition_job, train_job
from medpfl.data.sources import dataset_job
from medpfl.io import tree_hash

PARAMS = validate_params(config, "params.yaml (with any --configfile overlays)")
STUDY = PARAMS.study
ROOT = Path(workflow.basedir)
HAS_GPU = shutil.which("nvidia-smi") is not None


def gpu_jobs():
    """N of ``--resources gpu=N`` (the default profile gives 1) on a machine with a GPU, else 1:
    how many training jobs run at once, each on its own GPU (medpfl.gpus picks which)."""
    if not HAS_GPU:
        return 1
    limit = workflow.global_resources.get("gpu")
    value = getattr(limit, "value", limit)
    return value if isinstance(value, int) and value > 0 else 1


# Threads per training job (Snakemake runs as many jobs at once as cores allow). Measured on
# the default study (2 cores, cnn4): one 2-thread job at a time and two 1-thread jobs in
# parallel train at the same rate, and the former leaves no lone 1-thread job at the end.
# With --resources gpu=N the cores are split over the N GPU jobs, so N of them fit at once.
TRAIN_THREADS = max(1, min(int(workflow.cores or 1) // gpu_jobs(), 8))


wildcard_constraints:
    dataset=r"[A-Za-z0-9][A-Za-z0-9_.+-]*",
    partition=r"[A-Za-z0-9][A-Za-z0-9_.+-]*",
    method=r"[A-Za-z0-9][A-Za-z0-9_.+-]*",
    seed=r"\d+",
    study=r"[A-Za-z0-9][A-Za-z0-9_.+-]*",


def q(obj):
    """Shell-quoted canonical JSON: the job description passed to `medpfl <stage> --job`."""
    return shlex.quote(canonical_json(obj))


def code_hash(*parts):
    """Content hash of package sources, so editing the code behind a stage re-runs it."""
    return tree_hash([ROOT / "src" / "medpfl" / p for p in parts])


def train_code_hash(wildcards):
    """The code behind one training job: the engine, the models, the CLI and its method's own
    modules (``method_sources``), so a new or edited method does not re-run the others."""
    from medpfl.algorithms import method_sources

    algorithm = PARAMS.method_config(wildcards.method)[0].name
    own = [ROOT / "src" / "medpfl" / "algorithms" / f.name for f in method_sources(algorithm)]  # this checkout's files
    return tree_hash([ROOT / "src" / "medpfl" / p for p in ("fl", "models", "train.py")] + own)


def dataset_json(wildcards):
    return q(dataset_job(PARAMS, wildcards.dataset))


def raw_file(wildcards):
    """data/raw/<dataset>.npz, or data/raw/<dataset>.tar.gz for a .tar.gz release (CIFAR)."""
    from medpfl.data.sources import dataset_spec

    job = dataset_job(PARAMS, wildcards.dataset)
    spec = dataset_spec(job["dataset"], job["custom"] or None, job.get("synthetic"))
    return f"data/raw/{spec.raw_filename}"


def partition_json(wildcards):
    return q(partition_job(PARAMS, wildcards.dataset, wildcards.partition))


def train_json(wildcards):
    return q(train_job(PARAMS, wildcards.dataset, wildcards.partition, wildcards.method, int(wildcards.seed)))


def study_json(wildcards):
    return q(PARAMS.study_dict())  # the partitions as their job_dict: existing reports keep their trigger


RUN_DIR = "results/{study}/runs/{dataset}/{partition}/{method}/seed{seed}"


def run_dirs():
    """One run folder per (dataset, partition) pair the study runs x method x seed."""
    return [
        RUN_DIR.format(study=STUDY, dataset=d, partition=p, method=m, seed=s)
        for d, p in PARAMS.dataset_partitions()
        for m in PARAMS.methods
        for s in PARAMS.seeds
    ]


def partition_outputs(name):
    return [f"data/partitions/{d}/{p}/{name}" for d, p in PARAMS.dataset_partitions()]


def partition_figures():
    """The partition heat maps, drawn outside the DVC-versioned data/partitions (data.smk)."""
    return [f"data/figures/{d}/{p}/heatmap.png" for d, p in PARAMS.dataset_partitions()]


def report_outputs():
    return expand(
        "results/{study}/report/{f}",
        study=STUDY,
        f=["table.md", "table.html", "summary.csv", "summary.json", "curves.png", "paired.csv"],
    )
