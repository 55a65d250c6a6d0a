"""FedMIC (spec ``methods-fedmic-pfpslwc.md`` part A): the GPD energy rank (strictly > α) and its
reconstruction error, the bytes of compressed payloads, every Dual-KD term and its detach pattern
on a hand case, W_aux kept local, the ablation switches, the synced global student, the DP noise."""

import numpy as np
import pytest
import torch

from medpfl.algorithms.fedmic import dual_kd_terms, kl_batchmean, payload_noise
from medpfl.fl.payload import (LowRank, decode_tree, encode_tree, payload_dense_nbytes, payload_nbytes, svd_decode,
                               svd_encode)
from medpfl.fl.program import RoundInfo
from medpfl.fl.tree import tree_stack
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo
from tests.helpers import low_rank_delta


def rnd_info(r=0, rounds=3, seed=1):
    return RoundInfo(round=r, rounds=rounds, lr=0.01, num_clients=3, seed=seed, base_lr=0.01)


# ----- GPD: the energy rank and the reconstruction ----------------------------------------------
def _diag(values, p=16, q=12):
    m = torch.zeros(p, q)
    for i, v in enumerate(values):
        m[i, i] = v
    return m


@pytest.mark.parametrize("alpha,rank", [(0.5, 2), (0.4999, 1), (0.625, 3), (0.75, 4), (0.7499, 3), (0.875, 5),
                                        (0.98, 5)])
def test_energy_rank_is_the_smallest_strictly_above_alpha(alpha, rank):
    # energies 4, 1, 1, 1, 1 of 8: cumulative 0.5, 0.625, 0.75, 0.875, 1 (exact in binary), so a
    # threshold equal to a cumulative energy needs one more component (strictly >, paper Eq. 10)
    enc = svd_encode(_diag([2.0, 1.0, 1.0, 1.0, 1.0]), alpha)
    assert isinstance(enc, LowRank) and int(enc.rank) == rank
    # the algorithm uses its configured α
    algo = make_algo("fedmic", energy=alpha)
    assert algo.cfg.energy == alpha
    assert int(algo._encode({"fc.weight": _diag([2.0, 1.0, 1.0, 1.0, 1.0])})["fc.weight"].rank) == rank


def test_default_alpha_is_098_and_rotated_spectra():
    assert make_algo("fedmic").cfg.energy == 0.98
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    sigma = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5, 0.25] + [0.0] * 24, dtype=torch.float64)
    m = (u[:, :30] * sigma) @ v.T
    energy = sigma**2 / (sigma**2).sum()  # cumulative 0.7583, 0.9479, 0.9782, 0.9858, 0.9877, 1
    cum = torch.cumsum(energy, 0)
    for alpha in (0.7, 0.9, 0.95, 0.98, 0.986, 0.99):
        expect = int((cum <= alpha).sum()) + 1
        assert float(cum[expect - 1]) > alpha and (expect == 1 or float(cum[expect - 2]) <= alpha)
        assert int(svd_encode(m.float(), alpha).rank) == expect


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.9, 0.95, 0.98])
def test_reconstruction_error_is_the_energy_left_out(alpha):
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(48, 8, generator=gen) @ torch.diag(0.6 ** torch.arange(8.0)) @ torch.randn(8, 36, generator=gen)
    s = torch.linalg.svdvals(m.double())
    enc = svd_encode(m, alpha)
    r = int(enc.rank)
    err2 = float(torch.sum((svd_decode(enc, (48, 36)).double() - m.double()) ** 2))
    left = float(torch.sum(s[r:] ** 2))
    assert err2 == pytest.approx(left, rel=1e-3, abs=1e-6)  # Eckart-Young: the tail energy
    assert err2 / float(torch.sum(s**2)) < 1 - alpha        # what was kept is more than α


