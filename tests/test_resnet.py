"""The zoo's ResNets (medpfl.models.resnet): the standard parameter counts of He et al.'s
ResNet-18 and ResNet-101, the sizes documented in docs/models.md, torchvision's layer names,
the stems' resolutions at 64 px, the parts (head ``fc``, body, ``bn`` found by type), masked
BatchNorm statistics in padded batches, the 3D variant, and FedAvg/FedBN through both
executors with equal results (torch.func.vmap)."""

from __future__ import annotations

import pytest
import torch

from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.synthetic import write_synthetic_npz
from medpfl.fl.functional import make_forward, model_state, template_on
from medpfl.models import build_model, resolve_model_args
from tests.conftest import make_fed_data
from tests.test_models import _assert_equal_runs, _run

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _count(name: str, c: int, k: int, **args) -> int:
    with torch.device("meta"):  # no memory, no init cost: shapes only
        return _n_params(build_model(name, c, k, 64, args))


def test_standard_parameter_counts():
    """He et al.'s ImageNet models (imagenet stem, 3 channels, 1000 classes): torchvision's
    resnet18 has 11,689,512 parameters and resnet101 44,549,160."""
    assert _count("resnet18", 3, 1000, stem="imagenet") == 11_689_512
    assert _count("resnet101", 3, 1000, stem="imagenet") == 44_549_160


@pytest.mark.parametrize("name,stem,c,k,expected", [
    # the standard count with the stem's conv1 (C·64·7² or C·64·3²) and the head (512 or 2048 → k) swapped in
    ("resnet18", "small", 3, 8, 11_689_512 - 3 * 64 * 49 + 3 * 64 * 9 - 513_000 + 512 * 8 + 8),  # BloodMNIST
    ("resnet18", "imagenet", 3, 8, 11_689_512 - 513_000 + 512 * 8 + 8),
    ("resnet18", "small", 1, 11, 11_689_512 - 3 * 64 * 49 + 64 * 9 - 513_000 + 512 * 11 + 11),  # OrganSMNIST
    ("resnet101", "small", 3, 8, 44_549_160 - 3 * 64 * 49 + 3 * 64 * 9 - 2_049_000 + 2048 * 8 + 8),
    ("resnet101", "imagenet", 3, 8, 44_549_160 - 2_049_000 + 2048 * 8 + 8),
    ("resnet101", "small", 1, 8, 44_549_160 - 3 * 64 * 49 + 64 * 9 - 2_049_000 + 2048 * 8 + 8),  # TissueMNIST
    ("resnet101", "small", 1, 11, 44_549_160 - 3 * 64 * 49 + 64 * 9 - 2_049_000 + 2048 * 11 + 11),
    ("resnet101", "imagenet", 1, 11, 44_549_160 - 3 * 64 * 49 + 64 * 49 - 2_049_000 + 2048 * 11 + 11),
    ("resnet101", "small", 64, 11, 44_549_160 - 3 * 64 * 49 + 64 * 64 * 9 - 2_049_000 + 2048 * 11 + 11),  # 3D_64
])
def test_documented_sizes(name, stem, c, k, expected):
    """The sizes in docs/models.md (FedMIC's data sets at 64 px)."""
    documented = {("resnet18", "small", 3, 8): 11_172_936, ("resnet18", "imagenet", 3, 8): 11_180_616,
                  ("resnet18", "small", 1, 11): 11_173_323, ("resnet101", "small", 3, 8): 42_508_872,
                  ("resnet101", "imagenet", 3, 8): 42_516_552, ("resnet101", "small", 1, 8): 42_507_720,
                  ("resnet101", "small", 1, 11): 42_513_867, ("resnet101", "imagenet", 1, 11): 42_516_427,
                  ("resnet101", "small", 64, 11): 42_550_155}
    assert _count(name, c, k, stem=stem) == expected == documented[(name, stem, c, k)]


