"""FedKD (Wu et al., Nat. Commun. 2022): the truncated-SVD codec of its updates, its energy
schedule, its adaptive mutual distillation loss, and the mentee kept in sync with the server."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from medpfl.algorithms.fedkd import energy_threshold, kl_mean, mutual_distillation_loss
from medpfl.fl.payload import LowRank, decode_tree, encode_tree, payload_nbytes, svd_decode, svd_encode
from medpfl.fl.optim import clip_by_global_norm
from medpfl.fl.program import RoundInfo
from medpfl.fl.tree import tree_stack
from medpfl.fl.program import Federation
from tests.conftest import initial_params, make_algo, phase_chains
from tests.helpers import low_rank_delta



SIGMA = (3.0, 2.0, 1.0, 0.5)  # energies 9, 4, 1, 0.25 of 14.25: cumulative 0.6316, 0.9123, 0.9825, 1


def _orthonormal(rows, cols, seed):
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _known(p=10, q=8, sigma=SIGMA):
    u, v = _orthonormal(p, len(sigma), 0), _orthonormal(q, len(sigma), 1)
    s = torch.tensor(sigma, dtype=torch.float64)
    return u, s, v, (u * s) @ v.T


@pytest.mark.parametrize("energy,rank", [(0.5, 1), (0.63, 1), (0.632, 2), (0.9, 2), (0.95, 3), (0.98, 3),
                                         (0.99, 4)])
def test_svd_rank_is_smallest_whose_energy_exceeds_threshold(energy, rank):
    u, s, v, m = _known()  # 10 x 8: r (P+Q+1) = 19 r < 80 for r <= 4, so every rank compresses
    enc = svd_encode(m.float(), energy)
    assert isinstance(enc, LowRank)
    assert enc.rank.dtype == torch.int64 and int(enc.rank) == rank
    k = 8
    assert enc.u.shape == (10, k) and enc.s.shape == (k,) and enc.vh.shape == (k, 8)
    # the dropped components are zero, the kept ones are the known singular values
    assert torch.all(enc.s[rank:] == 0) and torch.all(enc.u[:, rank:] == 0) and torch.all(enc.vh[rank:] == 0)
    np.testing.assert_allclose(enc.s[:rank].numpy(), SIGMA[:rank], atol=1e-5)
    # decodes to the rank-r reconstruction
    expected = (u[:, :rank] * s[:rank]) @ v[:, :rank].T
    torch.testing.assert_close(svd_decode(enc, (10, 8)), expected.float(), atol=1e-5, rtol=0)
    assert payload_nbytes(enc) == rank * 19 * 4 + 8


def test_svd_zero_matrix_has_rank_zero():
    enc = svd_encode(torch.zeros(10, 8), 0.95)
    assert int(enc.rank) == 0
    assert torch.equal(svd_decode(enc, (10, 8)), torch.zeros(10, 8))
    assert payload_nbytes(enc) == 8  # only the rank


def test_svd_keeps_everything_when_factors_are_not_smaller():
    # 6 x 5: PQ = 30, P+Q+1 = 12; at 0.95 the rank is 3 and 36 >= 30: sent dense (all k = 5 components)
    _, _, _, m = _known(6, 5)
    enc = svd_encode(m.float(), 0.95)
    assert int(enc.rank) == 5
    torch.testing.assert_close(svd_decode(enc, (6, 5)), m.float(), atol=1e-5, rtol=0)
    assert payload_nbytes(enc) == 30 * 4 + 8
    # rank 2 (24 < 30) still compresses
    assert int(svd_encode(m.float(), 0.9).rank) == 2


def test_svd_one_dim_passes_through_and_conv_kernels_use_the_matrix_view():
    b = torch.tensor([1.0, -2.0, 3.0])
    assert svd_encode(b, 0.9) is b and svd_decode(b, (3,)) is b
    # a rank-1 conv kernel [4, 2, 3, 3] as the 4 x 18 matrix a b^T
    a, c = torch.tensor([1.0, 2.0, -1.0, 0.5]), torch.linspace(-1, 1, 18)
    kernel = torch.outer(a, c).reshape(4, 2, 3, 3)
    enc = svd_encode(kernel, 0.9)
    assert int(enc.rank) == 1 and enc.u.shape == (4, 4) and enc.vh.shape == (4, 18)
    torch.testing.assert_close(svd_decode(enc, (4, 2, 3, 3)), kernel, atol=1e-6, rtol=0)
    assert payload_nbytes(enc) == (4 + 18 + 1) * 4 + 8


def test_payload_nbytes_of_a_stack_with_different_ranks():
    _, _, _, m = _known()
    stack = tree_stack([svd_encode(m.float(), 0.5), svd_encode(m.float(), 0.95)])  # ranks 1 and 3
    assert stack.rank.tolist() == [1, 3] and stack.u.shape == (2, 10, 8)
    assert payload_nbytes(stack) == (19 + 57) * 4 + 2 * 8
    # a dense 6 x 5 row counts P Q numbers, not r (P+Q+1)
    _, _, _, small = _known(6, 5)
    mixed = tree_stack([svd_encode(small.float(), 0.5), svd_encode(small.float(), 0.95)])  # ranks 1 and 5 (dense)
    assert mixed.rank.tolist() == [1, 5]
    assert payload_nbytes(mixed) == (12 + 30) * 4 + 16
    # in a tree next to a dense vector
    assert payload_nbytes({"w": svd_encode(m.float(), 0.9), "b": torch.zeros(5)}) == 2 * 19 * 4 + 8 + 5 * 4
    # svd_decode keeps the leading stack dim
    assert svd_decode(stack, (10, 8)).shape == (2, 10, 8)


def test_energy_threshold_schedule():
    assert energy_threshold(0, 10, 0.95, 0.98) == pytest.approx(0.953)
    assert energy_threshold(4, 10, 0.95, 0.98) == pytest.approx(0.965)
    assert energy_threshold(9, 10, 0.95, 0.98) == pytest.approx(0.98)
    assert energy_threshold(0, 1, 0.95, 0.98) == pytest.approx(0.98)
    algo = make_algo("fedkd")
    assert (algo.cfg.energy_start, algo.cfg.energy_end) == (0.95, 0.98)


def _softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")  # the reduction FedKD's code uses, on purpose
def test_kl_mean_is_kldivloss_default_mean():
    torch.manual_seed(0)
    target, logits = torch.randn(5, 4), torch.randn(5, 4)
    ref = torch.nn.KLDivLoss()(F.log_softmax(logits, -1), F.softmax(target, -1))
    assert kl_mean(target, logits, torch.full((5,), 0.2)).item() == pytest.approx(ref.item(), rel=1e-6)
    # by hand: sum over B x C of p_t (log p_t - log p_s) / (B C)
    pt, ps = _softmax(target.numpy().astype(np.float64)), _softmax(logits.numpy().astype(np.float64))
    assert ref.item() == pytest.approx(float(np.sum(pt * (np.log(pt) - np.log(ps))) / 20), rel=1e-5)


def test_mutual_distillation_loss_hand_computed():
    o_t = np.array([[2.0, 0.0, -1.0], [0.5, 1.0, 0.0]])
    o_s = np.array([[0.0, 1.0, 0.0], [1.0, -1.0, 2.0]])
    z_t = np.array([[1.0, 2.0], [0.0, -1.0]])
    z_s = np.array([[0.5, 1.0], [2.0, 0.0]])
    w_h = np.array([[1.0, 2.0], [0.0, 1.0]])  # not symmetric: W_h z_s, not z_s W_h
    y = np.array([0, 2])
    b, c = o_t.shape

    def ce(o):
        return float(np.mean(-np.log(_softmax(o)[np.arange(b), y])))

    pt, ps = _softmax(o_t), _softmax(o_s)
    ce_t, ce_s = ce(o_t), ce(o_s)
    d = ce_t + ce_s
    kl_s_t = float(np.sum(ps * np.log(ps / pt)) / (b * c))  # KLDivLoss(log p_t, p_s): the mentor's term
    kl_t_s = float(np.sum(pt * np.log(pt / ps)) / (b * c))  # the mentee's term
    l_h = float(np.mean((z_t - z_s @ w_h.T) ** 2))          # MSE over samples and dims
    expected = ce_t + ce_s + kl_s_t / d + kl_t_s / d + 2 * l_h / d
    expected_no_h = ce_t + ce_s + kl_s_t / d + kl_t_s / d
    assert l_h > 0.5 and abs(kl_s_t - kl_t_s) > 1e-3  # every term matters in this case

    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    args = (t(z_t), t(o_t), t(z_s), t(o_s), t(w_h), torch.tensor(y), torch.full((2,), 0.5))
    assert mutual_distillation_loss(*args).item() == pytest.approx(expected, rel=1e-5)
    assert mutual_distillation_loss(*args, hidden=False).item() == pytest.approx(expected_no_h, rel=1e-5)
    # with W_h transposed the hidden term differs (the orientation is checked)
    wrong = mutual_distillation_loss(*args[:4], t(w_h.T), *args[5:]).item()
    assert abs(wrong - expected) > 1e-3

    # a padded sample (w = 0) changes nothing
    pad = lambda a, r: torch.cat([a, r])  # noqa: E731
    padded = (pad(t(z_t), torch.full((1, 2), 9.0)), pad(t(o_t), torch.tensor([[5.0, -5.0, 0.0]])),
              pad(t(z_s), torch.full((1, 2), -9.0)), pad(t(o_s), torch.tensor([[-3.0, 3.0, 1.0]])), t(w_h),
              torch.tensor([0, 2, 1]), torch.tensor([0.5, 0.5, 0.0]))
    assert mutual_distillation_loss(*padded).item() == pytest.approx(expected, rel=1e-5)


def test_phase_and_finish():
    algo = make_algo("fedkd")
    rnd = RoundInfo(round=0, rounds=4, lr=0.01, num_clients=3, seed=1, base_lr=0.01)
    (ph,) = algo.phases(rnd)
    assert dict(ph.trainable) == {"mentor": None, "mentee": None, "w_h": None}
    chains = phase_chains(ph, 0.01)
    assert all(c.transforms[0] == clip_by_global_norm(10.0) for c in chains.values())  # each model clipped
    assert chains["mentee"].lr == pytest.approx(0.005) and chains["mentor"].lr == chains["w_h"].lr == 0.01
    # decayed alike: at a round lr of 0.005 the mentee gets 0.0025
    assert phase_chains(ph, 0.005)["mentee"].lr == pytest.approx(0.0025)
    assert dict(make_algo("fedkd", hidden_loss=False).phases(rnd)[0].trainable) == {"mentor": None, "mentee": None}

    p = initial_params()
    state = algo.init_client_state(p, 0, Federation(5))
    assert state["w_h"]["weight"].shape == (512, 512)
    start = {k: v.clone() for k, v in p.items()}
    gen = torch.Generator().manual_seed(2)
    # a rank-1 update of the classifier weight, and a tiny random one elsewhere
    mentee = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in p.items()}
    mentee["classifier.weight"] = p["classifier.weight"] + torch.outer(torch.tensor([1.0, -1.0, 2.0, 0.5]),
                                                                       torch.ones(512))
    trees = {"mentor": {k: v + 1 for k, v in p.items()}, "mentee": mentee, "w_h": state["w_h"]}
    info = {"num_samples": torch.tensor(20.0), "steps": {"train": torch.tensor(3)}}
    up, new, ev = algo.finish(trees, {"start": start}, state, info, rnd)
    assert set(up) == set(algo.upload_spec()) == {"update", "num_samples"}
    assert int(up["update"]["classifier.weight"].rank) == 1
    dec = decode_tree(up["update"], algo.forward.shapes)
    # float32 SVD reconstructs to about eps * sigma_max * f(n) (sigma_max = 56.6 here): 2.5e-4 with
    # MKL on an AMD EPYC (AVX-512), under 1e-5 on other CPUs; a wrong decode would be off by O(1)
    torch.testing.assert_close(dec["classifier.weight"], mentee["classifier.weight"] - start["classifier.weight"],
                               atol=1e-3, rtol=0)
    torch.testing.assert_close(dec["classifier.bias"], mentee["classifier.bias"] - start["classifier.bias"])
    assert set(new) == {"mentor", "w_h"} and ev is trees["mentor"] and new["mentor"] is trees["mentor"]
    assert algo.personalized_model(new, {}) is trees["mentor"]


def _uploads(algo, params, rnd, seed, sizes):
    energy = energy_threshold(rnd.round, rnd.rounds, algo.cfg.energy_start, algo.cfg.energy_end)
    gen = torch.Generator().manual_seed(seed)
    ups = []
    for _ in sizes:
        delta = low_rank_delta(params, gen)
        ups.append(encode_tree(delta, energy))
    return {"update": tree_stack(ups), "num_samples": torch.tensor(sizes)}


def test_client_mentee_is_the_servers_model_after_every_round():
    algo = make_algo("fedkd")
    params = initial_params()
    k = 3
    clients = torch.tensor([0, 2])
    server = algo.init_server(params, Federation(k))
    state = algo.init_client_state(params, 0, Federation(5))
    info = {"client": torch.tensor(0), "num_samples": torch.tensor(10.0), "label_hist": torch.ones(4)}
    for r in range(3):
        rnd = RoundInfo(round=r, rounds=3, lr=0.01, num_clients=k, seed=1, base_lr=0.01)
        down = algo.download(server, clients, rnd)
        assert down.to_all
        trees, ctx = algo.begin(down.received(), state, info, rnd)
        for name in params:
            torch.testing.assert_close(trees["mentee"][name], server["model"][name], atol=1e-6, rtol=0)
        assert ctx["start"] is trees["mentee"]
        uploads = _uploads(algo, params, rnd, seed=10 + r, sizes=[10.0, 30.0])
        new = algo.aggregate(server, uploads, clients, rnd)
        # the server applies the compressed uniform mean of the decoded updates (not ∝ n_k)
        energy = energy_threshold(r, 3, 0.95, 0.98)
        mean = {n: v.mean(0) for n, v in decode_tree(uploads["update"], algo.forward.shapes).items()}
        enc = encode_tree(mean, energy)
        applied = decode_tree(enc, algo.forward.shapes)
        for name in params:
            torch.testing.assert_close(new["model"][name], server["model"][name] + applied[name], atol=1e-7, rtol=0)
        assert 0 < int(enc["fc.weight"].rank) < 64  # truncated: the broadcast is lossy
        lost = max(float(torch.linalg.norm(applied[n] - mean[n]) / torch.linalg.norm(mean[n])) for n in applied)
        assert lost > 1e-2  # some matrix lost components
        assert new["prev"] is server["model"]
        server = new
    # and the last round's update reaches the clients too
    rnd = RoundInfo(round=3, rounds=3, lr=0.01, num_clients=k, seed=1, base_lr=0.01)
    trees, _ = algo.begin(algo.download(server, clients, rnd).received(), state, info, rnd)
    for name in params:
        torch.testing.assert_close(trees["mentee"][name], server["model"][name], atol=1e-6, rtol=0)
