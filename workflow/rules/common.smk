# Helpers shared by the rule files. Parameters are validated here, once, before any job runs;
# a typo in params.yaml or an overlay fails with the dotted key's name.
import re
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

from medpfl.compose import validate_params
from medpfl.config import canonical_json, partition_job, train_job
from medpfl.data.run_data import data_job, raw_filename
from medpfl.data.sources import dataset_code_files
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


# Threads per training job. On this machine (Snakemake runs as many jobs at once as cores
# allow), measured on the default study (2 cores, cnn4): one 2-thread job at a time and two
# 1-thread jobs in parallel train at the same rate, and the former leaves no lone 1-thread job at
# the end. With --resources gpu=N the cores are split over the N GPU jobs, so N of them fit at
# once. On a cluster there are no local cores to split: each training job asks for
# CLUSTER_TRAIN_THREADS CPUs (--cpus-per-gpu, or --cpus-per-task without a GPU; profiles/slurm
# sets it, --set-threads train=N changes it). The executor is not known while the Snakefile is
# read, so "a cluster" is: no --cores (--executor slurm takes -j/--jobs) or a job step started
# by the cluster executor (exec mode remote). Both then compute the same value, so
# `medpfl train --threads` is the number of CPUs the job was given.
CLUSTER_TRAIN_THREADS = 4
ON_CLUSTER = workflow.remote_exec or workflow.resource_settings.cores is None
if ON_CLUSTER:
    TRAIN_THREADS = CLUSTER_TRAIN_THREADS
