"""ViT + LoRA (``vit_lora``) and full fine-tuning (``vit``) from transformers and peft: the frozen
backbone is one shared copy outside every state (never stacked, uploaded or counted), the payload
of a LoRA method is the adapter state, every method trains the tiny ViT for two rounds on both
executors, parameter counts and peak memory are recorded, and a missing checkpoint fails clearly."""

from __future__ import annotations

import json

import pytest
import torch

from medpfl.algorithms import REGISTRY
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward, model_state, template_on
from medpfl.models import build_model
from medpfl.models.vit import MissingWeightsError, lora_adapter_numel
from medpfl.models.zoo import TINY_VIT, parameter_counts
from tests.conftest import assert_trees_close, make_algo, prepare_train_job

HIDDEN, BLOCKS, RANK = 32, 2, 8


def _tiny(name="vit_lora", classes=4, channels=3, **extra):
    return build_model(name, channels, classes, 28, {**TINY_VIT, **extra})


def test_lora_state_holds_only_adapters_and_head_and_the_backbone_is_frozen():
    torch.manual_seed(0)
    m = _tiny()
    f = make_forward(template_on(m, "cpu"))
    state = model_state(m)
    a, b = f.parts["lora_A"], f.parts["lora_B"]
    # q and v of every block, in block order; A [r, d_in], B [d_out, r]
    assert len(a) == len(b) == 2 * BLOCKS
    assert [n.split(".")[2] + n.split(".")[4] for n in a] == ["0q_proj", "0v_proj", "1q_proj", "1v_proj"]
    assert all(state[n].shape == (RANK, HIDDEN) for n in a) and all(state[n].shape == (HIDDEN, RANK) for n in b)
    assert set(state) == set(a) | set(b) | {"classifier.weight", "classifier.bias"}
    assert set(f.parts["head"]) == {"classifier.weight", "classifier.bias"}
    assert set(f.parts["body"]) == set(a) | set(b)
    assert all(torch.count_nonzero(state[n]) == 0 for n in b)  # peft: B = 0, so the adapters start as identity
    assert f.frozen and not set(f.frozen) & set(state)
    assert all(not p.requires_grad for n, p in m.named_parameters() if n in f.frozen)
    # adapter elements from the LoRA config: r (d_in + d_out) per adapted projection
    assert lora_adapter_numel(m.lora_config, m) == 2 * BLOCKS * RANK * (HIDDEN + HIDDEN) == sum(
        state[n].numel() for n in a + b)


def test_functional_forward_equals_the_module_and_uses_the_shared_backbone():
    torch.manual_seed(0)
    m = _tiny()
    f = make_forward(template_on(m, "cpu"))
    state = model_state(m)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}  # non-zero B: the adapters act
    m.load_state_dict(state, strict=False)
    x = torch.randn(5, 3, 28, 28)
    m.eval()
    torch.testing.assert_close(f(state, x), m(x))
    # the frozen tensors are the module's own storage (one copy), not clones
    name = next(iter(f.frozen))
    assert f.frozen[name].data_ptr() == dict(m.named_parameters())[name].data_ptr()
    # the backbone is the same in every build and run seed (backbone_seed), A and head follow the run seed
    torch.manual_seed(1)
    m2 = _tiny()
    f2 = make_forward(template_on(m2, "cpu"))
    assert all(torch.equal(f.frozen[k], f2.frozen[k]) for k in f.frozen)
    assert not torch.equal(model_state(m2)[f.parts["lora_A"][0]], model_state(_tiny())[f.parts["lora_A"][0]])


def test_full_finetuning_trains_every_weight_and_grayscale_is_repeated():
    m = _tiny("vit")
    c = parameter_counts(m)
    assert c["frozen"] == 0 and c["trainable"] == c["total"] == sum(v.numel() for v in model_state(m).values())
    lora = parameter_counts(_tiny())
    # LoRA trains the adapters and the head only; its frozen backbone is the full model minus the head
    head = HIDDEN * 4 + 4
    assert lora["trainable"] == 2 * BLOCKS * RANK * 2 * HIDDEN + head
    assert lora["frozen"] == c["total"] - head