def test_conv_kernels_use_the_cout_by_cin_k_k_view_and_vectors_go_dense():
    a, c = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.linspace(-1.0, 1.0, 2 * 3 * 3)
    enc = make_algo("fedmic")._encode({"k": torch.outer(a, c).reshape(4, 2, 3, 3), "b": torch.ones(4)})
    assert int(enc["k"].rank) == 1 and enc["k"].u.shape == (4, 4) and enc["k"].vh.shape == (4, 18)
    assert isinstance(enc["b"], torch.Tensor) and torch.equal(enc["b"], torch.ones(4))


# ----- bytes -------------------------------------------------------------------------------------
def _trained_student(p, gen):
    """A student whose update is rank 1 on the classifier and fc, small noise on the convs."""
    s = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in p.items()}
    s["classifier.weight"] = p["classifier.weight"] + torch.outer(torch.tensor([1.0, -1.0, 2.0, 0.5]), torch.ones(512))
    s["fc.weight"] = p["fc.weight"] + torch.outer(torch.linspace(-1, 1, 512), torch.linspace(0, 1, 3136))
    return s


def test_upload_bytes_are_the_factor_sizes_and_w_aux_and_teacher_never_cross():
    algo = make_algo("fedmic")
    p = initial_params()
    torch.manual_seed(5)
    state = algo.init_client_state(p, 0, Federation(5))
    assert set(state) == {"teacher", "student", "visited", "w_aux"}
    assert torch.equal(state["w_aux"]["shared"], torch.eye(512))  # identity init (A.1)
    trees = {"teacher": state["teacher"], "student": _trained_student(p, torch.Generator().manual_seed(1)),
             "w_aux": {"shared": 2 * torch.eye(512)}}
    info = {"num_samples": torch.tensor(20.0), "steps": {"train": torch.tensor(3)}}
    up, new, ev = algo.finish(trees, {"start": p}, state, info, rnd_info())
    # only the student's update and n cross; W_aux and the teacher stay in the state
    assert set(up) == set(algo.upload_spec()) == {"update", "num_samples"}
    assert set(up["update"]) == set(p)
    assert new["w_aux"] is trees["w_aux"] and new["teacher"] is trees["teacher"] and ev is trees["student"]
    assert float(new["visited"]) == 1.0
    expected = 4  # num_samples, float32
    for k, v in up["update"].items():
        if isinstance(v, LowRank):
            pp, qq = v.u.shape[0], v.vh.shape[1]
            r = int(v.rank)
            expected += min(r * (pp + qq + 1), pp * qq) * 4 + 8
        else:
            assert v.dim() == 1
            expected += v.numel() * 4
    assert payload_nbytes(up) == expected
    assert int(up["update"]["classifier.weight"].rank) == 1 and int(up["update"]["fc.weight"].rank) == 1
    # hand count of the two rank-1 matrices
    assert payload_nbytes(up["update"]["fc.weight"]) == (512 + 3136 + 1) * 4 + 8
    assert payload_nbytes(up["update"]["classifier.weight"]) == (4 + 512 + 1) * 4 + 8
    # the compression ratio of the update (spec A.13 comm_up), as the engine logs it (bytes_up over
    # bytes_up_dense): bytes over the dense bytes of the same tensors, also for a stack of uploads
    dense = sum(v.numel() for v in p.values()) * 4
    assert payload_dense_nbytes(up["update"]) == dense
    assert payload_nbytes(up["update"]) / payload_dense_nbytes(up["update"]) == pytest.approx((expected - 4) / dense)
    stacked = tree_stack([up["update"], up["update"]])
    assert payload_nbytes(stacked) / payload_dense_nbytes(stacked) == pytest.approx((expected - 4) / dense)


def test_fedmic_c_sends_dense_updates():
    algo = make_algo("fedmic", gpd=False)
    assert not algo.upload_spec()["update"].compressed
    p = initial_params()
    st = _trained_student(p, torch.Generator().manual_seed(1))
    state = algo.init_client_state(p, 0, Federation(5))
    up, _, _ = algo.finish({"teacher": state["teacher"], "student": st, "w_aux": state["w_aux"]}, {"start": p},
                           state, {"num_samples": torch.tensor(3.0)}, rnd_info())
    assert not any(isinstance(v, LowRank) for v in up["update"].values())
    for k in p:
        torch.testing.assert_close(up["update"][k], st[k] - p[k])
    assert payload_nbytes(up["update"]) == sum(v.numel() for v in p.values()) * 4
    assert payload_dense_nbytes(up["update"]) == payload_nbytes(up["update"])  # ratio 1


