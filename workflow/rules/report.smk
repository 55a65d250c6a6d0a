# Tables and figures across methods (mean +- 95 % CI over seeds, FedKPer Table 1 shape, paired
# comparisons with report.reference); the study's resolved params and the tables are logged to
# the MLflow parent run.


rule report:
    input:
        metrics=expand("{run}/metrics.json", run=run_dirs()),
        per_round=expand("{run}/round_metrics.csv", run=run_dirs()),
        figures=partition_figures(),
        parent=ancient("results/{study}/mlflow_parent.json"),
        paper=[PARAMS.report.paper_table] if PARAMS.report.paper_table else [],
    # In Snakemake's report (snakemake --report): category "Results" (sorted before "Study setup"),
    # one caption and labels per file; workflow/report/workflow.rst links to each.
    output:
        table=report(
            "results/{study}/report/table.md",
            caption="../report/table.rst",
            category="Results",
            subcategory="Tables",
            labels={"study": "{study}", "result": "all tables", "format": "Markdown"},
        ),
        html=report(
            "results/{study}/report/table.html",
            caption="../report/table.rst",
            category="Results",
            subcategory="Tables",
            labels={"study": "{study}", "result": "all tables and figures", "format": "HTML page"},
        ),
        summary="results/{study}/report/summary.csv",
        metrics="results/{study}/report/summary.json",
        paired=report(
            "results/{study}/report/paired.csv",
            caption="../report/paired.rst",
            category="Results",
            subcategory="Tables",
            labels={"study": "{study}", "result": "paired comparison", "format": "CSV"},
        ),
        curves=report(
            "results/{study}/report/curves.png",
            caption="../report/curves.rst",
            category="Results",
            subcategory="Figures",
            labels={"study": "{study}", "result": "accuracy per round", "format": "PNG"},
        ),
    params:
        runs=run_dirs(),
        study=study_json,
        code=code_hash("report"),
        paper=f"--paper-table {PARAMS.report.paper_table}" if PARAMS.report.paper_table else "",
        reference=f"--reference {PARAMS.report.reference}" if PARAMS.report.reference else "",
    resources:
        mem_mb=stage_mem_mb,
    log:
        "logs/report/{study}.log",
    conda:
        "../envs/medpfl.yaml"
    shell:
        "medpfl report --runs {params.runs} --partition-figures {input.figures} "
        "--out-dir $(dirname {output.table}) --title 'medpfl study {wildcards.study}' "
        "--parent {input.parent} --study-params {params.study} "
        "{params.paper} {params.reference} > {log} 2>&1"


rule report_all:
    input:
        report_outputs(),
