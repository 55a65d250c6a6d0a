"""Writes the FedMIC study configs (config/fedmic-*.yaml) and the paper's result tables as data
(config/papers/fedmic-*.yaml). Run from anywhere: python scripts/make_fedmic_configs.py

The paper: Ren, Hu, Chen & Wang, "Federated Distillation for Medical Image Classification: Towards
Trustworthy Computer-Aided Diagnosis" (FedMIC; ../shared/papers/001_92e55b0ead3a5e3d.txt). Its
numbers are copied below, row by row, from ../shared/docs/methods-fedmic-pfpslwc.md A.12 (an exact
transcription of the paper's Tables 2-9); the setting is A.9-A.10 (docs/studies.md, FedMIC section,
lists every reading). tests/test_fedmic_studies.py checks that the committed files are this script's
output and the numbers against A.12.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ----- the paper's numbers (A.12, verbatim: "mean ± std" in %) -----------------------------------
# Tables 2-4: rows = methods, columns = Blood 10/30/50 %, Tissue 10/30/50 %, Organ2D 10/30/50 %,
# Organ3D 10/30/50 % (participation ratio).
T2_4 = {
    "0.1": """
FedAvg | 49.92 ± 1.86 | 58.12 ± 0.57 | 60.23 ± 1.71 | 44.37 ± 1.24 | 52.55 ± 1.95 | 58.75 ± 1.12 | 59.82 ± 0.33 | 64.05 ± 0.75 | 69.92 ± 0.17 | 55.17 ± 1.43 | 61.92 ± 0.04 | 62.35 ± 1.58
Local | 68.35 ± 1.93 | 88.32 ± 1.23 | 92.85 ± 0.39 | 57.49 ± 2.76 | 59.85 ± 0.64 | 66.61 ± 1.05 | 69.23 ± 1.37 | 76.42 ± 0.84 | 78.82 ± 2.14 | 68.47 ± 1.46 | 86.18 ± 1.61 | 88.79 ± 2.05
FedBN | 79.28 ± 1.47 | 82.45 ± 2.51 | 87.69 ± 0.09 | 58.55 ± 0.81 | 64.35 ± 2.26 | 67.82 ± 0.45 | 66.12 ± 1.11 | 71.49 ± 1.14 | 75.37 ± 1.87 | 58.24 ± 2.64 | 72.64 ± 0.87 | 76.18 ± 2.32
PerFedAvg | 77.81 ± 1.19 | 87.32 ± 0.93 | 90.55 ± 0.64 | 54.22 ± 1.68 | 60.88 ± 2.75 | 64.85 ± 0.51 | 63.47 ± 0.82 | 72.15 ± 0.23 | 74.28 ± 0.54 | 62.19 ± 1.96 | 78.74 ± 1.10 | 81.12 ± 0.37
FedBE | 81.24 ± 1.90 | 88.21 ± 0.88 | 89.07 ± 1.46 | 52.12 ± 1.13 | 63.43 ± 0.77 | 67.90 ± 2.10 | 63.64 ± 1.17 | 69.52 ± 1.27 | 74.22 ± 1.21 | 64.41 ± 1.37 | 78.55 ± 1.26 | 84.20 ± 1.21
FedALA | 81.79 ± 0.42 | 89.47 ± 0.61 | 91.26 ± 0.54 | 59.11 ± 0.58 | 64.00 ± 0.04 | 68.88 ± 0.17 | 65.47 ± 0.62 | 70.15 ± 1.47 | 76.02 ± 0.66 | 66.64 ± 1.07 | 76.31 ± 0.44 | 83.21 ± 1.62
FedMIC (Ours) | 92.13 ± 1.46 | 94.84 ± 0.27 | 95.11 ± 1.73 | 64.28 ± 0.78 | 69.90 ± 0.42 | 75.83 ± 1.12 | 70.21 ± 0.62 | 77.42 ± 0.19 | 85.55 ± 0.98 | 76.62 ± 1.46 | 87.18 ± 0.46 | 94.62 ± 0.99
""",
    "0.3": """
