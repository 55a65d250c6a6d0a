# One job per (dataset, partition, method, seed). The job description in params.job holds
# every value the run uses, so Snakemake re-runs exactly the jobs whose values changed.
# The run also writes final_model.pt beside its outputs (logged to MLflow, versioned with the run
# directory by DVC). It is not a declared output: no stage reads it, and a run restored from a
# study's git archive (scripts/study_archive.py: records, rounds, job) is complete without it.


rule train:
    # the data set's files, or with data.synthetic.<name>.seed_per_run those of the data set drawn
    # for this seed (run_data, common.smk); the same paths as always for every other run
    input:
        unpack(run_data),
        parent=ancient("results/{study}/mlflow_parent.json"),
    output:
        records=f"{RUN_DIR}/records.parquet",
        rounds=f"{RUN_DIR}/rounds.parquet",
        job=f"{RUN_DIR}/job.json",
    params:
        job=train_json,
        code=train_code_hash,
    threads: TRAIN_THREADS
    # gpu: 1 with a local GPU (profiles/slurm asks for it on a cluster); the rest is read by
    # --executor slurm only (common.smk): --mem, --time and, for a GPU job, --cpus-per-gpu.
    resources:
        gpu=1 if HAS_GPU else 0,
        mem_mb=train_mem_mb,
        runtime=train_runtime,
        cpus_per_gpu=lambda wildcards, threads: threads,
    log:
        f"{RUN_DIR}/train.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl train --job {params.job} --arrays {input.arrays} --samples {input.samples} "
        "--partition-table {input.table} --parent {input.parent} --out-dir $(dirname {output.records}) "
        "--threads {threads} > {log} 2>&1"


rule train_all:
    input:
        expand("{run}/records.parquet", run=run_dirs()),


# train.stack_seeds: one job per (dataset, partition, method) trains every seed of the study as
# one computation (medpfl.fl.seed_stack) and writes each seed's run folder, the same files as
# rule train (helpers in common.smk). A missing or out-of-date seed re-runs the whole stack (one
# job, all its outputs). Data drawn per seed (data.synthetic.<name>.seed_per_run) keep rule
# train: their seeds do not share one data set.
if STACK_SEEDS:
    ruleorder: train_seeds > train

    rule train_seeds:
        input:
            unpack(stack_seed_data),
            parent=ancient("results/{study}/mlflow_parent.json"),
        output:
            records=stack_seed_outputs("records.parquet"),
            rounds=stack_seed_outputs("rounds.parquet"),
            job=stack_seed_outputs("job.json"),
        wildcard_constraints:
            dataset=stack_data_constraint(),
        params:
            jobs=stack_seed_args,
            code=train_code_hash,
        threads: TRAIN_THREADS
        resources:
            gpu=1 if HAS_GPU else 0,
            mem_mb=train_mem_mb,
            runtime=stack_seed_runtime,
            cpus_per_gpu=lambda wildcards, threads: threads,
        log:
            f"{STACK_DIR}/train-seeds.log",
        conda:
            "../envs/medpfl.yaml"
        shell:
            "medpfl train {params.jobs} --arrays {input.arrays} --samples {input.samples} "
            "--partition-table {input.table} --parent {input.parent} --threads {threads} > {log} 2>&1"
