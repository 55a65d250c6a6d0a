# medpfl: download -> preprocess -> partition -> train (dataset x partition x method x seed)
#         -> evaluate -> report.  Run:  snakemake --cores all
# Parameters: params.yaml (DVC's params file too); studies in config/ are overlays:
#   snakemake --cores all --configfile config/fedkper-paper.yaml
from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/mlflow.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        report_outputs(),