FedAvg | 51.85 ± 1.20 | 60.90 ± 0.66 | 63.09 ± 1.79 | 46.48 ± 0.52 | 56.64 ± 1.33 | 62.22 ± 0.85 | 61.93 ± 1.09 | 68.56 ± 0.97 | 71.91 ± 0.31 | 58.76 ± 1.50 | 65.36 ± 0.44 | 66.28 ± 0.76
Local | 72.57 ± 1.24 | 94.90 ± 0.95 | 95.78 ± 1.52 | 60.63 ± 0.25 | 67.16 ± 1.03 | 71.50 ± 0.89 | 75.57 ± 1.76 | 84.99 ± 0.42 | 82.99 ± 1.68 | 72.26 ± 0.57 | 93.39 ± 1.00 | 94.35 ± 0.83
FedBN | 82.46 ± 1.02 | 87.26 ± 0.23 | 93.29 ± 1.39 | 62.23 ± 0.17 | 70.43 ± 1.90 | 73.66 ± 0.56 | 70.45 ± 1.07 | 77.31 ± 1.68 | 82.00 ± 0.82 | 60.92 ± 1.57 | 80.68 ± 0.73 | 84.50 ± 0.48
PerFedAvg | 81.52 ± 0.12 | 90.94 ± 1.66 | 91.62 ± 0.77 | 58.90 ± 1.83 | 65.37 ± 1.21 | 70.48 ± 0.34 | 69.35 ± 1.45 | 81.08 ± 0.89 | 83.33 ± 0.58 | 70.39 ± 1.11 | 87.30 ± 0.99 | 87.74 ± 1.74
FedBE | 83.25 ± 0.56 | 89.62 ± 1.37 | 90.88 ± 0.85 | 62.52 ± 0.33 | 65.58 ± 1.94 | 74.90 ± 0.20 | 67.21 ± 1.26 | 73.80 ± 1.50 | 78.42 ± 0.65 | 67.91 ± 1.88 | 79.19 ± 0.91 | 85.23 ± 0.44
FedALA | 82.95 ± 1.57 | 89.63 ± 0.24 | 92.46 ± 1.32 | 64.03 ± 0.02 | 67.29 ± 0.75 | 70.69 ± 1.98 | 74.07 ± 0.37 | 74.62 ± 1.11 | 79.90 ± 0.90 | 70.69 ± 0.65 | 79.02 ± 1.79 | 85.13 ± 0.14
FedMIC (Ours) | 92.56 ± 1.27 | 96.84 ± 0.33 | 96.41 ± 1.90 | 66.12 ± 0.57 | 70.37 ± 1.64 | 77.27 ± 0.68 | 73.64 ± 1.02 | 80.12 ± 0.45 | 86.96 ± 1.78 | 79.21 ± 1.05 | 89.00 ± 0.12 | 95.85 ± 0.96
""",
    "0.5": """
FedAvg | 56.45 ± 1.34 | 64.48 ± 0.87 | 68.68 ± 1.12 | 47.26 ± 0.65 | 60.53 ± 1.56 | 63.32 ± 1.43 | 64.21 ± 0.98 | 74.99 ± 1.75 | 76.23 ± 0.29 | 59.08 ± 1.68 | 68.41 ± 0.52 | 71.23 ± 1.21
Local | 77.92 ± 1.03 | 96.18 ± 1.68 | 96.37 ± 0.86 | 65.69 ± 1.01 | 75.30 ± 1.29 | 76.48 ± 1.74 | 77.72 ± 0.58 | 86.28 ± 1.20 | 88.25 ± 1.02 | 77.65 ± 0.77 | 94.56 ± 1.31 | 95.21 ± 1.91
FedBN | 83.51 ± 1.94 | 89.52 ± 1.23 | 93.01 ± 1.41 | 67.13 ± 0.06 | 68.06 ± 1.11 | 73.68 ± 0.57 | 73.23 ± 1.12 | 76.28 ± 1.76 | 82.22 ± 0.98 | 71.92 ± 1.81 | 76.27 ± 1.27 | 83.93 ± 1.54
PerFedAvg | 82.30 ± 1.12 | 91.36 ± 0.68 | 91.55 ± 1.57 | 61.31 ± 0.99 | 68.23 ± 1.40 | 72.68 ± 1.15 | 71.95 ± 0.86 | 76.21 ± 1.34 | 81.77 ± 0.72 | 70.01 ± 1.08 | 80.55 ± 0.53 | 88.32 ± 1.66
FedBE | 84.12 ± 1.01 | 90.10 ± 1.87 | 91.94 ± 0.56 | 68.94 ± 1.18 | 69.20 ± 0.33 | 73.27 ± 1.90 | 68.45 ± 0.82 | 75.58 ± 1.60 | 81.79 ± 0.44 | 69.62 ± 1.35 | 80.38 ± 0.68 | 86.61 ± 1.75
FedALA | 84.20 ± 1.45 | 90.00 ± 0.88 | 92.99 ± 1.12 | 69.67 ± 0.64 | 70.60 ± 1.29 | 73.31 ± 0.73 | 75.33 ± 1.01 | 76.28 ± 0.92 | 82.62 ± 1.54 | 73.22 ± 0.46 | 81.27 ± 1.67 | 87.12 ± 0.53
FedMIC (Ours) | 93.42 ± 1.45 | 96.99 ± 1.21 | 97.97 ± 0.98 | 67.18 ± 0.62 | 73.12 ± 1.30 | 79.12 ± 1.88 | 74.49 ± 1.15 | 83.11 ± 0.89 | 89.24 ± 0.34 | 81.04 ± 1.73 | 89.48 ± 0.47 | 96.33 ± 1.60
""",
}
# Table 5 (GPD energy threshold α; at λ = 0.5, r = 10 %: its α = 0.98 row is Table 4's FedMIC at 10 %):
# columns BloodMNIST, TissueMNIST, OrganMNIST (2D), OrganMNIST (3D).
T5 = """
0.98 (default) | 93.42 ± 1.45 | 67.18 ± 0.62 | 74.49 ± 1.15 | 81.04 ± 1.73
0.90 | 92.11 ± 0.46 | 66.91 ± 0.18 | 73.59 ± 1.22 | 80.16 ± 0.21
0.92 | 92.49 ± 1.46 | 67.04 ± 0.82 | 73.26 ± 1.02 | 80.00 ± 1.72
0.95 | 91.21 ± 1.23 | 66.20 ± 0.12 | 74.04 ± 1.22 | 81.22 ± 0.40
"""
# Tables 6-8 (ablations at 10 % participation; λ = 0.1, 0.3, 0.5): columns as Table 5, then the
# communication ("11.49% of Complete Model Parameters Communication", 100 % for FedMIC-C).
T6_8 = {
    "0.1": """