def test_3d_and_small_sizes():
    """ResNet-18 3D: every 3x3 kernel becomes 3x3x3; width 16 is the CPU-sized ResNet-18."""
    assert _count("resnet18_3d", 64, 11) == 33_145_419
    assert _count("resnet18_3d", 64, 11, stem="imagenet") == 33_165_643
    assert _count("resnet18_3d", 28, 11) == _count("resnet18_3d", 64, 11)  # depth is not a channel count
    assert _count("resnet18", 3, 8, width=16) == 701_208


def test_args_defaults_and_validation():
    assert resolve_model_args("resnet101", None) == {"stem": "small", "width": 64}
    with pytest.raises(ValueError, match=r"train\.model_args: stem: .*'small' or 'imagenet'"):
        build_model("resnet18", 3, 8, 28, {"stem": "cifar"})
    with pytest.raises(ValueError, match=r"train\.model_args: width: .*greater than or equal to 1"):
        build_model("resnet18", 3, 8, 28, {"width": 0})


def test_torchvision_layer_names_and_features():
    with torch.device("meta"):
        m18 = build_model("resnet18", 3, 8, 64)
        m101 = build_model("resnet101", 1, 11, 64, {"stem": "imagenet"})
    s18, s101 = m18.state_dict(), m101.state_dict()
    for k in ("conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer1.1.bn2.weight",
              "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_var", "layer4.1.conv2.weight",
              "fc.weight", "fc.bias"):
        assert k in s18, k
    assert "layer1.0.downsample.0.weight" not in s18  # BasicBlock: identity where the shape is kept
    assert {"layer1.0.downsample.0.weight", "layer3.22.conv3.weight", "layer4.2.bn3.bias"} <= set(s101)
    assert tuple(s18["conv1.weight"].shape) == (64, 3, 3, 3) and tuple(s101["conv1.weight"].shape) == (64, 1, 7, 7)
    assert tuple(s101["layer2.0.conv2.weight"].shape) == (128, 128, 3, 3)  # the stride sits in the 3x3 (v1.5)
    assert make_forward(m18).feature_dim == 512 and make_forward(m101).feature_dim == 2048
    assert make_forward(build_model("resnet18", 3, 8, 28, {"width": 16}).to("meta")).feature_dim == 128


@pytest.mark.parametrize("stem,side", [("small", 8), ("imagenet", 2)])
def test_stem_resolution_at_64_px(stem, side):
    """layer4's feature map for a 64-px image: 8x8 with the small stem, 2x2 with He et al.'s
    (spec A.9: "the standard stem reduces 64 -> 2x2 at layer4")."""
    torch.manual_seed(0)
    m = build_model("resnet18", 1, 8, 64, {"stem": stem, "width": 4})
    seen = []
    m.layer4.register_forward_hook(lambda mod, inp, out: seen.append(tuple(out.shape)))
    z, logits = m(torch.randn(2, 1, 64, 64), with_features=True)
    assert seen == [(2, 32, side, side)] and z.shape == (2, 32) and logits.shape == (2, 8)


@pytest.mark.parametrize("name", ["resnet18", "resnet101", "resnet18_3d"])
def test_parts_head_is_fc_and_bn_is_every_batchnorm_entry(name):
    m = build_model(name, 3, 4, 28, {"width": 2})
    bn_modules = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(bn_modules) == {"resnet18": 20, "resnet18_3d": 20, "resnet101": 104}[name]  # 1 + blocks + projections
    f = make_forward(m.to("meta"))
    assert f.parts["head"] == ("fc.weight", "fc.bias")
    assert list(f.parts["bn"]) == [f"{b}.{k}" for b in bn_modules for k in BN_KEYS]
    assert set(f.parts["bn"]) <= set(f.parts["body"])
    assert set(f.parts["body"]) | set(f.parts["head"]) == set(f.shapes)
    assert set(f.buffers) == {k for k in f.parts["bn"] if k.rsplit(".", 1)[1] in BN_KEYS[2:]}


