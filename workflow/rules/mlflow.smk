# One MLflow parent run per study, created before any training job starts (a fresh SQLite
# store migrated by parallel processes crashes). Depends only on the study name, so adding a
# method or editing a parameter keeps the parent and trains only what changed.

# On a cluster it runs on the submitting machine: one small job per study, not worth a queue wait.
localrules:
    mlflow_init,


rule mlflow_init:
    output:
        "results/{study}/mlflow_parent.json",
    params:
        experiment=PARAMS.mlflow.experiment,
    log:
        "logs/mlflow/{study}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl mlflow-init --study {wildcards.study} --experiment {params.experiment} "
        "--out {output} > {log} 2>&1"