FedMIC | 92.13 ± 1.46 | 64.28 ± 0.78 | 70.21 ± 0.62 | 76.62 ± 1.46 | 11.49%
FedMIC-A (no W_aux) | 90.44 ± 0.12 | 61.03 ± 0.45 | 66.92 ± 0.46 | 73.10 ± 0.63 | 11.49%
FedMIC-B (no rep-DDL) | 91.00 ± 0.42 | 60.21 ± 0.12 | 63.26 ± 1.12 | 70.82 ± 0.41 | 11.49%
FedMIC-C (no GPD) | 92.33 ± 0.42 | 65.29 ± 0.32 | 69.75 ± 0.19 | 76.76 ± 0.67 | 100%
""",
    "0.3": """
FedMIC | 92.56 ± 1.27 | 66.12 ± 0.57 | 73.64 ± 1.02 | 79.21 ± 1.05 | 11.49%
FedMIC-A | 90.66 ± 0.12 | 62.24 ± 0.68 | 68.22 ± 0.24 | 75.22 ± 0.62 | 11.49%
FedMIC-B | 91.70 ± 0.43 | 62.67 ± 0.98 | 69.05 ± 0.32 | 72.45 ± 0.29 | 11.49%
FedMIC-C | 92.22 ± 0.12 | 67.43 ± 0.87 | 74.02 ± 0.62 | 80.20 ± 1.04 | 100%
""",
    "0.5": """