# ----- Dual-KD on a hand case --------------------------------------------------------------------
def _softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


Z_T = np.array([[2.0, 0.0, -1.0], [0.5, 1.0, 0.0]])
Z_S = np.array([[0.0, 1.0, 0.0], [1.0, -1.0, 2.0]])
H_T = np.array([[1.0, 2.0], [0.0, -1.0]])
H_S = np.array([[0.5, 1.0], [2.0, 0.0]])
W = np.array([[1.0, 2.0], [0.0, 1.0]])  # not symmetric: H W, not H W^T
Y = np.array([0, 2])


def _hand():
    b = 2
    pt, ps = _softmax(Z_T), _softmax(Z_S)
    ce_t = float(np.mean(-np.log(pt[np.arange(b), Y])))
    ce_s = float(np.mean(-np.log(ps[np.arange(b), Y])))
    d = ce_t + ce_s + 1e-8
    rep = float(np.mean((H_S @ W - H_T @ W) ** 2)) / d       # full mean over samples and dims
    rep_plain = float(np.mean((H_S - H_T) ** 2)) / d
    kl = lambda p, q: float(np.mean(np.sum(p * np.log(p / q), -1)))  # noqa: E731  batch mean of sum over classes
    return dict(pt=pt, ps=ps, ce_t=ce_t, ce_s=ce_s, d=d, rep=rep, rep_plain=rep_plain,
                dec_t=kl(ps, pt) / d, dec_s=kl(pt, ps) / d, dec_t_lit=kl(pt, ps) / d, dec_s_lit=kl(ps, pt) / d)


def _inputs(dtype=torch.float64):
    t = lambda a: torch.tensor(a, dtype=dtype, requires_grad=True)  # noqa: E731
    return t(H_T), t(Z_T), t(H_S), t(Z_S), torch.tensor(Y), torch.full((2,), 0.5, dtype=dtype), t(W)


def test_dual_kd_values_on_the_hand_case():
    e = _hand()
    h_t, z_t, h_s, z_s, y, w, wa = _inputs()
    out = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa)
    assert e["rep"] > 0.3 and abs(e["dec_t"] - e["dec_s"]) > 1e-3  # every term matters here
    for key, val in [("task_t", e["ce_t"]), ("task_s", e["ce_s"]), ("D", e["d"]), ("rep_t", e["rep"]),
                     ("rep_s", e["rep"]), ("dec_t", e["dec_t"]), ("dec_s", e["dec_s"])]:
        assert out[key].item() == pytest.approx(val, rel=1e-10), key
    assert out["loss_t"].item() == pytest.approx(e["ce_t"] + e["dec_t"] + e["rep"], rel=1e-10)
    assert out["loss_s"].item() == pytest.approx(e["ce_s"] + e["dec_s"] + e["rep"], rel=1e-10)
    assert out["total"].item() == pytest.approx(out["loss_t"].item() + out["loss_s"].item(), rel=1e-12)
    # the literal Eq. 6 arguments: KL(p_own || p_other)
    lit = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa, kl_mode="as_written")
    assert lit["dec_t"].item() == pytest.approx(e["dec_t_lit"], rel=1e-10)
    assert lit["dec_s"].item() == pytest.approx(e["dec_s_lit"], rel=1e-10)
    # a padded sample (w = 0) changes nothing
    pad = lambda a, r: torch.cat([a.detach(), torch.tensor(r, dtype=a.dtype)])  # noqa: E731
    padded = dual_kd_terms(pad(h_t, [[9.0, 9.0]]), pad(z_t, [[5.0, -5.0, 0.0]]), pad(h_s, [[-9.0, 1.0]]),
                           pad(z_s, [[-3.0, 3.0, 1.0]]), torch.tensor([0, 2, 1]),
                           torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), wa.detach(), wa.detach())
    assert padded["total"].item() == pytest.approx(out["total"].item(), rel=1e-10)


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs, retain_graph=True, allow_unused=True)


