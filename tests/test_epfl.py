"""EPFL (FHBench, arXiv 2504.10817, Eq. 5-9): the B-distance weights on hand-made B matrices
(rows sum to 1, diagonal lambda, psi masking layers, the zero-distance guard), A mixed to
hand-computed values while B and the head are never touched by the server, the upload (A and B
only), the uniform ablation, a single uploader, a model without LoRA refused, and two-round runs
on both executors around a tiny LoRA-like model built here (the zoo has no LoRA model yet: the
engine's ``initial_params`` is overridden to build it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medpfl.algorithms import resolve_method
from medpfl.algorithms.epfl import mean_distances, selected_layers, similarity_weights
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward, model_state
from medpfl.fl.payload import UploadSpecError, check_upload
from medpfl.fl.program import RoundInfo
from medpfl.models import build_model
from medpfl.fl.program import Federation
from tests.conftest import assert_trees_close, make_algo

RND = RoundInfo(round=0, rounds=2, lr=0.1, num_clients=5, seed=1, base_lr=0.1)


# ----- a tiny LoRA-like model (the zoo contract: forward(x, mask, with_features), head_name, extra_parts) ---------
class LoRA(nn.Module):
    """scale * B A h, A [r, d] (LoRA's kaiming-uniform init, nn.Linear's), B [d, r] = 0."""

    def __init__(self, d: int, r: int):
        super().__init__()
        self.lora_A = nn.Linear(d, r, bias=False)
        self.lora_B = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, h):
        return 2.0 * self.lora_B(self.lora_A(h))


class Block(nn.Module):
    def __init__(self, d: int, r: int):
        super().__init__()
        self.q = LoRA(d, r)
        self.v = LoRA(d, r)

    def forward(self, h):
        h = torch.tanh(h + self.q(h))
        return torch.tanh(h + self.v(h))


class TinyLoRA(nn.Module):
    """Images [B, C, H, W] -> average-pooled to C x p x p (no weights: the "frozen backbone" is a
    fixed function, not state) -> 2 blocks with a LoRA on q and on v (L = 4, order block 0 q, v,
    block 1 q, v) -> head. State: the 4 A, the 4 B and the head only."""

    head_name = "head"
    zoo_name = "tinylora"

    def __init__(self, channels=3, num_classes=4, pool=2, rank=2, blocks=2):
        super().__init__()
        self.pool = pool
        d = channels * pool * pool
        self.blocks = nn.ModuleList([Block(d, rank) for _ in range(blocks)])
        self.head = nn.Linear(d, num_classes)

    def extra_parts(self):
        mods = [f"blocks.{i}.{p}" for i in range(len(self.blocks)) for p in ("q", "v")]
        return {"lora_A": tuple(f"{m}.lora_A.weight" for m in mods), "lora_B": tuple(f"{m}.lora_B.weight" for m in mods)}

    def forward(self, x, mask=None, with_features=False):
        h = F.adaptive_avg_pool2d(x, self.pool).flatten(1)
        for blk in self.blocks:
            h = blk(h)
        logits = self.head(h)
        return (h, logits) if with_features else logits


A_NAMES = tuple(f"blocks.{i}.{p}.lora_A.weight" for i in (0, 1) for p in ("q", "v"))
B_NAMES = tuple(f"blocks.{i}.{p}.lora_B.weight" for i in (0, 1) for p in ("q", "v"))
HEAD = ("head.weight", "head.bias")


def _algo(num_classes=4, pool=2, rank=2, **overrides):
    cls, cfg = resolve_method("epfl", {"epfl": overrides} if overrides else {})
    return cls(cfg, make_forward(TinyLoRA(3, num_classes, pool, rank).to("meta")), num_classes)


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


# ----- declarations -----------------------------------------------------------------------------
def test_defaults_parts_and_upload_spec():
    algo = _algo()
    assert (algo.cfg.lambda_self, algo.cfg.psi, algo.cfg.mixing) == (0.5, "all", "similarity")
    assert algo.lora_names() == (A_NAMES, B_NAMES)
    assert algo.local_names() == (*B_NAMES, *HEAD)
    spec = algo.upload_spec()
    assert set(spec) == {"A", "B"}  # no num_samples, no head
    assert spec["A"].shapes == {k: (2, 12) for k in A_NAMES} and spec["B"].shapes == {k: (12, 2) for k in B_NAMES}
    up = {"A": {k: torch.zeros(3, 2, 12) for k in A_NAMES}, "B": {k: torch.zeros(3, 12, 2) for k in B_NAMES}}
    check_upload("epfl", spec, up, 3)
    with pytest.raises(UploadSpecError):  # the head (or anything else) may not cross
        check_upload("epfl", spec, {**up, "head": {k: torch.zeros(3, 1) for k in HEAD}}, 3)
    with pytest.raises(UploadSpecError):
        check_upload("epfl", spec, {**up, "B": {**up["B"], "head.bias": torch.zeros(3, 4)}}, 3)


@pytest.mark.parametrize("model", ["mlp", "mlr", "cnn4"])
def test_a_model_without_lora_stops_naming_train_model_and_the_part(model):
    algo = make_algo("epfl", model=model)
    params = model_state(build_model(model, 3, 4, 28))
    with pytest.raises(ValueError, match=rf"train\.model={model}: EPFL .* declares no 'lora_A' part"):
        algo.init_server(params, Federation(5))


def test_psi_selects_layers_in_lora_order():
    assert selected_layers(4, "all") == [0, 1, 2, 3]
    assert selected_layers(4, "first_half") == [0, 1]  # ViT: blocks 0-5 of 12 (q and v each)
    assert selected_layers(4, "second_half") == [2, 3]
    assert selected_layers(5, "first_half") == [0, 1] and selected_layers(5, "second_half") == [2, 3, 4]
    with pytest.raises(ValueError, match="selects no LoRA layer"):
        selected_layers(1, "first_half")


# ----- the weights (Eq. 5-8) on hand-made B ----------------------------------------------------------
# 3 clients, 2 layers of B [2, 1]; layer 1: (0,0), (3,4), (6,8) -> d01 = 5, d02 = 10, d12 = 5;
# layer 2: (0,0), (0,1), (0,3) -> d01 = 1, d02 = 3, d12 = 2. Mean: dbar01 = 3, dbar02 = 6.5, dbar12 = 3.5.
L1 = _t([[0.0], [0.0]], [[3.0], [4.0]], [[6.0], [8.0]])
L2 = _t([[0.0], [0.0]], [[0.0], [1.0]], [[0.0], [3.0]])


def test_mean_distances_are_layer_means_of_frobenius_norms():
    torch.testing.assert_close(mean_distances([L1, L2]), _t([0, 3, 6.5], [3, 0, 3.5], [6.5, 3.5, 0]))
    torch.testing.assert_close(mean_distances([L1]), _t([0, 5, 10], [5, 0, 5], [10, 5, 0]))


def test_similarity_weights_by_hand():
    s = similarity_weights(mean_distances([L1, L2]), 0.5)
    # row 0: 1/3 : 2/13 -> 13/19, 6/19; row 1: 1/3 : 2/7 -> 7/13, 6/13; row 2: 2/13 : 2/7 -> 7/20, 13/20
    want = _t([0.5, 0.5 * 13 / 19, 0.5 * 6 / 19], [0.5 * 7 / 13, 0.5, 0.5 * 6 / 13], [0.5 * 7 / 20, 0.5 * 13 / 20, 0.5])
    torch.testing.assert_close(s, want)
    torch.testing.assert_close(s.sum(1), torch.ones(3, dtype=torch.float64))
    s2 = similarity_weights(mean_distances([L1, L2]), 0.2)
    torch.testing.assert_close(torch.diagonal(s2), torch.full((3,), 0.2, dtype=torch.float64))
    torch.testing.assert_close(s2.sum(1), torch.ones(3, dtype=torch.float64))
    # lambda = 1: no mixing at all
    torch.testing.assert_close(similarity_weights(mean_distances([L1, L2]), 1.0), torch.eye(3, dtype=torch.float64))


def test_zero_distance_guard_gives_finite_weights():
    same = _t([[1.0], [2.0]], [[1.0], [2.0]], [[5.0], [2.0]])  # clients 0 and 1 have identical B
    s = similarity_weights(mean_distances([same]), 0.5)
    assert torch.isfinite(s).all()
    torch.testing.assert_close(s.sum(1), torch.ones(3, dtype=torch.float64))
    # client 0's twin (distance 0, guarded to 1e-12) takes nearly all of 1 - lambda; client 2 (distance 4):
    # (1/4) / (1e12 + 1/4)
    assert s[0, 1] == pytest.approx(0.5 * 1e12 / (1e12 + 0.25), rel=1e-12)
    assert s[0, 2] == pytest.approx(0.5 * 0.25 / (1e12 + 0.25), rel=1e-9)
    # every B equal (round 0 in LoRA: B = 0 everywhere): every other client weighs (1 - lambda)/(m - 1)
    zero = torch.zeros(4, 3, 2, dtype=torch.float64)
    s0 = similarity_weights(mean_distances([zero]), 0.5)
    torch.testing.assert_close(s0, 0.5 * torch.eye(4, dtype=torch.float64) + (0.5 / 3) * (1 - torch.eye(4, dtype=torch.float64)))


def test_single_uploader_keeps_its_own_a():
    torch.testing.assert_close(similarity_weights(torch.zeros(1, 1, dtype=torch.float64), 0.5), _t([1.0]))


# ----- aggregation through the method (TinyLoRA with d = 3, r = 1) ------------------------------------
def _b_uploads(layer2_scale=1.0, seed=0, second=L2):
    """B uploads of 3 clients: layer 0 (block 0 q) = L1, layer 1 (block 0 v) = ``second`` (each in the
    first two rows of a [3, 1] B), layers 2, 3 (block 1) random."""
    g = torch.Generator().manual_seed(seed)
    b = {}
    for l, name in enumerate(B_NAMES):
        t = torch.zeros(3, 3, 1, dtype=torch.float64)
        if l == 0:
            t[:, :2] = L1
        elif l == 1:
            t[:, :2] = second
        else:
            t = layer2_scale * torch.randn(3, 3, 1, generator=g, dtype=torch.float64)
        b[name] = t
    return b


def _a_uploads():
    """A_j^(l) = c_j (l + 1) everywhere, c = (1, 4, 7): [3, 1, 3] per layer."""
    c = _t(1.0, 4.0, 7.0)
    return {n: (c * (l + 1)).view(3, 1, 1).expand(3, 1, 3).clone() for l, n in enumerate(A_NAMES)}


def _server(k=5):
    params = {n: torch.full((1, 3), -1.0, dtype=torch.float64) for n in A_NAMES}
    algo = _algo(pool=1, rank=1)
    return algo.init_server(params, Federation(k))


def test_psi_masks_layers_out_of_the_weights():
    first = _algo(pool=1, rank=1, psi="first_half")
    s = first.mixing_weights(_b_uploads())
    want = _t([0.5, 0.5 * 13 / 19, 0.5 * 6 / 19], [0.5 * 7 / 13, 0.5, 0.5 * 6 / 13], [0.5 * 7 / 20, 0.5 * 13 / 20, 0.5])
    torch.testing.assert_close(s, want)
    # a change in a masked-out layer's B (block 1) does not change s ...
    torch.testing.assert_close(first.mixing_weights(_b_uploads(layer2_scale=50.0, seed=3)), s)
    # ... but it does with psi = all, and second_half sees only block 1
    every = _algo(pool=1, rank=1)
    assert not torch.allclose(every.mixing_weights(_b_uploads()), every.mixing_weights(_b_uploads(50.0, 3)))
    second = _algo(pool=1, rank=1, psi="second_half")
    b = _b_uploads()
    torch.testing.assert_close(second.mixing_weights(b),
                               similarity_weights(mean_distances([b[B_NAMES[2]], b[B_NAMES[3]]]), 0.5))


def test_aggregate_mixes_a_by_hand_and_keeps_the_other_rows():
    algo = _algo(pool=1, rank=1, psi="first_half")
    server = _server(5)
    clients = torch.tensor([0, 2, 4])
    uploads = {"A": _a_uploads(), "B": _b_uploads(second=L1)}  # block 0: dbar = L1's distances 5, 10, 5
    new = algo.aggregate(server, uploads, clients, RND)
    assert set(new) == {"A", "weights"}  # no B, no head on the server
    # first_half weights: rows (1/2, 1/3, 1/6), (1/4, 1/2, 1/4), (1/6, 1/3, 1/2) on c = (1, 4, 7): 3, 4, 5
    for l, n in enumerate(A_NAMES):
        got = new["A"][n]
        for row, c in zip((0, 2, 4), (3.0, 4.0, 5.0)):
            torch.testing.assert_close(got[row], torch.full((1, 3), c * (l + 1), dtype=torch.float64))
        for row in (1, 3):  # did not upload: its last mixture (here the initial A) is kept
            torch.testing.assert_close(got[row], torch.full((1, 3), -1.0, dtype=torch.float64))
    w = new["weights"]
    torch.testing.assert_close(w[clients][:, clients], _t([1 / 2, 1 / 3, 1 / 6], [1 / 4, 1 / 2, 1 / 4],
                                                          [1 / 6, 1 / 3, 1 / 2]))
    torch.testing.assert_close(w[1], _t(0, 1, 0, 0, 0))
    torch.testing.assert_close(w[3], _t(0, 0, 0, 1, 0))
    torch.testing.assert_close(w[0, [1, 3]], _t(0, 0))
    # the uploads (pre-aggregation A_j) are not modified in place
    torch.testing.assert_close(uploads["A"], _a_uploads())


def test_uniform_mixing_is_the_plain_mean_of_a():
    algo = _algo(pool=1, rank=1, mixing="uniform")
    new = algo.aggregate(_server(3), {"A": _a_uploads(), "B": _b_uploads()}, torch.tensor([0, 1, 2]), RND)
    for l, n in enumerate(A_NAMES):
        torch.testing.assert_close(new["A"][n], torch.full((3, 1, 3), 4.0 * (l + 1), dtype=torch.float64))


def test_a_single_uploader_keeps_its_trained_a():
    algo = _algo(pool=1, rank=1)
    one = {"A": {k: v[1:2] for k, v in _a_uploads().items()}, "B": {k: v[1:2] for k, v in _b_uploads().items()}}
    new = algo.aggregate(_server(5), one, torch.tensor([3]), RND)
    for l, n in enumerate(A_NAMES):
        torch.testing.assert_close(new["A"][n][3], torch.full((1, 3), 4.0 * (l + 1), dtype=torch.float64))


# ----- client side ----------------------------------------------------------------------------------
def _params(seed, **kw):
    torch.manual_seed(seed)
    m = TinyLoRA(**kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.uniform_(-1, 1)  # B != 0, so a mix-up would show
    return model_state(m)


def test_begin_finish_personalized_model():
    algo = _algo()
    init, mixed, trained = _params(0), _params(1), _params(2)
    state = algo.init_client_state(init, 3, Federation(5))
    assert int(state["client"]) == 3 and set(state["local"]) == {*B_NAMES, *HEAD}
    trees, _ = algo.begin({"A": {k: mixed[k] for k in A_NAMES}}, state, {}, RND)
    assert list(trees["model"]) == list(init)  # the model's own order
    for k in A_NAMES:
        assert trees["model"][k] is mixed[k]
    for k in (*B_NAMES, *HEAD):
        assert torch.equal(trees["model"][k], init[k])
    up, new_state, model = algo.finish({"model": trained}, {}, state, {"num_samples": torch.tensor(9.0)}, RND)
    assert set(up) == {"A", "B"} and set(up["A"]) == set(A_NAMES) and set(up["B"]) == set(B_NAMES)
    assert all(up["A"][k] is trained[k] for k in A_NAMES) and all(up["B"][k] is trained[k] for k in B_NAMES)
    assert set(new_state["local"]) == {*B_NAMES, *HEAD} and all(new_state["local"][k] is trained[k]
                                                              for k in (*B_NAMES, *HEAD))
    assert model is trained
    server = {"A": {k: torch.stack([_params(10 + i)[k] for i in range(5)]) for k in A_NAMES}}
    pm = algo.personalized_model(new_state, server)
    assert list(pm) == list(init)
    for k in A_NAMES:
        assert torch.equal(pm[k], server["A"][k][3])
    for k in (*B_NAMES, *HEAD):
        assert torch.equal(pm[k], trained[k])


# ----- two rounds on the engine, both executors ------------------------------------------------------------
class _Engine(Engine):
    """The engine around :class:`TinyLoRA` (the zoo has no LoRA model: only the initial model differs)."""

    def initial_params(self):
        torch.manual_seed(self.seed)
        return {k: v.to(self.data.device) for k, v in model_state(TinyLoRA(3, self.data.num_classes)).items()}


def _run(fed_data, executor, participation=1.0, capture=None, **overrides):
    algo = _algo(num_classes=fed_data.num_classes, **overrides)
    if capture is not None:
        real = algo.aggregate

        def spy(server, uploads, clients, rnd):
            capture.append((clients.clone(), uploads))
            return real(server, uploads, clients, rnd)

        algo.aggregate = spy
    train = TrainConfig(rounds=2, participation=participation, local_epochs=1, batch_size=16, checkpoint_every=0)
    return algo, _Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor).run()


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_two_rounds_on_both_executors(fed_data, participation):
    crossed: list = []
    algo, seq = _run(fed_data, "sequential", participation, capture=crossed)
    _, stk = _run(fed_data, "stacked", participation)
    k = fed_data.num_clients
    a_bytes = 4 * sum(2 * 12 for _ in A_NAMES)
    b_bytes = 4 * sum(12 * 2 for _ in B_NAMES)
    m = seq.rounds["num_sampled"].to_numpy()
    assert seq.rounds["bytes_up"].tolist() == (m * (a_bytes + b_bytes)).tolist()  # A + B per uploader
    assert seq.rounds["bytes_down"].tolist() == (m * a_bytes).tolist()  # its own A_i per client
    assert set(seq.records["view"]) == {"local_after_training", "personalized_on_local", "local_on_global_test"}
    assert seq.global_params is None
    # the executors agree
    for col in ("bytes_up", "bytes_down", "sampled_clients"):
        assert seq.rounds[col].tolist() == stk.rounds[col].tolist()
    torch.testing.assert_close(torch.tensor(seq.records["accuracy"].to_numpy()),
                               torch.tensor(stk.records["accuracy"].to_numpy()))
    torch.testing.assert_close(torch.tensor(seq.records["loss"].to_numpy()),
                               torch.tensor(stk.records["loss"].to_numpy()), atol=1e-5, rtol=1e-5)
    assert_trees_close(seq.server, stk.server, atol=1e-5, rtol=1e-5)
    assert_trees_close(seq.client_states, stk.client_states, atol=1e-5, rtol=1e-5)
    # B and the head are the client's: the state holds exactly what it uploaded last (B), no server write
    state = seq.client_states["local"]
    last = {}
    for clients, up in crossed:
        assert set(up) == {"A", "B"}
        for pos, c in enumerate(clients.tolist()):
            last[c] = {n: up["B"][n][pos] for n in B_NAMES}
    for c, b in last.items():
        for n in B_NAMES:
            torch.testing.assert_close(state[n][c], b[n], atol=0, rtol=0)
    trained = sorted(last)
    heads = state["head.weight"][trained]
    assert not torch.allclose(heads[0], heads[1])  # personal heads
    # the server's weights rows of the last round's uploaders: diagonal lambda, sum 1
    clients = crossed[-1][0]
    w = seq.server["weights"][clients][:, clients]
    torch.testing.assert_close(w.sum(1), torch.ones(len(clients), dtype=torch.float64))
    torch.testing.assert_close(torch.diagonal(w), torch.full((len(clients),), 0.5, dtype=torch.float64))
    # the personalized model is the server's A_i with the client's own B_i and head
    pm = seq.personalized
    for n in A_NAMES:
        torch.testing.assert_close(pm[n], seq.server["A"][n], atol=0, rtol=0)
    for n in (*B_NAMES, *HEAD):
        torch.testing.assert_close(pm[n], state[n], atol=0, rtol=0)
    # similarity mixing gives each uploader its own A
    a0 = seq.server["A"][A_NAMES[0]][clients]
    assert not torch.allclose(a0[0], a0[1])
    assert seq.client_states["client"].tolist() == list(range(k))


def test_uniform_mixing_on_the_engine_gives_every_uploader_the_same_a(fed_data):
    crossed: list = []
    _, res = _run(fed_data, "sequential", 1.0, capture=crossed, mixing="uniform")
    clients, up = crossed[-1]
    for n in A_NAMES:
        a = res.server["A"][n][clients]
        torch.testing.assert_close(a, up["A"][n].mean(0, keepdim=True).expand_as(a))


class _Kill(Exception):
    pass


def test_killed_and_resumed_run_equals_uninterrupted(fed_data, tmp_path):
    """The server's per-client A, its weights and the clients' ids and local parts survive a checkpoint."""
    train = TrainConfig(rounds=2, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1)
    ckpt = tmp_path / "checkpoint.pt"

    def engine(callbacks=(), checkpoint=None):
        return _Engine(_algo(num_classes=fed_data.num_classes), fed_data, train, EvalConfig(), seed=1,
                       executor_kind="sequential", checkpoint=checkpoint, callbacks=list(callbacks), fingerprint="epfl")

    full = engine().run()

    def die(r, row, recs):
        if r == 1:
            raise _Kill()

    with pytest.raises(_Kill):
        engine([die], ckpt).run()
    resumed = engine(checkpoint=ckpt).run()
    assert resumed.resumed_from == 1
    assert full.records.equals(resumed.records)
    assert_trees_close(full.server, resumed.server, atol=0)
    assert_trees_close(full.client_states, resumed.client_states, atol=0)