FedMIC | 93.42 ± 0.43 | 67.18 ± 0.24 | 74.49 ± 0.65 | 87.04 ± 0.23 | 11.49%
FedMIC-A | 90.62 ± 0.42 | 63.21 ± 0.16 | 69.36 ± 0.20 | 81.00 ± 1.12 | 11.49%
FedMIC-B | 91.23 ± 0.21 | 63.34 ± 0.54 | 69.89 ± 0.42 | 79.33 ± 0.56 | 11.49%
FedMIC-C | 93.90 ± 0.22 | 68.12 ± 0.89 | 75.21 ± 0.73 | 88.04 ± 0.48 | 100%
""",
}
# Table 9 (DP noise scale τ; λ = 0.1, 10 % participation): columns as Table 5. The "Mean Variation"
# rows are not data (A.12: computed inconsistently; tests/test_fedmic_studies.py recomputes them).
T9 = """
FedAvg | without | 49.92 ± 1.86 | 44.37 ± 1.24 | 59.82 ± 0.33 | 55.17 ± 1.43
FedAvg | τ = 1e-3 | 46.83 ± 0.75 | 41.95 ± 0.62 | 56.59 ± 0.42 | 52.44 ± 1.40
FedAvg | τ = 1e-2 | 43.78 ± 0.42 | 39.52 ± 0.62 | 54.31 ± 0.19 | 50.16 ± 0.29
FedAvg | τ = 5e-2 | 39.96 ± 0.56 | 34.83 ± 0.63 | 51.24 ± 0.11 | 45.62 ± 0.31
FedAvg | "Mean Variation" ↓ | 6.40 | 5.60 | 5.77 | 5.76
FedMIC | without | 92.13 ± 1.46 | 64.28 ± 0.78 | 70.21 ± 0.62 | 76.62 ± 1.46
FedMIC | τ = 1e-3 | 90.87 ± 0.71 | 62.69 ± 0.21 | 68.53 ± 0.45 | 74.95 ± 0.12
FedMIC | τ = 1e-2 | 89.45 ± 0.33 | 61.32 ± 1.21 | 67.08 ± 1.09 | 73.41 ± 1.32
FedMIC | τ = 5e-2 | 87.92 ± 1.27 | 59.76 ± 0.42 | 65.47 ± 0.26 | 71.83 ± 0.10
FedMIC | "Mean Variation" ↓ | 4.21 | 4.52 | 4.74 | 4.79
"""

METHOD_OF = {"FedAvg": "fedavg", "Local": "local", "FedBN": "fedbn", "PerFedAvg": "perfedavg", "FedBE": "fedbe",
             "FedALA": "fedala", "FedMIC (Ours)": "fedmic", "FedMIC": "fedmic", "FedMIC-A (no W_aux)": "fedmic-a",
             "FedMIC-A": "fedmic-a", "FedMIC-B (no rep-DDL)": "fedmic-b", "FedMIC-B": "fedmic-b",
             "FedMIC-C (no GPD)": "fedmic-c", "FedMIC-C": "fedmic-c"}
DATASETS = ["bloodmnist_64", "tissuemnist_64", "organsmnist_64", "organmnist3d_64"]
CLIENTS = {"bloodmnist_64": 20, "tissuemnist_64": 20, "organsmnist_64": 20, "organmnist3d_64": 10}
LAMBDAS = ["0.1", "0.3", "0.5"]
PS = ["0.1", "0.3", "0.5"]
ALPHAS = ["0.98", "0.90", "0.92", "0.95"]
TAUS = {"τ = 1e-3": "0.001", "τ = 1e-2": "0.01", "τ = 5e-2": "0.05"}


def cells(text):
    """[(label, [cell, ...]), ...] of a block of ' | '-separated rows."""
    out = []
    for line in text.strip().splitlines():
        label, *rest = [c.strip() for c in line.split("|")]
        out.append((label, rest))
    return out


def frac(cell):
    """'92.13 ± 1.46' -> '[0.9213, 0.0146]' (fractions, as our metrics); '11.49%' -> '[0.1149, null]'."""
    if cell.endswith("%"):
        return f"[{float(cell[:-1]) / 100:.4f}, null]"
    v, pm = (float(x) for x in cell.split("±"))
    return f"[{v / 100:.4f}, {pm / 100:.4f}]"


def part(lam, ds):
    return f"lam{lam}-n{CLIENTS[ds]}"


def table_2_4():
    """{dataset/partition: {variant: cell}} of Tables 2-4 (variants <method>-p<participation>)."""
    out = {}
    for lam in LAMBDAS:
        for label, row in cells(T2_4[lam]):
            assert len(row) == 12, (lam, label)
            for j, cell in enumerate(row):
                ds, p = DATASETS[j // 3], PS[j % 3]
                out.setdefault(f"{ds}/{part(lam, ds)}", {})[f"{METHOD_OF[label]}-p{p}"] = cell
    return out


def table_5():
    out = {}
    for label, row in cells(T5):
        alpha = label.split()[0]
        for ds, cell in zip(DATASETS, row, strict=True):
            out.setdefault(f"{ds}/{part('0.5', ds)}", {})[f"fedmic-alpha{alpha}-p0.1"] = cell
    return out


def table_6_8():
    """({group: {variant: accuracy cell}}, {group: {variant: communication cell}})."""
    acc, comm = {}, {}
    for lam in LAMBDAS:
        for label, row in cells(T6_8[lam]):
            *accs, c = row
            for ds, cell in zip(DATASETS, accs, strict=True):
                g = f"{ds}/{part(lam, ds)}"
                acc.setdefault(g, {})[f"{METHOD_OF[label]}-p0.1"] = cell
                comm.setdefault(g, {})[f"{METHOD_OF[label]}-p0.1"] = c
    return acc, comm


def table_9():
    out = {}
    for label, row in cells(T9):
        method, dp, *vals = [label] + row
        if "Mean Variation" in dp:
            continue
        v = f"{METHOD_OF[method]}-p0.1" if dp == "without" else f"{METHOD_OF[method]}-dp{TAUS[dp]}-p0.1"
        for ds, cell in zip(DATASETS, vals, strict=True):
            out.setdefault(f"{ds}/{part('0.1', ds)}", {})[v] = cell
    return out


ACC = "final_client_acc_pooled"
PAPER_HEAD = """# The FedMIC paper's {what}
# (Ren, Hu, Chen & Wang, ../shared/papers/001_92e55b0ead3a5e3d.txt), transcribed from
# ../shared/docs/methods-fedmic-pfpslwc.md A.12 (verbatim there) by scripts/make_fedmic_configs.py.
# Percentages in the paper; fractions here (92.13 ± 1.46 % -> [0.9213, 0.0146]), the ± being the
# paper's (a std over an unstated number of repetitions).
# The metric (A.10 READING): accuracy at the final round (50) pooled over all clients, each with its
# deployed model on its own test split (total correct / total tested): our final_client_acc_pooled.
{extra}"""


def write_paper(name, what, title, source, values, blocks=None, extra="", comm=None):
    lines = [PAPER_HEAD.format(what=what, extra=extra).rstrip("\n")]
    lines.append(f"title: {title}")
    lines.append(f"source: {source}")
    lines.append('how_ours: "final-round (50) accuracy pooled over all clients (total correct / total tested on their '
                 'local test splits), each client with its deployed model (spec A.10)"')
    lines.append("percent: true")
    lines.append("metrics:")
    lines.append(f"  {ACC}: {{label: Accuracy (pooled over clients; round 50), higher_is_better: true}}")
    if comm:
        lines.append("  compression_ratio: {label: Upload size / dense size, higher_is_better: false}")
    if blocks:
        lines.append("blocks:")
        for b, ms in blocks.items():
            lines.append(f"  {b}: [{', '.join(ms)}]")
    lines.append("values:")
    for g, row in values.items():
        lines.append(f"  {g}:")
        for v, cell in row.items():
            extra_c = f", compression_ratio: {frac(comm[g][v])}" if comm else ""
            lines.append(f"    {v}: {{{ACC}: {frac(cell)}{extra_c}}}")
    (ROOT / "config" / "papers" / f"{name}.yaml").write_text("\n".join(lines) + "\n")


MAIN_METHODS = ["fedavg", "local", "fedbn", "perfedavg", "fedbe", "fedala", "fedmic"]
write_paper("fedmic-main", "Tables 2-4 (λ = 0.1 / 0.3 / 0.5)", "FedMIC paper, Tables 2-4",
            "Ren et al., FedMIC, Tables 2-4", table_2_4(),
            blocks={f"P{p}": [f"{m}-p{p}" for m in MAIN_METHODS] for p in PS},
            extra="# Rows are method variants <method>-p<participation> (config/fedmic-main.yaml); ranks are within\n"
                  "# each participation's block. Table 3's caption says \"PRFL\" (a copy-paste error for FedMIC).\n"
                  "# FedBE distils on unlabeled server data held out of the official val split (the partitions'\n"
                  "# server_data; the paper does not say which data, A.11).\n")
write_paper("fedmic-alpha", "Table 5 (GPD energy threshold α)", "FedMIC paper, Table 5",
            "Ren et al., FedMIC, Table 5", table_5(),
            extra="# Setting not stated; its α = 0.98 row equals Table 4 (λ = 0.5) at 10 % participation, so it is read\n"
                  "# as λ = 0.5, r = 10 % (A.12). For OrganMNIST (3D) α = 0.95 (81.22) beats the \"optimal\" 0.98 (81.04).\n")
acc68, comm68 = table_6_8()
write_paper("fedmic-ablation", "Tables 6-8 (ablations at 10 % participation, λ = 0.1 / 0.3 / 0.5)",
            "FedMIC paper, Tables 6-8", "Ren et al., FedMIC, Tables 6-8", acc68, comm=comm68,
            extra="# fedmic-a: no W_aux (FedMIC-A); fedmic-b: no representation-based DDL (FedMIC-B); fedmic-c: no GPD\n"
                  "# (FedMIC-C). The communication column (\"11.49% of Complete Model Parameters Communication\", 100 %\n"
                  "# for FedMIC-C) is compared with our compression_ratio (uploads over their dense size, mean over\n"
                  "# rounds). Table 8's FedMIC row is kept as printed: it disagrees with Tables 4-5 (OrganMNIST 3D 87.04\n"
                  "# there, 81.04 in Table 4, and all four ± differ; A.12); the FedMIC rows of Tables 6-7 match Tables 2-3.\n")
write_paper("fedmic-dp", "Table 9 (DP noise scale τ, λ = 0.1, 10 % participation)", "FedMIC paper, Table 9",
            "Ren et al., FedMIC, Table 9", table_9(),
            blocks={"FedAvg": ["fedavg-p0.1"] + [f"fedavg-dp{t}-p0.1" for t in TAUS.values()],
                    "FedMIC": ["fedmic-p0.1"] + [f"fedmic-dp{t}-p0.1" for t in TAUS.values()]},
            extra="# fedmic-dp<τ>: τ N(0, 1) on every transmitted float (A.7 READING; noise injection, no clipping and\n"
                  "# no accounting: not an (ε, δ) guarantee). fedavg-dp<τ>: τ N(0, 1) added by each client to its\n"
                  "# uploaded weights (A.7 READING for FedAvg: \"the full uploaded weights\"; train.upload: gaussian),\n"
                  "# likewise no (ε, δ). The paper's \"Mean Variation\" rows are left out (computed inconsistently, A.12):\n"
                  "# FedAvg's is acc(without) - mean over τ, FedMIC's acc(without) - acc(τ = 5e-2).\n")

# ----- the studies ------------------------------------------------------------------------------
TRAIN = """train:
  rounds: 50                # R = 50 (A.9)
  participation: 0.1        # each variant sets its own r (method_params.<variant>.train.participation)
  local_epochs: 5           # E = 5 (A.9)
  batch_size: 64            # not stated: the spec's suggestion (A.9 "Missing")
  optimizer: {name: sgd, lr: 0.001, momentum: 0.0, weight_decay: 0.0, lr_decay: 1.0}   # SGD lr 1e-3 (A.9); momentum, weight decay, schedule unstated: 0, 0, none
  sampling: {scheme: stream}  # m = max(1, int(r K)) clients uniformly without replacement per round, a stream per seed (A.5)
  model: resnet101          # teacher and student (A.1); random init (pretraining unstated, A.6); grayscale and 3-D input as the model takes them (docs/studies.md)
  checkpoint_every: 5

