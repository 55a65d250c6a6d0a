# download -> preprocess -> partition
# {dataset} is a data name (common.smk, PARAMS.data_name): a data set, or a generated one drawn
# with another generator seed for one run seed (<name>.gen<k>, data.synthetic.<name>.seed_per_run).


# On a cluster the download runs on the submitting machine (compute nodes often have no internet).
localrules:
    download,


# The raw file keeps the release's format: data/raw/<dataset>.npz, or .tar.gz for the CIFAR
# archives; a folder data set (ptbxl, ...) is not copied: its raw file is the manifest of its
# verified official root in a mirror folder, .manifest.json (raw_file(): DatasetSpec.raw_filename).
rule download:
    output:
        "data/raw/{dataset}.{ext}",
    wildcard_constraints:
        ext=r"npz|tar\.gz|manifest\.json",
    params:
        job=download_json,
    log:
        "logs/download/{dataset}.{ext}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl download --job {params.job} --out {output} > {log} 2>&1"


rule preprocess:
    input:
        raw_file,
    output:
        arrays="data/processed/{dataset}.npz",
        samples="data/processed/{dataset}.samples.parquet",
    params:
        job=dataset_json,
        code=data_code_hash("preprocess"),
    resources:
        mem_mb=stage_mem_mb,
    log:
        "logs/preprocess/{dataset}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl preprocess --job {params.job} --raw {input} --out {output.arrays} "
        "--samples {output.samples} > {log} 2>&1"


rule partition:
    input:
        arrays="data/processed/{dataset}.npz",
        samples="data/processed/{dataset}.samples.parquet",
    output:
        table="data/partitions/{dataset}/{partition}/partition.parquet",
        stats="data/partitions/{dataset}/{partition}/client_stats.json",
    params:
        job=partition_json,
        code=data_code_hash("partition"),
    resources:
        mem_mb=stage_mem_mb,
    log:
        "logs/partition/{dataset}/{partition}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl partition --job {params.job} --arrays {input.arrays} --samples {input.samples} "
        "--out-dir $(dirname {output.table}) > {log} 2>&1"


# The figure is not data: its pixels depend on the machine's rendering, so it lives outside the
# DVC outs (data/figures/, git-ignored) and nothing but the report reads it (docs/pipeline.md).
rule partition_figure:
    input:
        "data/partitions/{dataset}/{partition}/client_stats.json",
    output:
        report(
            "data/figures/{dataset}/{partition}/heatmap.png",
            caption="../report/partition.rst",
            category="Study setup",
            subcategory="Partitions",
            labels={"dataset": "{dataset}", "partition": "{partition}", "figure": "samples per class and client"},
        ),
    params:
        code=code_hash("report/partition_figure.py"),
    resources:
        mem_mb=stage_mem_mb,
    log:
        "logs/partition_figure/{dataset}/{partition}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl partition-figure --stats {input} --out {output} > {log} 2>&1"


rule data_all:
    input:
        partition_outputs("partition.parquet"),
        partition_figures(every_data_name=True),
