"""How much FedAvg-MLR on Synthetic(0.5, 0.5) depends on the generator's draw: an independent
plain-PyTorch FedAvg (no medpfl engine) in the pFedKD-WCL setting, on several generator seeds,
beside a centralised MLR on the same data.

Why: our pipeline's FedAvg-MLR on the Synthetic study's draw (generator seed 0) ends at about
22 % mean client accuracy, while the pFedKD-WCL paper's Table 2 gives 67.76 % on its own draw
(an unseeded call of the same generator whose file is not public). This script checks, outside
the engine, (a) that plain FedAvg on our draw lands where the engine does, and (b) how far the
level moves between draws, and (c) what a single global linear model can reach at best here.

The setting (``../shared/docs/methods-pfedkdwcl-epfl.md`` A.2-A.4): 100 clients, 10 sampled
per round uniformly without replacement, 20 true local epochs of shuffled mini-batches of 20
(the last one smaller), SGD lr 0.01 without momentum, the server's n-weighted average of the
sampled clients' models; scored every ``--every`` rounds as the paper does: the global model
on every client's local test split, unweighted mean over clients. The multinomial logistic
regression's gradient is written out (softmax minus one-hot), so a step costs a few small
matrix products. The centralised reference trains one MLR on all clients' train splits with
each client weighted equally (full-batch Adam, 1,500 steps) and is scored the same way.

    python -m benchmarks.synthetic_fedavg_draws --seeds 0 1 2 --rounds 200
    python -m benchmarks.synthetic_fedavg_draws --seeds 0 --rounds 200 --local-steps 20

Prints one line per seed and round checkpoint. Measurements, not tests.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from medpfl.data.fedprox_synthetic import generate


def mean_client_accuracy(w: torch.Tensor, b: torch.Tensor, tests: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Unweighted mean over clients of the accuracy of ``x @ w.T + b`` on each client's test split."""
    return float(np.mean([float(((x @ w.T + b).argmax(1) == y).float().mean()) for x, y in tests]))


def local_sgd(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int, lr: float,
              gen: torch.Generator, steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``epochs`` shuffled passes of mini-batch SGD on the mean cross-entropy of an MLR
    (w float [C, d], b float [C]); the gradient is ``(softmax - onehot) / B`` times the inputs.
    ``steps``: stop after that many mini-batches instead (passes continue as needed)."""
    w, b = w.clone(), b.clone()
    n, c = len(x), w.shape[0]
    eye = torch.eye(c)
    done = 0
    for _ in range(epochs if steps is None else -(-steps * batch // n)):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, batch):
            if steps is not None and done == steps:
                break
            done += 1
            idx = perm[s:s + batch]
            xb = x[idx]
            g = (torch.softmax(xb @ w.T + b, dim=1) - eye[y[idx]]) / len(idx)
            w -= lr * (g.T @ xb)
            b -= lr * g.sum(0)
    return w, b


def centralised(trains: list[tuple[torch.Tensor, torch.Tensor]], tests, c: int) -> float:
    """One MLR on every client's train split, each client weighing the same; its mean client test accuracy."""
    x = torch.cat([t[0] for t in trains])
    y = torch.cat([t[1] for t in trains])
    wt = torch.cat([torch.full((len(t[1]),), 1.0 / len(t[1])) for t in trains]) / len(trains)
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], c)
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    for _ in range(1500):
        opt.zero_grad()
        (torch.nn.functional.cross_entropy(lin(x), y, reduction="none") * wt).sum().backward()
        opt.step()
    return mean_client_accuracy(lin.weight.detach(), lin.bias.detach(), tests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="generator seeds (the study uses 0)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--every", type=int, default=50, help="print the score every this many rounds")
    ap.add_argument("--epochs", type=int, default=20, help="true local epochs per round (the official code's FedAvg)")
    ap.add_argument("--local-steps", type=int, default=None,
                    help="instead of --epochs: this many mini-batch steps per round (what pFedKD-WCL, pFedMe and "
                         "Per-FedAvg take in the official code)")
    ap.add_argument("--no-centralised", action="store_true", help="skip the centralised MLR (its 1,500 full-batch steps)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    work = f"{a.local_steps} local steps" if a.local_steps else f"{a.epochs} local epochs"
    for seed in a.seeds:
        t0 = time.perf_counter()
        g = generate(0.5, 0.5, num_clients=100, dimension=60, num_classes=10, seed=seed)
        x_all = torch.tensor(g.features, dtype=torch.float32)
        y_all = torch.tensor(g.labels)
        k = int(g.client_id.max()) + 1
        trains, tests = [], []
        for cl in range(k):
            rows = g.client_id == cl
            tr, te = torch.tensor(rows & (g.local_split == 0)), torch.tensor(rows & (g.local_split == 1))
            trains.append((x_all[tr], y_all[tr]))
            tests.append((x_all[te], y_all[te]))
        n = np.array([len(t[1]) for t in trains], dtype=np.float64)
        rng = np.random.default_rng(1)
        gen = torch.Generator().manual_seed(1)
        w, b = torch.zeros(10, 60), torch.zeros(10)
        majority = np.mean([np.bincount(t[1].numpy(), minlength=10).max() / len(t[1]) for t in trains])
        cen = "" if a.no_centralised else f"; centralised MLR {100 * centralised(trains, tests, 10):.1f} %"
        print(f"seed {seed}: client sizes {g.sizes.min()}-{g.sizes.max()}, largest client "
              f"{g.sizes.max() / g.sizes.sum():.0%} of the data, mean majority-class share of the train splits "
              f"{majority:.2f}; {work}{cen}", flush=True)
        for r in range(a.rounds):
            picked = rng.choice(k, size=k // 10, replace=False)
            models = [local_sgd(w, b, *trains[c], a.epochs, 20, 0.01, gen, a.local_steps) for c in picked]
            p = torch.tensor(n[picked] / n[picked].sum(), dtype=torch.float32)
            w = sum(pi * m[0] for pi, m in zip(p, models))
            b = sum(pi * m[1] for pi, m in zip(p, models))
            if (r + 1) % a.every == 0 or r == a.rounds - 1:
                print(f"seed {seed}: round {r + 1}: FedAvg-MLR mean client acc {100 * mean_client_accuracy(w, b, tests):.1f} % "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