eval:
  every: 5                  # the paper reports the final round only; curves every 5 rounds (and the last)
  batch_size: 512
"""
SEEDS = "seeds: [1, 2, 3]          # the number of repetitions behind the paper's ± is unstated: 3 (spec A.9 suggestion)\n"
FEDBE_NOTE = """# FedBE needs unlabeled server data, which the paper does not specify (A.11): half of the official
# validation split, drawn by the partition (partitions.<name>.server_data) and removed from the pooled
# splits before the Dirichlet draw, for every method alike, so all methods share one partition and no
# client ever holds a server sample. Its labels are never read.
"""


def partition(lam, k, datasets):
    return f"""  - name: lam{lam}-n{k}
    scheme: dirichlet         # per class, proportions over the clients ~ Dir(λ 1_K) (A.10 READING)
    num_clients: {k}
    alpha: {lam}
    self_balancing: false
    min_samples: 10           # redraw until every client holds >= 10 samples (A.10: "e.g. 10", unspecified)
    pool: all                 # the paper's sample counts are totals over the official splits: train, test and val merged (A.10)
    seed: 1                   # one partition for every training seed
    local_test: {{rule: ratios, ratios: [0.7, 0.2, 0.1]}}   # per client and class: train : test : val = 7 : 2 : 1 (A.9; floor, val the rest)
    server_data: {{source: val, fraction: 0.5}}   # FedBE's unlabeled server data: half of the official val split, held out of the pool (A.11 unstated)
    datasets: [{', '.join(datasets)}]
