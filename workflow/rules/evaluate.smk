# Metrics of every run: the FedKPer paper's protocol and the plain views, logged to the run's
# MLflow child.


rule evaluate:
    input:
        records=f"{RUN_DIR}/records.parquet",
        rounds=f"{RUN_DIR}/rounds.parquet",
        job=f"{RUN_DIR}/job.json",
    output:
        metrics=f"{RUN_DIR}/metrics.json",
        per_round=f"{RUN_DIR}/round_metrics.csv",
        clients=f"{RUN_DIR}/client_accuracy.csv",
        curves=f"{RUN_DIR}/curves.png",
    params:
        code=code_hash("metrics.py", "evaluate.py"),
    resources:
        mem_mb=stage_mem_mb,
    log:
        f"{RUN_DIR}/evaluate.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl evaluate --run-dir $(dirname {output.metrics}) > {log} 2>&1"


rule eval_all:
    input:
        expand("{run}/metrics.json", run=run_dirs()),