def test_each_model_gets_only_its_own_loss_gradient():
    h_t, z_t, h_s, z_s, y, w, wa = _inputs()
    out = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa)
    # the student's loss gives the teacher nothing, and vice versa
    for g in _grads(out["loss_s"], h_t, z_t):
        assert g is None or torch.all(g == 0)
    for g in _grads(out["loss_t"], h_s, z_s):
        assert g is None or torch.all(g == 0)
    # so the total's gradient on each model's outputs is its own loss's
    e = _hand()
    g_zs, g_hs, g_zt = _grads(out["total"], z_s, h_s, z_t)
    onehot = np.eye(3)[Y]
    # d/dz_s [CE + KL(sg p_t || p_s)/sg D] = w (p_s - onehot) + w (p_s - p_t)/D   (D detached)
    np.testing.assert_allclose(g_zs.numpy(), 0.5 * (e["ps"] - onehot) + 0.5 * (e["ps"] - e["pt"]) / e["d"], rtol=1e-9)
    np.testing.assert_allclose(g_zt.numpy(), 0.5 * (e["pt"] - onehot) + 0.5 * (e["pt"] - e["ps"]) / e["d"], rtol=1e-9)
    # d/dH_s of mean((H_s W - sg(H_t) W)^2)/D = 2 (H_s - H_t) W W^T / (B d D)
    np.testing.assert_allclose(g_hs.numpy(), 2 * (H_S - H_T) @ W @ W.T / (2 * 2 * e["d"]), rtol=1e-9)
    # W_aux gets both copies of L_rep: 2 x d/dW mean(((H_s - H_t) W)^2)/D
    (g_w,) = _grads(out["total"], wa)
    diff = H_S - H_T
    np.testing.assert_allclose(g_w.numpy(), 2 * 2 * diff.T @ (diff @ W) / (2 * 2 * e["d"]), rtol=1e-9)


def test_detach_switches_fedkd_behaviour():
    h_t, z_t, h_s, z_s, y, w, wa = _inputs()
    e = _hand()
    # cross terms not detached (FedKD's code): the student's loss now reaches the teacher
    out = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa, detach_cross=False)
    assert out["total"].item() == pytest.approx(dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa)["total"].item())
    assert any(g is not None and torch.any(g != 0) for g in _grads(out["loss_s"], h_t, z_t))
    # the denominator not detached: the distillation terms push the task losses (-(L/D^2) dD)
    und = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa, detach_denominator=False)
    assert und["total"].item() == pytest.approx(out["total"].item(), rel=1e-10)
    (g_zs,) = _grads(und["total"], z_s)
    onehot = np.eye(3)[Y]
    dist = e["rep"] * 2 + e["dec_t"] + e["dec_s"]  # every /D term of the total (rep counted twice)
    expected = (0.5 * (e["ps"] - onehot) + 0.5 * (e["ps"] - e["pt"]) / e["d"]
                - dist / e["d"] * 0.5 * (e["ps"] - onehot))
    np.testing.assert_allclose(g_zs.numpy(), expected, rtol=1e-9)