"""


def partitions(lams):
    big = [d for d in DATASETS if CLIENTS[d] == 20]
    small = [d for d in DATASETS if CLIENTS[d] == 10]
    return "".join(partition(lam, 20, big) + partition(lam, 10, small) for lam in lams)


def methods_block(names):
    out, row = [], []
    for n in names:
        row.append(n)
        if len(row) == 4:
            out.append(", ".join(row))
            row = []
    if row:
        out.append(", ".join(row))
    return "methods: [" + ",\n          ".join(out) + "]\n"


def study(name, head, lams, variants, reference, paper):
    names = [v for v, _ in variants]
    body = "\n".join(f"  {v}: {mp}" for v, mp in variants)
    text = f"""{head}study: {name}

data:
  datasets: [{', '.join(DATASETS)}]   # MedMNIST+ 64 px (A.9: "all images resized to 64x64"); OrganMNIST (2D) = OrganSMNIST (A.10)

partitions:
{partitions(lams)}
{methods_block(names)}
method_params:
{body}

{SEEDS}
{TRAIN}
report:
  paper_table: config/papers/{paper}.yaml
  reference: {reference}

mlflow:
  experiment: medpfl-{name}
"""
    (ROOT / "config" / f"{name}.yaml").write_text(text)


def with_p(mp, p):
    return mp[:-1] + f", train: {{participation: {p}}}}}"


BASE = [("fedavg", "{algorithm: fedavg}"), ("local", "{algorithm: local}"), ("fedbn", "{algorithm: fedbn}"),
        ("perfedavg", "{algorithm: perfedavg, local_steps: null}"), ("fedbe", "{algorithm: fedbe}"),
        ("fedala", "{algorithm: fedala}"),
        ("fedmic", "{algorithm: fedmic}")]
main_variants = [(f"{m}-p{p}", with_p(mp, p)) for p in PS for m, mp in BASE]
study("fedmic-main", f"""# The FedMIC paper's Tables 2-4 (../shared/papers/001_92e55b0ead3a5e3d.txt; setting
# ../shared/docs/methods-fedmic-pfpslwc.md A.9-A.10; docs/studies.md, FedMIC section): BloodMNIST,
# TissueMNIST, OrganSMNIST (20 clients) and OrganMNIST3D (10 clients) at 64 px, Dirichlet λ 0.1 / 0.3 /
# 0.5, participation 10 / 30 / 50 %, Local, FedAvg, FedBN, Per-FedAvg, FedBE, FedALA and FedMIC, 50 rounds
# of 5 local epochs, ResNet101, 3 seeds:
#   snakemake --cores all --configfile config/fedmic-main.yaml
# Sized for a GPU (4 data sets x 3 λ x 21 variants x 3 seeds = 756 runs of ResNet101). Local trains a
# client only in the rounds it is sampled, as the paper's numbers imply (A.10). The paper gives no
# baseline settings ("uniform baseline parameters"): FedBN, FedBE, FedALA and Per-FedAvg keep their class
# defaults, except Per-FedAvg's local_steps: null (E = 5 epochs, as every method, instead of 20 steps;
# beta 0.002, alpha = the round's lr). The report puts our numbers beside the paper's
# (config/papers/fedmic-main.yaml), ranked within each participation; paired differences are to FedMIC
# at 10 %.
{FEDBE_NOTE}""", LAMBDAS, main_variants, "fedmic-p0.1", "fedmic-main")

study("fedmic-alpha", """# The FedMIC paper's Table 5: FedMIC with the GPD energy threshold α in {0.90, 0.92, 0.95, 0.98}, at
# λ = 0.5 and 10 % participation (the setting is not stated; its α = 0.98 row is Table 4's, A.12).
# Everything else as config/fedmic-main.yaml (A.9-A.10):
#   snakemake --cores all --configfile config/fedmic-alpha.yaml
# Our compression_ratio (uploads over their dense size) shows what each α sends.
""", ["0.5"], [(f"fedmic-alpha{a}-p0.1", f"{{algorithm: fedmic, energy: {a}, train: {{participation: 0.1}}}}") for a in ALPHAS],
      "fedmic-alpha0.98-p0.1", "fedmic-alpha")

study("fedmic-ablation", """# The FedMIC paper's Tables 6-8: the ablations at 10 % participation, λ = 0.1 / 0.3 / 0.5 (A.8):
# FedMIC-A (no auxiliary matrix: L_rep = MSE(H_s, H_t), fedmic aux_matrix: false), FedMIC-B (no
# representation-based DDL: representation_ddl: false), FedMIC-C (no GPD, dense updates: gpd: false).
# Everything else as config/fedmic-main.yaml (A.9-A.10):
#   snakemake --cores all --configfile config/fedmic-ablation.yaml
# The paper's communication column (11.49 %, 100 %) is compared with our compression_ratio.
""", LAMBDAS, [("fedmic-p0.1", "{algorithm: fedmic, train: {participation: 0.1}}"),
               ("fedmic-a-p0.1", "{algorithm: fedmic, aux_matrix: false, train: {participation: 0.1}}"),
               ("fedmic-b-p0.1", "{algorithm: fedmic, representation_ddl: false, train: {participation: 0.1}}"),
               ("fedmic-c-p0.1", "{algorithm: fedmic, gpd: false, train: {participation: 0.1}}")],
      "fedmic-p0.1", "fedmic-ablation")

study("fedmic-dp", """# The FedMIC paper's Table 9: Gaussian noise τ N(0, 1) on what is sent, τ in {1e-3, 1e-2, 5e-2}, at
# λ = 0.1 and 10 % participation (A.7): FedMIC's noise goes on every transmitted float of its GPD
# upload (dp_target: payload). This is noise injection, with no clipping and no privacy accounting:
# NOT an (ε, δ) differential-privacy guarantee. FedAvg + DP (Table 9's upper half): the same noise
# added by each client to the full uploaded weights (A.7 READING; train.upload: [{name: gaussian,
# std: τ}], medpfl.fl.upload.gaussian_noise), the sample count sent as it is. Neither variant
# clips, so neither has an ε (metrics.json says so); DP-FedAvg with an accountant is train.dp
# (docs/methods.md, "Differential privacy"). Everything else as config/fedmic-main.yaml:
#   snakemake --cores all --configfile config/fedmic-dp.yaml
""", ["0.1"], [("fedavg-p0.1", "{algorithm: fedavg, train: {participation: 0.1}}")]
      + [(f"fedavg-dp{t}-p0.1",
          f"{{algorithm: fedavg, train: {{participation: 0.1, upload: [{{name: gaussian, std: {t}}}]}}}}")
         for t in TAUS.values()]
      + [("fedmic-p0.1", "{algorithm: fedmic, train: {participation: 0.1}}")]
      + [(f"fedmic-dp{t}-p0.1", f"{{algorithm: fedmic, dp_noise_std: {t}, train: {{participation: 0.1}}}}")
         for t in TAUS.values()],
      "fedmic-p0.1", "fedmic-dp")

# ----- a CPU study: the protocol on real BloodMNIST at 28 px ------------------------------------------
CPU = """# FedMIC's protocol scaled down to run on a CPU (2 cores, well under 30 minutes; docs/studies.md):
# real BloodMNIST at 28 px (the file in ../shared/data/medmnist; the paper uses 64 px), all official
# splits pooled, 20 clients, Dirichlet λ = 0.1, 10 % participation (2 clients per round), per-client
# 7 : 2 : 1 train / test / val, a small ResNet (resnet18 at width 16) instead of ResNet101, and
# @ROUNDS@ rounds of @EPOCHS@ local epoch(s) instead of 50 x 5, one seed:
#   snakemake --cores all --configfile config/fedmic-bloodmnist-cpu.yaml
# Time, measured: 27 minutes for the 7 runs on 2 cores shared with other work (FedAvg, FedBN, Local
# about 4 minutes each, FedMIC about 8 (two networks), FedBE 12 with 2 server epochs per round; the
# code's 20 take about 2 minutes per round here, hence method_params.fedbe). A scaled-down check of the
# pipeline and of the methods' costs, not a reproduction: with 2 clients per round each client trains
# in about 2 of the 20 rounds (docs/studies.md has the results).
# Methods: FedAvg, Local, FedBN, FedBE, FedMIC, FedMIC without GPD (FedMIC-C, dense updates) and FedMIC with
# the paper's largest DP noise (τ = 5e-2 on every transmitted float: noise injection, not a formal
# (ε, δ) guarantee). No paper numbers exist for this setting; the closest are Table 2's BloodMNIST
# 10 % column (64 px, ResNet101, 50 x 5): FedAvg 49.92, Local 68.35, FedBN 79.28, FedMIC 92.13, and
# Table 6's FedMIC-C 92.33, Table 9's FedMIC with τ = 5e-2 87.92.
# FedBE distils on half of the official val split held out as unlabeled server data (server_data below),
# set aside for every method so that all share one partition.
study: fedmic-bloodmnist-cpu

