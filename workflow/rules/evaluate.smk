# Metrics of every run: the FedKPer paper's protocol and the plain views, logged to the run's
# MLflow child.


rule evaluate:
    input:
        records=RUN_DIR + "/records.parquet",
        rounds=RUN_DIR + "/rounds.parquet",
        job=RUN_DIR + "/job.json",
    output:
        metrics=RUN_DIR + "/metrics.json",
        per_round=RUN_DIR + "/round_metrics.csv",
        clients=RUN_DIR + "/client_accuracy.csv",
        curves=RUN_DIR + "/curves.png",
    params:
        code=code_hash("metrics.py", "evaluate.py"),
    log:
        RUN_DIR + "/evaluate.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl evaluate --run-dir $(dirname {output.metrics}) > {log} 2>&1"


rule eval_all:
    input:
        expand("{run}/metrics.json", run=run_dirs()),