else:
    TRAIN_THREADS = max(1, min(int(workflow.cores or 1) // gpu_jobs(), 8))


# Cluster resources of a training job (used by --executor slurm as --mem and --time; a local run
# ignores them unless --resources mem_mb=... limits it). Both grow with the attempt, so a job
# killed for its memory or time limit is resubmitted (--retries) with more, and resumes from its
# checkpoint.
#
# Memory (MB) = 4096 + 16 x the inputs' size (MB), rounded up to 1024. Basis: the measured peak
# resident set of CPU training runs (rounds.parquet peak_memory_bytes) is 0.7-1.5 GB with 40-55 MB
# of processed data (BloodMNIST cnn4, MNIST mlp/mlr); a CUDA process holds another 1-3 GB of host
# memory for the CUDA libraries; the data are uint8 on disk and float32 in memory (x4), with room
# for a second copy while they move to the device and the clients' views.
TRAIN_MEM_BASE_MB = 4096
TRAIN_MEM_PER_INPUT_MB = 16

# Runtime (minutes) = 20 + rounds x (round seconds + 10) / 60, capped at TRAIN_RUNTIME_CAP_MIN, where
# round seconds = clients per round x local epochs x (processed MB / clients) x TRAIN_COST[model]:
# the data a round trains on (each sampled client holds 1/K of the data set on average) times
# the model's seconds per MB of processed data per epoch. TRAIN_COST is 4-5 x what one CPU thread
# took in our archived runs (2-core AMD EPYC VM): cnn4 on BloodMNIST 1.1 s/MB (22 s a round of 2
# clients x 5 epochs x 2 MB), mlp 0.007 and mlr 0.002 s/MB on MNIST; a GPU is faster. The other
# models were not measured: 20 s/MB, 4 x cnn4's margin. 10 s a round covers the evaluation.
# A run longer than the cap is stopped by SLURM at the cap and resumed by the next attempt from
# its last checkpoint (train.checkpoint_every), so it finishes within --retries + 1 attempts only
# when it checkpoints; raise the cap with --set-resources train:runtime=<minutes>.
TRAIN_COST = {"mlr": 0.01, "mlp": 0.05, "cnn4": 5.0, "cnn4bn": 5.0, "simplecnn": 5.0}
TRAIN_COST_OTHER = 20.0
TRAIN_RUNTIME_CAP_MIN = 24 * 60


# Memory (MB) of the other stages on a cluster (preprocess, partition, partition figure, evaluate,
# report): attempt x max(2048, 1024 + 8 x the inputs' MB). Basis: their measured peak resident
# sets on the tests' small study are 150-490 MB (report the largest), BloodMNIST's processed data
# is 40 MB on disk; Snakemake's own default (2 x inputs, at least 1000 MB) is too close to the
# report's peak.
def stage_mem_mb(wildcards, input, attempt):
    """Memory of a data, evaluation or report job in MB: ``attempt`` x max(2048, 1024 + 8 x the
    size of its inputs in MB)."""
    return attempt * max(2048, 1024 + 8 * int(input.size_mb))


def train_mem_mb(wildcards, input, attempt):
    """Memory of one training job in MB (see TRAIN_MEM_BASE_MB): ``attempt`` x (4096 + 16 x the
    size of its inputs in MB), rounded up to a multiple of 1024."""
    mb = TRAIN_MEM_BASE_MB + TRAIN_MEM_PER_INPUT_MB * input.size_mb
    return attempt * 1024 * -(-int(mb) // 1024)


def train_runtime(wildcards, input, attempt):
    """Runtime limit of one training job in minutes (see TRAIN_COST): ``attempt`` x the estimate
    from its job's rounds, clients per round, local epochs, model and data size, at most
    TRAIN_RUNTIME_CAP_MIN."""
    job = train_job(PARAMS, wildcards.dataset, wildcards.partition, wildcards.method, int(wildcards.seed))
    train, clients = job["train"], job["num_clients"]
    per_round = max(1, int(train["participation"] * clients)) * train["local_epochs"]
    per_round *= input.size_mb / clients * TRAIN_COST.get(train["model"], TRAIN_COST_OTHER)
    minutes = 20 + train["rounds"] * (per_round + 10) / 60
    return min(TRAIN_RUNTIME_CAP_MIN, int(attempt * minutes) + 1)


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


def data_code_hash(stage):
    """The code behind one data set's ``stage`` (preprocess or partition): the generic data files
    plus, for a folder data set's preprocess, its own reader module only
    (medpfl.data.sources.dataset_code_files), so adding or editing one reader re-runs no other
    data set (and no MedMNIST preprocess or archived study)."""

    def hash_of(wildcards):
        custom = {n: c.model_dump() for n, c in PARAMS.data.custom.items()}
        files = dataset_code_files(wildcards.dataset, stage, custom)
        return tree_hash([ROOT / "src" / "medpfl" / "data" / f for f in files])

    return hash_of


def train_code_hash(wildcards):
    """The code behind one training job: the engine, the models, the CLI and its method's own
    modules (``method_sources``), so a new or edited method does not re-run the others."""
    from medpfl.algorithms import method_sources

    algorithm = PARAMS.method_config(wildcards.method)[0].name
    own = [ROOT / "src" / "medpfl" / "algorithms" / f.name for f in method_sources(algorithm)]  # this checkout's files
    return tree_hash([ROOT / "src" / "medpfl" / p for p in ("fl", "models", "train.py")] + own)


# In the data rules the {dataset} wildcard is a data name (PARAMS.data_name): a data set of
# data.datasets, or <data set>.gen<k>, a generated data set drawn with generator seed k for the
# runs of one seed (data.synthetic.<name>.seed_per_run; medpfl.data.run_data).
def dataset_json(wildcards):
    return q(data_job(PARAMS, wildcards.dataset))


def download_json(wildcards):
    """The download job: dataset_json without a folder data set's options (limit, tokenizer)."""
    return q(data_job(PARAMS, wildcards.dataset, download=True))


def raw_file(wildcards):
    """data/raw/<dataset>.npz, or data/raw/<dataset>.tar.gz for a .tar.gz release (CIFAR), or
    data/raw/<dataset>.manifest.json for a folder data set (ptbxl, ...: the files stay in the mirror)."""
    return f"data/raw/{raw_filename(PARAMS, wildcards.dataset)}"


def partition_json(wildcards):
    return q(partition_job(PARAMS, wildcards.dataset, wildcards.partition))


def train_json(wildcards):
    return q(train_job(PARAMS, wildcards.dataset, wildcards.partition, wildcards.method, int(wildcards.seed)))


def run_data(wildcards):
    """The data files of one training job: those of its data name (PARAMS.data_name: the data
    set's own, or for data.synthetic.<name>.seed_per_run and a run seed other than 1, the data set
    drawn with that seed's generator seed)."""
    name = PARAMS.data_name(wildcards.dataset, int(wildcards.seed))
    return {
        "arrays": f"data/processed/{name}.npz",
        "samples": f"data/processed/{name}.samples.parquet",
        "table": f"data/partitions/{name}/{wildcards.partition}/partition.parquet",
    }


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
    """``name`` (partition.parquet, ...) of every partition the runs read, on every data name
    (PARAMS.data_names: with seed_per_run, one generated data set per generator seed)."""
    return [f"data/partitions/{d}/{p}/{name}" for d, p in PARAMS.data_names()]


def partition_figures(every_data_name=False):
    """The partition heat maps, drawn outside the DVC-versioned data/partitions (data.smk): of the
    data sets' own partitions (the report's), or with ``every_data_name`` of every data name."""
    pairs = PARAMS.data_names() if every_data_name else PARAMS.dataset_partitions()
    return [f"data/figures/{d}/{p}/heatmap.png" for d, p in pairs]


def report_outputs():
    return expand(
        "results/{study}/report/{f}",
        study=STUDY,
        f=["table.md", "table.html", "summary.csv", "summary.json", "curves.png", "paired.csv"],
    )


# train.stack_seeds (train_seeds in train.smk): every seed of a method in one job, on the data
# sets whose seeds share one data set (not data.synthetic.<name>.seed_per_run)
STACK_SEEDS = PARAMS.train.stack_seeds and len(PARAMS.seeds) > 1
STACK_DIR = "results/{study}/runs/{dataset}/{partition}/{method}"
STACKABLE_DATA = sorted({d for d, _ in PARAMS.dataset_partitions() if len({PARAMS.data_name(d, s) for s in PARAMS.seeds}) == 1})


def _seed(wildcards, seed):
    """``wildcards`` with the seed of a per-seed rule (what train_json, run_data read)."""
    return SimpleNamespace(**dict(wildcards.items()), seed=str(seed))


def stack_seed_data(wildcards):
    """The data files every seed of the stack trains on (those of its first seed: shared)."""
    return run_data(_seed(wildcards, PARAMS.seeds[0]))


def stack_seed_outputs(name):
    """One output path per seed of the study: the run folder's ``name``."""
    return [f"{STACK_DIR}/seed{s}/{name}" for s in PARAMS.seeds]


def stack_seed_args(wildcards, output):
    """``--job J --out-dir D`` per seed, in seed order (medpfl train: several jobs stack)."""
    return " ".join(f"--job {train_json(_seed(wildcards, s))} --out-dir {shlex.quote(str(Path(rec).parent))}"
                    for s, rec in zip(PARAMS.seeds, output.records))


def stack_seed_runtime(wildcards, input, attempt):
    """One seed's runtime estimate (train_runtime) x the seeds (a CPU bound; far less on a GPU)."""
    one = train_runtime(_seed(wildcards, PARAMS.seeds[0]), input, attempt)
    return min(TRAIN_RUNTIME_CAP_MIN, one * len(PARAMS.seeds))


def stack_data_constraint():
    """The {dataset} wildcard constraint of train_seeds (train.smk), the data sets it may stack."""
    return "|".join(map(re.escape, STACKABLE_DATA)) or "^$"