data:
  datasets: [bloodmnist]

partitions:
  - name: lam0.1-n20
    scheme: dirichlet
    num_clients: 20
    alpha: 0.1
    self_balancing: false
    min_samples: 10
    pool: all
    seed: 1
    local_test: {rule: ratios, ratios: [0.7, 0.2, 0.1]}
    server_data: {source: val, fraction: 0.5}

methods: [fedavg, local, fedbn, fedbe, fedmic, fedmic-c, fedmic-dp0.05]

method_params:
  fedmic-c: {algorithm: fedmic, gpd: false}           # FedMIC without GPD (Table 6's FedMIC-C)
  fedmic-dp0.05: {algorithm: fedmic, dp_noise_std: 0.05}   # Table 9's largest τ
  fedbe: {distill_epochs: 2}          # the code's 20 server epochs take about 2 minutes per round on this CPU

seeds: [1]

train:
  rounds: @ROUNDS@                # the paper: 50 (A.9); fewer to fit a CPU
  participation: 0.1
  local_epochs: @EPOCHS@           # the paper: 5
  batch_size: 64
  optimizer: {name: sgd, lr: 0.001, momentum: 0.0, weight_decay: 0.0, lr_decay: 1.0}
  sampling: {scheme: stream}
  model: resnet18           # a small ResNet for a CPU (the paper: ResNet101)
  model_args: {width: 16}
  device: cpu
  checkpoint_every: 5

eval:
  every: 10                 # all clients' test and val splits at rounds 10 and 20
  batch_size: 512

report:
  reference: fedavg

mlflow:
  experiment: medpfl-fedmic-bloodmnist-cpu
"""
(ROOT / "config" / "fedmic-bloodmnist-cpu.yaml").write_text(CPU.replace("@ROUNDS@", "20").replace("@EPOCHS@", "1"))