@pytest.mark.parametrize("name", ["resnet18", "resnet18_3d"])
def test_masked_batchnorm_ignores_padding(name):
    """Training-mode statistics over the real samples only: padded rows change neither the real
    samples' outputs nor the running statistics."""
    torch.manual_seed(0)
    m = build_model(name, 3, 4, 16, {"width": 4})
    torch.manual_seed(0)
    ref = build_model(name, 3, 4, 16, {"width": 4})
    x = torch.randn(6, 3, 16, 16)
    mask = torch.tensor([True] * 4 + [False] * 2)
    out = m(torch.cat([x[:4], 100 * torch.randn(2, 3, 16, 16)]), mask=mask)[:4]
    torch.testing.assert_close(out, ref(x[:4]))
    torch.testing.assert_close(model_state(m), model_state(ref))


def test_3d_model_reads_a_sample_as_a_one_channel_volume():
    """[B, D, H, W] -> [B, 1, D, H, W]: 3D kernels on one input channel; the depth need not be the
    side, and any depth gives the same parameters."""
    torch.manual_seed(0)
    m = build_model("resnet18_3d", 8, 3, 12, {"width": 2})
    assert tuple(m.conv1.weight.shape) == (2, 1, 3, 3, 3) and isinstance(m.layer1[0].bn1, torch.nn.BatchNorm3d)
    assert m(torch.randn(2, 8, 12, 12)).shape == (2, 3)
    m.eval()
    x = torch.randn(2, 8, 12, 12)
    torch.testing.assert_close(m(x), m.fc(m.features(x)))


def test_resnet_on_vector_data_names_the_model():
    with pytest.raises(ValueError, match=r"train\.model=resnet18_3d needs image samples .*\[60\].*mlr or mlp"):
        build_model("resnet18_3d", 60, 10, None)


@pytest.fixture(scope="module")
def small_fed(tmp_path_factory):
    """4 clients of 3x12x12 synthetic images (120 train samples, 4 classes): ResNets are deep,
    so the executor comparisons use small images on the 2-core CPU."""
    d = tmp_path_factory.mktemp("small")
    write_synthetic_npz(d / "s.npz", num_classes=4, n_channels=3, size=12, counts=(120, 12, 36), seed=0)
    preprocess(d / "s.npz", d / "a.npz", d / "s.parquet", 4, 3)
    return make_fed_data(load_processed(d / "a.npz", d / "s.parquet"), num_clients=4, min_samples=10)


@pytest.mark.parametrize("name", ["resnet18", "resnet18_3d"])
def test_fedavg_stacked_equals_sequential(small_fed, name):
    """The tiny ResNets through both executors (the stacked one runs the model under vmap, with
    padded batches and masked BatchNorm): the same records, uploads and states after two rounds."""
    args = {"width": 2}
    seq = _run(small_fed, "fedavg", "sequential", name, args)
    stk = _run(small_fed, "fedavg", "stacked", name, args)
    _assert_equal_runs(seq, stk, atol=1e-4)
    assert set(seq.server["model"]) == set(model_state(template_on(build_model(name, 3, 4, 12, args), "meta")))


def test_fedbn_keeps_the_resnet_batchnorm_local(small_fed):
    """FedBN runs on resnet18 (its ``bn`` part is not empty) on both executors alike."""
    args = {"width": 2}
    seq = _run(small_fed, "fedbn", "sequential", "resnet18", args, rounds=1)
    _assert_equal_runs(seq, _run(small_fed, "fedbn", "stacked", "resnet18", args, rounds=1), atol=1e-4)


@pytest.mark.parametrize("name,shape,stem,gmacs", [
    ("resnet101", (3, 64, 64), "small", 10.0), ("resnet101", (3, 64, 64), "imagenet", 0.64),
    ("resnet18", (3, 64, 64), "small", 2.2), ("resnet18", (3, 64, 64), "imagenet", 0.15),
    ("resnet18_3d", (64, 64, 64), "small", 206.0), ("resnet18_3d", (64, 64, 64), "imagenet", 3.9),
])
def test_the_documented_compute_per_stem(name, shape, stem, gmacs):
    """docs/models.md's multiply-adds per forward pass of one sample (torch.utils.flop_counter
    counts 2 FLOPs per multiply-add), counted on the meta device: no weights, no compute."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(name, shape[0], 8, shape[-1], {"stem": stem}).to("meta").eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, *shape, device="meta"))
    assert counter.get_total_flops() / 2e9 == pytest.approx(gmacs, rel=0.02)