def test_a_local_checkpoint_loads_through_the_hub_mechanism_and_takes_grayscale(tmp_path):
    """A checkpoint folder in the ``save_pretrained`` layout (what the hub cache holds) loads with
    ``from_pretrained``; its weights are the frozen backbone; a 1-channel input to its 3-channel
    patch embedding is repeated to 3 channels (FHBench: grayscale to RGB), which equals feeding the
    repeated image; another image size interpolates the position embeddings."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(3)
    saved = ViTModel(ViTConfig(image_size=28, num_channels=3, **TINY_VIT["config"]), add_pooling_layer=False)
    saved.save_pretrained(tmp_path / "ckpt")
    m = build_model("vit_lora", 1, 4, 28, {"checkpoint": str(tmp_path / "ckpt")})
    f = make_forward(template_on(m, "cpu"))
    # every saved weight is one of the frozen backbone tensors (transformers may rename keys on save)
    frozen = list(f.frozen.values())
    assert len(frozen) == len(saved.state_dict())
    assert all(any(t.shape == v.shape and torch.equal(t, v) for t in frozen) for v in saved.state_dict().values())
    x = torch.rand(2, 1, 28, 28)
    m.eval()
    torch.testing.assert_close(m(x), m(x.expand(2, 3, 28, 28)))
    big = build_model("vit_lora", 3, 4, 56, {"checkpoint": str(tmp_path / "ckpt")})
    assert big(torch.rand(2, 3, 56, 56)).shape == (2, 4)


def test_bad_vit_arguments_and_missing_weights_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"train\.model_args\.config: unknown .*'hiden_size'"):
        build_model("vit_lora", 3, 4, 28, {"checkpoint": None, "config": {"hiden_size": 8}})
    with pytest.raises(ValueError, match=r"not a multiple of the ViT patch size 7"):
        build_model("vit_lora", 3, 4, 32, TINY_VIT)
    with pytest.raises(ValueError, match=r"target_modules.*no such module"):
        build_model("vit_lora", 3, 4, 28, {**TINY_VIT, "target_modules": ["query_proj"]})
    with pytest.raises(ValueError, match=r"train\.model_args: .*config applies to a randomly initialised ViT"):
        build_model("vit_lora", 3, 4, 28, {"config": {"hidden_size": 8}})
    empty = tmp_path / "no-weights"
    empty.mkdir()  # a local checkpoint folder without files: no network involved
    with pytest.raises(MissingWeightsError, match=r"checkpoint=.*no-weights.*huggingface-cli download"):
        build_model("vit_lora", 3, 4, 224, {"checkpoint": str(empty)})


@pytest.mark.parametrize("image_size, expected", [
    (32, ["no-weights", "huggingface-cli download"]),  # 32 px fits the patch size 16: the weights are missing
    (28, ["method 'fedavg' on data set 'synth'", "image side 28 px is not a multiple of the ViT patch size 16"]),
])
def test_medpfl_train_with_a_vit_that_cannot_be_built_exits_2_in_one_line(tmp_path, capsys, image_size, expected):
    """Offline without the checkpoint's files, or on images the backbone cannot take, ``medpfl
    train`` says what and how to fix it in one error line (exit 2, no traceback) and writes no
    results."""
    from medpfl.cli import main

    empty = tmp_path / "no-weights"
    empty.mkdir()  # a local checkpoint folder without files: no network involved
    job, _ = prepare_train_job(tmp_path, method="fedavg", mlflow=False, counts=(40, 8, 16), image_size=image_size,
                               train={"rounds": 1, "model": "vit_lora", "model_args": {"checkpoint": str(empty)}})
    out = tmp_path / "run"
    code = main(["train", "--job", json.dumps(job), "--arrays", str(tmp_path / "arrays.npz"), "--samples",
                 str(tmp_path / "samples.parquet"), "--partition-table", str(tmp_path / "partition.parquet"),
                 "--out-dir", str(out), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("medpfl train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(x in lines[0] for x in expected), lines[0]
    assert not (out / "records.parquet").exists()


def _run(fed_data, method, executor, model="vit_lora", rounds=2, participation=0.6):
    algo = make_algo(method, num_classes=fed_data.num_classes, model=model, model_args=TINY_VIT)
    train = TrainConfig(rounds=rounds, participation=participation, local_epochs=1, batch_size=16,
                        checkpoint_every=0, model=model, model_args=TINY_VIT)
    return algo, Engine(algo, fed_data, train, EvalConfig(), seed=1, executor_kind=executor,
                        fingerprint="vit").run()


def test_fedavg_uploads_exactly_the_adapter_state_and_the_backbone_never_moves(fed_data):
    algo, res = _run(fed_data, "fedavg", "sequential")
    m = _tiny()
    per_client = 4 * (lora_adapter_numel(m.lora_config, m) + HIDDEN * 4 + 4)  # float32 adapters + head
    sampled = res.rounds["num_sampled"].to_numpy()
    # upload: the adapter state and the sample count (float32) per sampled client; download: the same state
    assert (res.rounds["bytes_up"].to_numpy() == sampled * (per_client + 4)).all()
    assert (res.rounds["bytes_down"].to_numpy() == sampled * per_client).all()
    assert set(res.global_params) == set(model_state(m))
    backbone = build_model("vit_lora", 3, 4, 28, TINY_VIT)
    assert all(torch.equal(algo.forward.frozen[k], dict(backbone.named_parameters())[k]) for k in algo.forward.frozen)
    assert (res.rounds["peak_memory_bytes"] > 0).all()


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_trains_the_tiny_vit_lora_on_both_executors(fed_data, method):
    """Two rounds with the LoRA model on synthetic 3-channel images, on both executors alike where
    the method is stackable; a method that needs a part the model lacks (FedBN: BatchNorm) stops
    at once naming it and train.model."""
    need = REGISTRY[method].requires_parts
    parts = make_forward(template_on(_tiny(), "cpu")).parts
    missing = [p for p in need if not parts.get(p)]
    if missing:
        with pytest.raises(ValueError, match=r"train\.model"):
            _run(fed_data, method, "sequential")
        return
    _, seq = _run(fed_data, method, "sequential")
    assert len(seq.records) and seq.records["accuracy"].between(0, 1).all()
    if REGISTRY[method].not_stackable_because is None:
        _, stk = _run(fed_data, method, "stacked")
        assert seq.rounds["bytes_up"].tolist() == stk.rounds["bytes_up"].tolist()
        assert_trees_close(seq.client_states, stk.client_states, atol=1e-4)
        assert_trees_close(seq.server, stk.server, atol=1e-4)