def test_ablation_switches_remove_exactly_their_term():
    e = _hand()
    h_t, z_t, h_s, z_s, y, w, wa = _inputs()
    full = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa)
    a = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, None, None)                  # FedMIC-A: no W_aux
    b = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa, representation=False)  # FedMIC-B: no rep-DDL
    c = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, wa, wa, decision=False)        # no decision DDL
    assert a["rep_t"].item() == pytest.approx(e["rep_plain"], rel=1e-10) and a["rep_s"].item() == a["rep_t"].item()
    assert b["rep_t"].item() == 0 and b["rep_s"].item() == 0
    assert c["dec_t"].item() == 0 and c["dec_s"].item() == 0
    for key in ("task_t", "task_s", "dec_t", "dec_s"):
        assert a[key].item() == full[key].item() and b[key].item() == full[key].item()
    for key in ("task_t", "task_s", "rep_t", "rep_s"):
        assert c[key].item() == full[key].item()
    # per-model matrices (Fig. 2 caption): H_s W_s - H_t W_t
    w2 = torch.tensor([[0.5, 0.0], [1.0, 1.0]], dtype=torch.float64)
    pm = dual_kd_terms(h_t, z_t, h_s, z_s, y, w, w2, wa)
    assert pm["rep_s"].item() == pytest.approx(float(np.mean((H_S @ W - H_T @ w2.numpy()) ** 2)) / e["d"], rel=1e-10)

    # in the algorithm: what is kept and trained
    def setup(**kw):
        algo = make_algo("fedmic", **kw)
        state = algo.init_client_state(initial_params(), 0, Federation(5))
        return dict(algo.phases(rnd_info())[0].trainable), set(state.get("w_aux", {}))

    assert setup() == ({"teacher": None, "student": None, "w_aux": None}, {"shared"})
    assert setup(aux_matrix=False) == ({"teacher": None, "student": None}, set())
    assert setup(representation_ddl=False) == ({"teacher": None, "student": None}, set())
    assert setup(freeze_aux=True) == ({"teacher": None, "student": None}, {"shared"})
    assert setup(aux_mode="per_model") == ({"teacher": None, "student": None, "w_aux": None}, {"t", "s"})


def test_algorithm_loss_is_dual_kd_on_the_models_features():
    algo = make_algo("fedmic")
    p = initial_params()  # drawn after manual_seed(0)
    torch.manual_seed(7)
    state = algo.init_client_state(p, 0, Federation(5))
    assert not torch.equal(state["teacher"]["fc.weight"], p["fc.weight"])  # independent teacher init (A.6)
    assert torch.equal(make_algo("fedmic", teacher_init="global").init_client_state(p, 0, Federation(5))["teacher"]["fc.weight"],
                       p["fc.weight"])
    gen = torch.Generator().manual_seed(2)
    batch = {"x": torch.randn(5, 3, 28, 28, generator=gen), "y": torch.tensor([0, 1, 2, 3, 0]),
             "w": torch.full((5,), 0.2)}
    wa = torch.eye(512) + 0.01 * torch.randn(512, 512, generator=gen)
    trees = {"teacher": state["teacher"], "student": p, "w_aux": {"shared": wa}}
    h_t, z_t = algo.forward.features_logits(state["teacher"], batch["x"], train=True)
    h_s, z_s = algo.forward.features_logits(p, batch["x"], train=True)
    ref = dual_kd_terms(h_t, z_t, h_s, z_s, batch["y"], batch["w"], wa, wa)
    assert algo._loss(trees, {}, batch).item() == pytest.approx(ref["total"].item(), rel=1e-6)


# ----- the round: synced global student, aggregation weights, personalized model, DP -------------
def _uploads(algo, params, seed, sizes):
    gen = torch.Generator().manual_seed(seed)
    ups = []
    for _ in sizes:
        delta = low_rank_delta(params, gen)
        ups.append(algo._encode(delta))
    return {"update": tree_stack(ups), "num_samples": torch.tensor(sizes)}


@pytest.mark.parametrize("gpd", [True, False])
def test_client_student_is_the_servers_model_and_weights_are_sample_counts(gpd):
    algo = make_algo("fedmic", gpd=gpd)
    params = initial_params()
    clients = torch.tensor([0, 2])
    server = algo.init_server(params, Federation(3))
    state = algo.init_client_state(params, 0, Federation(5))
    info = {"client": torch.tensor(0), "num_samples": torch.tensor(10.0), "label_hist": torch.ones(4)}
    for r in range(3):
        down = algo.download(server, clients, rnd_info(r))
        assert down.to_all and (r == 0) == ("student" in down.shared)
        trees, ctx = algo.begin(down.received(), state, info, rnd_info(r))
        assert set(trees) == {"teacher", "student", "w_aux"}
        for name in params:
            torch.testing.assert_close(trees["student"][name], server["model"][name], atol=1e-6, rtol=0)
        uploads = _uploads(algo, params, 10 + r, [10.0, 30.0])
        new = algo.aggregate(server, uploads, clients, rnd_info(r))
        dec = decode_tree(uploads["update"], algo.update_shapes())
        mean = {n: 0.25 * v[0] + 0.75 * v[1] for n, v in dec.items()}  # ∝ n_k (A.5)
        applied = decode_tree(encode_tree(mean, 0.98), algo.update_shapes()) if gpd else mean
        for name in params:
            torch.testing.assert_close(new["model"][name], server["model"][name] + applied[name], atol=1e-6, rtol=0)
        assert new["prev"] is server["model"]
        if gpd:
            assert 0 < int(new["update"]["fc.weight"].rank) < 512  # the broadcast is compressed again
        server = new
    trees, _ = algo.begin(algo.download(server, clients, rnd_info(3)).received(), state, info, rnd_info(3))
    for name in params:
        torch.testing.assert_close(trees["student"][name], server["model"][name], atol=1e-6, rtol=0)
    # uniform weights (FedKD's) as an option
    uni = make_algo("fedmic", weighting="uniform")
    assert uni._weights(torch.tensor([10.0, 30.0])).tolist() == [0.5, 0.5]


def test_personalized_model_is_the_last_student_or_the_global_one_before_a_visit():
    algo = make_algo("fedmic")
    p = initial_params()
    state = algo.init_client_state(p, 0, Federation(5))
    server = {"model": {k: v + 1.0 for k, v in p.items()}}
    assert all(torch.equal(algo.personalized_model(state, server)[k], server["model"][k]) for k in p)
    seen = {**state, "student": {k: v - 1.0 for k, v in p.items()}, "visited": torch.tensor(1.0)}
    assert all(torch.equal(algo.personalized_model(seen, server)[k], p[k] - 1.0) for k in p)
    assert algo.personalized and algo.has_global_model


def test_dp_noise_on_the_payload_only_where_floats_are_sent():
    algo = make_algo("fedmic", dp_noise_std=0.01)
    shapes = {"m": (16, 12), "z": (16, 12), "d": (6, 5), "b": (4,)}
    gen0 = torch.Generator().manual_seed(0)
    enc = tree_stack([encode_tree({"m": _diag([2.0, 1.0]), "z": torch.zeros(16, 12),
                                   "d": torch.randn(6, 5, generator=gen0), "b": torch.ones(4)}, 0.98)] * 2)
    assert enc["m"].rank.tolist() == [2, 2] and enc["z"].rank.tolist() == [0, 0] and enc["d"].rank.tolist() == [5, 5]
    noisy = payload_noise(enc, shapes, 0.01, torch.Generator().manual_seed(1))
    clean = decode_tree(enc, shapes)
    assert torch.equal(noisy["z"], clean["z"])               # rank 0: nothing sent, no noise
    dm = noisy["m"] - clean["m"]
    assert torch.any(dm != 0)  # noise only on the 2 kept triplets: the received matrix has rank 2
    assert torch.linalg.matrix_rank(noisy["m"].double(), atol=1e-6).tolist() == [2, 2]
    nd = (noisy["d"] - clean["d"]).flatten()
    assert 0.005 < float(nd.std()) < 0.02                    # the dense matrix: every entry
    assert 0.003 < float((noisy["b"] - clean["b"]).std()) < 0.03
    # the same (seed, round) draws the same noise; τ = 0 is the plain method
    params = initial_params()
    ups = _uploads(algo, params, 3, [10.0, 30.0])
    server = algo.init_server(params, Federation(3))
    a = algo.aggregate(server, ups, torch.tensor([0, 1]), rnd_info(0))
    b = algo.aggregate(server, ups, torch.tensor([0, 1]), rnd_info(0))
    plain = make_algo("fedmic").aggregate(server, ups, torch.tensor([0, 1]), rnd_info(0))
    rec = make_algo("fedmic", dp_noise_std=0.01, dp_target="reconstructed_update").aggregate(
        server, ups, torch.tensor([0, 1]), rnd_info(0))
    for k in params:
        assert torch.equal(a["model"][k], b["model"][k])
    assert not torch.allclose(a["model"]["conv1.bias"], plain["model"]["conv1.bias"], atol=1e-4)
    assert not torch.allclose(rec["model"]["conv1.bias"], plain["model"]["conv1.bias"], atol=1e-4)


def test_kl_batchmean_matches_torch():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    ref = torch.nn.KLDivLoss(reduction="batchmean")(torch.log_softmax(s, -1), torch.softmax(t, -1))
    assert kl_batchmean(t, s, torch.full((5,), 0.2)).item() == pytest.approx(ref.item(), rel=1e-6)


# ----- the engine: options on both executors, a BatchNorm model, the bytes --------------------------
def test_options_on_both_executors_with_batchnorm(fed_data):
    import pandas as pd

    from tests.conftest import assert_trees_close
    from tests.test_contract import metrics, run

    opts = dict(aux_mode="per_model", dp_noise_std=1e-3, kl_mode="as_written")
    crossed: list = []
    algo, seq = run(fed_data, "fedmic", "sequential", model="cnn4bn", capture=crossed, **opts)
    _, stk = run(fed_data, "fedmic", "stacked", model="cnn4bn", **opts)
    pd.testing.assert_frame_equal(metrics(seq), metrics(stk))
    # the factors of the broadcast are unique only up to signs and rotations within (nearly) equal
    # singular values: compare the models and the update they encode
    # float order differs between the executors and with the thread count (masked BatchNorm, SVD): ~1e-4
    assert_trees_close(seq.server["model"], stk.server["model"], atol=1e-3, rtol=1e-3)
    assert_trees_close(decode_tree(seq.server["update"], algo.update_shapes()),
                       decode_tree(stk.server["update"], algo.update_shapes()), atol=1e-3, rtol=1e-3)
    assert_trees_close(seq.client_states, stk.client_states, atol=1e-3, rtol=1e-3)
    # BatchNorm running statistics travel (dense) with the update; num_batches_tracked does not
    names = set(algo.update_names())
    assert any(k.endswith("running_mean") for k in names) and not any(k.endswith("num_batches_tracked") for k in names)
    # bytes: the uploads as sent; down: round 0 the dense model, then the compressed broadcast, K times each
    assert seq.rounds["bytes_up"].tolist() == [payload_nbytes(u) for u in crossed]
    assert (seq.rounds["bytes_up"] < 3 * 4 * sum(int(np.prod(s)) for s in algo.update_shapes().values())).all()
    dense_model = sum(int(np.prod(s)) * 4 for k, s in algo.forward.shapes.items() if not k.endswith("tracked"))
    assert seq.rounds["bytes_down"].iloc[0] >= 5 * dense_model
    assert seq.rounds["bytes_down"].iloc[1] < seq.rounds["bytes_down"].iloc[0]
    # W_aux per branch stays in the client states, trained (no longer the identity) where sampled
    w_t = seq.client_states["w_aux"]["t"]
    assert w_t.shape[1:] == (512, 512)
    assert any(not torch.equal(w_t[i], torch.eye(512)) for i in range(w_t.shape[0]))


def test_without_distillation_and_gpd_the_global_student_is_fedavgs(fed_data):
    # both distillation terms and GPD off: the student trains on its own CE and the server adds
    # the n-weighted mean update, i.e. FedAvg's model up to float rounding (the records differ:
    # FedMIC adds the personalized student, so its fedavg_when is None)
    from tests.conftest import assert_trees_close
    from tests.test_contract import cached

    _, avg = cached(fed_data, "fedavg", model="cnn4")
    _, red = cached(fed_data, "fedmic", model="cnn4", decision_ddl=False, representation_ddl=False, gpd=False)
    assert_trees_close(avg.server["model"], red.server["model"], atol=1e-5)
    la = lambda r: r.records[r.records["view"] == "local_after_training"]["accuracy"].to_numpy()  # noqa: E731
    np.testing.assert_allclose(la(avg), la(red), atol=1e-9)
