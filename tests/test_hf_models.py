"""The frozen foundation models with LoRA of FHBench's text, audio and time-series tracks
(``roberta-lora``, ``wav2vec2-lora``, ``moment-lora``; medpfl.models.hf): LoRA sits on query and
value of every block with the counts the configs imply, the backbone is frozen, one shared copy
outside every state and payload, the models equal the transformers classes they stand for, the
attention mask makes padding invisible, the models run under ``vmap`` over stacked clients, the
head can be frozen (FHBench's accident), a momentfm checkpoint maps onto MOMENT's wrapper,
missing weights fail clearly offline, and FedAvg runs one equal round on both executors. Tiny
random backbones only (no download)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.func import functional_call, vmap

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig
from medpfl.errors import DataError, MissingWeightsError
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine, make_executor
from medpfl.fl.functional import make_forward, model_state, template_on
from medpfl.models.hf import TINY_MOMENT, TINY_ROBERTA, TINY_WAV2VEC2, lora_numel, sinusoid_table
from medpfl.models.zoo import ZOO, InputSpec, build_model, build_model_for_data, parameter_counts
from tests.conftest import assert_trees_close

CLASSES = 3
PAD = 1
L, T, C_TS, T_TS = 12, 800, 3, 64
SPECS = {"roberta-lora": InputSpec("tokens", (L,), PAD), "wav2vec2-lora": InputSpec("waveform", (T,)),
         "moment-lora": InputSpec("timeseries", (C_TS, T_TS))}
NAMES = tuple(SPECS)


def _x(name: str, b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "roberta-lora":  # <s> ... </s> with ids >= 3 between, no padding
        x = torch.randint(3, TINY_ROBERTA["config"]["vocab_size"], (b, L), generator=g)
        x[:, 0], x[:, -1] = 0, 2
        return x
    if name == "wav2vec2-lora":
        return torch.randn(b, T, generator=g)
    return torch.randn(b, C_TS, T_TS, generator=g) * 3 + 1


def _tiny(name: str, classes: int = CLASSES, **extra) -> torch.nn.Module:
    return build_model(name, 0, classes, None, {**ZOO[name].tiny_args, **extra}, spec=SPECS[name])


def _hand_counts(name: str, classes: int) -> tuple[int, int, int]:
    """(adapted modules, LoRA elements, head elements) from the tiny config's dimensions by hand."""
    r = 8
    if name == "roberta-lora":
        h, layers = TINY_ROBERTA["config"]["hidden_size"], TINY_ROBERTA["config"]["num_hidden_layers"]
        return 2 * layers, 2 * layers * r * (h + h), h * h + h + h * classes + classes
    if name == "wav2vec2-lora":
        h, layers = TINY_WAV2VEC2["config"]["hidden_size"], TINY_WAV2VEC2["config"]["num_hidden_layers"]
        p = TINY_WAV2VEC2["config"]["classifier_proj_size"]
        return 2 * layers, 2 * layers * r * (h + h), h * p + p + p * classes + classes
    cfg = TINY_MOMENT["config"]
    d, inner, layers = cfg["d_model"], cfg["num_heads"] * cfg["d_kv"], cfg["num_layers"]
    return 2 * layers, 2 * layers * r * (d + inner), C_TS * d * classes + classes  # q, v: d -> heads * d_kv


# ----------------------------------------------------------------------------- structure and counts


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_and_trainable_counts_follow_the_config(name):
    torch.manual_seed(0)
    m = _tiny(name)
    f = make_forward(template_on(m, "cpu"))
    state = model_state(m)
    a, b = f.parts["lora_A"], f.parts["lora_B"]
    modules, lora, head = _hand_counts(name, CLASSES)
    # the state-dict order (what FHBench's code iterates): wav2vec2's attention registers v_proj before q_proj
    targets = {"roberta-lora": ("query", "value"), "wav2vec2-lora": ("v_proj", "q_proj"), "moment-lora": ("q", "v")}
    # query and value of every block, block by block, the l-th A pairing with the l-th B
    assert len(a) == len(b) == modules
    assert [n.split(".lora_A.")[0].rsplit(".", 1)[1] for n in a] == list(targets[name]) * (modules // 2)
    assert [n.replace(".lora_A.", ".lora_B.") for n in a] == list(b)
    assert sum(state[n].numel() for n in a + b) == lora == lora_numel(m)
    assert all(state[n].shape[0] == 8 for n in a) and all(state[n].shape[1] == 8 for n in b)
    assert all(torch.count_nonzero(state[n]) == 0 for n in b)  # peft: B = 0
    assert sum(state[n].numel() for n in f.parts["head"]) == head
    assert set(state) == set(a) | set(b) | set(f.parts["head"]) and set(f.parts["body"]) == set(a) | set(b)
    counts = parameter_counts(m)
    assert counts["trainable"] == lora + head
    assert counts["frozen"] == sum(t.numel() for t in f.frozen.values()) > 0


def test_full_size_trainable_counts_are_fhbench_s():
    """roberta-base / wav2vec2-base / MOMENT-1-small-shaped configs (built on the meta device:
    no weights): LoRA r 8 on q, v gives 294,912 for the two 12-block, 768-wide backbones (spec
    B.7), the heads 594,437 (RoBERTa, 5 classes) and 197,892 (wav2vec2, 4 classes) (the notes);
    MOMENT (d 512, 8 blocks, 6 x 64 heads: assumed) 8 * 2 * 8 * (512 + 384) = 114,688 + a
    19 * 512 x 3 head."""
    with torch.device("meta"):
        rob = build_model("roberta-lora", 0, 5, None, {"checkpoint": None, "config": {
            "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1}},
            spec=InputSpec("tokens", (512,), 1))
        w2v = build_model("wav2vec2-lora", 0, 4, None, {"checkpoint": None}, spec=InputSpec("waveform", (128000,)))
        mom = build_model("moment-lora", 0, 3, None, {"checkpoint": None}, spec=InputSpec("timeseries", (19, 512)))
    assert parameter_counts(rob)["trainable"] == 294_912 + 594_437
    assert parameter_counts(rob)["frozen"] == 124_055_040  # roberta-base without its pooler
    assert parameter_counts(w2v)["trainable"] == 294_912 + 197_892
    assert parameter_counts(mom)["trainable"] == 114_688 + 19 * 512 * 3 + 3


@pytest.mark.parametrize("name", NAMES)
def test_backbone_is_frozen_one_shared_copy_and_outside_every_state(name):
    torch.manual_seed(0)
    m = _tiny(name)
    f = make_forward(template_on(m, "cpu"))
    state = model_state(m)
    assert not list(m.named_buffers())  # RoBERTa's position_ids / token_type_ids are gone: no per-client buffer
    assert f.frozen and not set(f.frozen) & set(state)
    assert all(not p.requires_grad for n, p in m.named_parameters() if n in f.frozen)
    name0 = next(iter(f.frozen))
    assert f.frozen[name0].data_ptr() == dict(m.named_parameters())[name0].data_ptr()  # the module's own storage
    # the backbone is the same in every run seed (backbone_seed); A and the head follow the run seed
    torch.manual_seed(1)
    m2 = _tiny(name)
    f2 = make_forward(template_on(m2, "cpu"))
    assert all(torch.equal(f.frozen[k], f2.frozen[k]) for k in f.frozen)
    a0 = f.parts["lora_A"][0]
    assert not torch.equal(model_state(m2)[a0], state[a0])
    assert not torch.equal(model_state(m2)[f.parts["head"][-2]], state[f.parts["head"][-2]])


@pytest.mark.parametrize("name", NAMES)
def test_output_shapes_features_and_the_head_contract(name):
    torch.manual_seed(0)
    m = _tiny(name).eval()
    x = _x(name, 5)
    logits = m(x)
    assert logits.shape == (5, CLASSES) and logits.dtype == torch.float32
    z, logits2 = m(x, with_features=True)
    f = make_forward(template_on(m, "cpu"))
    assert z.shape == (5, f.feature_dim)
    torch.testing.assert_close(logits2, logits)
    state = model_state(m)
    torch.testing.assert_close(f.head(state, z), logits)
    torch.testing.assert_close(f(state, x), logits)
    assert m(x[:0]).shape == (0, CLASSES)  # an empty batch (Per-FedAvg's short halves)


def test_roberta_equals_robertaforsequenceclassification_on_the_same_weights():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    m = _tiny("roberta-lora").eval()
    ref = RobertaForSequenceClassification(RobertaConfig(num_labels=CLASSES, **TINY_ROBERTA["config"],
                                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                         attn_implementation="eager")).eval()
    own = {k.replace("base_layer.", ""): v for k, v in m.state_dict().items() if "lora_" not in k}
    sd = {("roberta." + k[len("backbone."):] if k.startswith("backbone.") else "classifier." + k[len("head."):]): v
          for k, v in own.items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"roberta.embeddings.position_ids", "roberta.embeddings.token_type_ids"}
    x = _x("roberta-lora", 4)
    x[1, 7:] = PAD
    mask = (x != PAD).long()
    # the adapters start as the identity (B = 0): the wrapped model is RoBERTa's classifier
    torch.testing.assert_close(m(x), ref(input_ids=x, attention_mask=mask).logits, atol=1e-6, rtol=0)


def test_wav2vec2_equals_wav2vec2forsequenceclassification_on_the_same_weights():
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    from medpfl.models.hf import WAV2VEC2_DROPOUT_OFF

    torch.manual_seed(0)
    m = _tiny("wav2vec2-lora").eval()
    ref = Wav2Vec2ForSequenceClassification(Wav2Vec2Config(num_labels=CLASSES, **TINY_WAV2VEC2["config"],
                                                           **WAV2VEC2_DROPOUT_OFF, attn_implementation="eager")).eval()
    own = {k.replace("base_layer.", ""): v for k, v in m.state_dict().items() if "lora_" not in k}
    sd = {("wav2vec2." + k[len("backbone."):] if k.startswith("backbone.") else k[len("head."):]): v
          for k, v in own.items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and not missing
    x = _x("wav2vec2-lora", 3)
    # HF projects every frame, then averages; the wrapper averages, then projects: the same linear map
    torch.testing.assert_close(m(x), ref(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_padding_is_invisible_a_padded_row_equals_the_unpadded_row(impl):
    torch.manual_seed(0)
    m = _tiny("roberta-lora", attn_implementation=impl).eval()
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model_state(m).items()}  # B != 0: the adapters act
    m.load_state_dict(state, strict=False)
    x = _x("roberta-lora", 2, seed=3)
    short = x[0, :6].clone()
    short[-1] = 2  # </s>
    x[0, :6] = short
    x[0, 6:] = PAD
    ref = build_model("roberta-lora", 0, CLASSES, None, {**TINY_ROBERTA, "attn_implementation": impl},
                      spec=InputSpec("tokens", (6,), PAD))
    ref.load_state_dict(m.state_dict())
    ref.eval()
    full = m(x)
    torch.testing.assert_close(full[0], ref(short[None])[0], atol=1e-6, rtol=0)
    # the same row with the mask ignored (the pad tokens attended) differs: the comparison can fail
    no_mask = m.backbone(input_ids=x, token_type_ids=torch.zeros_like(x)).last_hidden_state[:, 0]
    assert (m.head(no_mask)[0] - full[0]).abs().max() > 2e-5


@pytest.mark.parametrize("name", NAMES)
def test_two_stacked_clients_under_vmap_equal_per_client_calls(name):
    """The stacked executor's use: one functional_call per client over stacked states, training
    mode (dropout off), the frozen backbone entering unbatched."""
    torch.manual_seed(0)
    m = _tiny(name)
    f = make_forward(template_on(m, "cpu"))
    base = model_state(m)
    states = [{k: v + 0.05 * (i + 1) * torch.randn_like(v) for k, v in base.items()} for i in range(2)]
    stacked = {k: torch.stack([s[k] for s in states]) for k in base}
    x = torch.stack([_x(name, 4, seed=1), _x(name, 4, seed=2)])
    out = vmap(lambda s, xb: f(s, xb, train=True))(stacked, x)
    for i in range(2):
        torch.testing.assert_close(out[i], f(states[i], x[i], train=True), atol=1e-5, rtol=0)
    # gradients too: one autograd pass over the summed stacked loss gives each client its own
    leaves = {k: v.clone().requires_grad_() for k, v in stacked.items()}
    loss = vmap(lambda s, xb: f(s, xb, train=True).logsumexp(-1).mean())(leaves, x).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    for i in range(2):
        one = {k: v.clone().requires_grad_() for k, v in states[i].items()}
        g1 = torch.autograd.grad(f(one, x[i], train=True).logsumexp(-1).mean(), list(one.values()))
        for ga, gb in zip(grads, g1):
            torch.testing.assert_close(ga[i], gb, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_head_trainable_false_freezes_the_head_fhbench_s_accident(name):
    torch.manual_seed(0)
    m = _tiny(name, head_trainable=False)
    f = make_forward(template_on(m, "cpu"))
    state = model_state(m)
    _, lora, head = _hand_counts(name, CLASSES)
    assert parameter_counts(m)["trainable"] == lora
    assert all(k.split(".")[0] != "head" for k in state) and f.parts["head"] == ()
    assert {k for k in f.frozen if k.startswith("head.")} and all(
        not p.requires_grad for p in m.head.parameters())
    assert sum(p.numel() for p in m.head.parameters()) == head
    m.eval()
    x = _x(name, 2)
    z, logits = m(x, with_features=True)
    torch.testing.assert_close(f.head(state, z), logits)  # the frozen head is the template's own
    with pytest.raises(ValueError, match=r"'head' part is empty"):
        f.part_names("head")


# ----------------------------------------------------------------------------- dropout policy


@pytest.mark.parametrize("name", NAMES)
def test_dropout_on_runs_sequentially_and_refuses_the_stacked_executor(name, monkeypatch):
    from medpfl.algorithms import resolve_method

    on = _tiny(name, dropout=True)  # the FHBench setting (the tiny configs keep transformers' default dropout)
    assert "dropout" in on.not_stackable_because
    assert _tiny(name).not_stackable_because is None
    assert "lora_dropout: 0.05" in _tiny(name, lora_dropout=0.05).not_stackable_because
    cls, cfg = resolve_method("fedavg", {})
    algo = cls(cfg, make_forward(template_on(on, "cpu")), CLASSES)
    data = _fed(name)
    train = TrainConfig(rounds=1, batch_size=4, model=name, model_args={**ZOO[name].tiny_args, "dropout": True})
    with pytest.raises(ValueError, match=rf"train\.executor=stacked: model '{name}' cannot be stacked .*dropout"):
        make_executor("stacked", algo, data, train, 1, 64)
    monkeypatch.setattr(data, "device", torch.device("cuda"))  # auto would stack on a GPU: not with dropout
    assert make_executor("auto", algo, data, train, 1, 64).name == "sequential"
    # training mode draws different masks on each call, evaluation mode none
    x = _x(name, 3)
    on.train()
    if name != "wav2vec2-lora":  # (wav2vec2's tiny clips are too short for its SpecAugment span)
        assert not torch.equal(on(x), on(x))
    on.eval()
    torch.testing.assert_close(on(x), on(x))


# ----------------------------------------------------------------------------- inputs and errors


def test_models_refuse_samples_of_another_kind_by_name():
    with pytest.raises(ValueError, match=r"train\.model=roberta-lora needs token ids \[L\].*image of shape \[3, 28, 28\]"):
        build_model("roberta-lora", 3, 4, 28, TINY_ROBERTA)
    with pytest.raises(ValueError, match=r"wav2vec2-lora needs waveforms \[T\].*timeseries of shape \[3, 64\]"):
        build_model("wav2vec2-lora", 0, 4, None, TINY_WAV2VEC2, spec=SPECS["moment-lora"])
    with pytest.raises(ValueError, match=r"moment-lora needs multichannel time series \[C, T\].*waveform"):
        build_model("moment-lora", 0, 4, None, TINY_MOMENT, spec=SPECS["wav2vec2-lora"])
    with pytest.raises(ValueError, match=r"train\.model=mlp takes float samples.*token ids"):
        build_model("mlp", 0, 4, None, None, spec=SPECS["roberta-lora"])
    with pytest.raises(ValueError, match=r"train\.model=cnn4 needs image samples"):
        build_model("cnn4", 0, 4, None, None, spec=SPECS["moment-lora"])
    # a flat model takes a time series (flattened)
    assert build_model("mlr", 0, 4, None, None, spec=SPECS["moment-lora"])(_x("moment-lora", 2)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"T a multiple of patch_len 8 .* T is 60"):
        build_model("moment-lora", 0, 4, None, TINY_MOMENT, spec=InputSpec("timeseries", (3, 60)))
    with pytest.raises(ValueError, match=r"length 40 need 42 position embeddings"):
        build_model("roberta-lora", 0, 4, None, TINY_ROBERTA, spec=InputSpec("tokens", (40,), 1))
    with pytest.raises(ValueError, match=r"tokenizer has 100 token ids, the backbone's embedding 64"):
        build_model("roberta-lora", 0, 4, None, TINY_ROBERTA, spec=InputSpec("tokens", (L,), 1, vocab_size=100))
    with pytest.raises(ValueError, match=r"target_modules=\['query_proj'\]: no module"):
        build_model("roberta-lora", 0, 4, None, {**TINY_ROBERTA, "target_modules": ["query_proj"]},
                    spec=SPECS["roberta-lora"])
    with pytest.raises(ValueError, match=r"config applies to a randomly initialised backbone"):
        build_model("moment-lora", 0, 4, None, {"config": {"d_model": 8}}, spec=SPECS["moment-lora"])
    with pytest.raises(ValueError, match=r"unknown or fixed RobertaConfig keys \['hiden_size'\]"):
        build_model("roberta-lora", 0, 4, None, {**TINY_ROBERTA, "config": {"hiden_size": 8}},
                    spec=SPECS["roberta-lora"])


def test_the_tokenizer_s_pad_id_reaches_a_random_backbone_and_must_match_a_checkpoint(tmp_path):
    from transformers import RobertaConfig, RobertaModel

    m = build_model("roberta-lora", 0, 4, None, TINY_ROBERTA, spec=InputSpec("tokens", (L,), 3))
    assert m.pad_token_id == 3 == m.backbone.config.pad_token_id
    cfg = RobertaConfig(**TINY_ROBERTA["config"], pad_token_id=1)
    RobertaModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"tokenizer pads with id 3, the backbone's padding id .* is 1"):
        build_model("roberta-lora", 0, 4, None, {"checkpoint": str(tmp_path / "ckpt")},
                    spec=InputSpec("tokens", (L,), 3))


@pytest.mark.parametrize("name", ["roberta-lora", "wav2vec2-lora"])
def test_a_local_checkpoint_loads_with_from_pretrained_as_the_frozen_backbone(name, tmp_path):
    from transformers import RobertaConfig, RobertaModel, Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(5)
    if name == "roberta-lora":
        saved = RobertaModel(RobertaConfig(**TINY_ROBERTA["config"]), add_pooling_layer=False)
    else:
        saved = Wav2Vec2Model(Wav2Vec2Config(**TINY_WAV2VEC2["config"]))
    saved.save_pretrained(tmp_path / "ckpt")
    m = build_model(name, 0, CLASSES, None, {"checkpoint": str(tmp_path / "ckpt"), "dropout": False},
                    spec=SPECS[name])
    frozen = make_forward(template_on(m, "cpu")).frozen
    want = {k: v for k, v in saved.state_dict().items() if k not in ("embeddings.position_ids",
                                                                       "embeddings.token_type_ids",
                                                                       "masked_spec_embed")}
    got = {k[len("backbone."):].replace("base_layer.", ""): v for k, v in frozen.items() if k.startswith("backbone.")}
    assert set(want) <= set(got)
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("name, hub_id", [("roberta-lora", "roberta-base"),
                                          ("wav2vec2-lora", "facebook/wav2vec2-base-960h"),
                                          ("moment-lora", "AutonLab/MOMENT-1-small")])
def test_missing_weights_offline_name_the_model_id(name, hub_id, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(MissingWeightsError, match=rf"train\.model={name}, train\.model_args\.checkpoint='{hub_id}'"
                                                  rf".*empty-hf-home.*offline.*huggingface-cli download {hub_id}"):
        build_model(name, 0, CLASSES, None, {}, spec=SPECS[name])


# ----------------------------------------------------------------------------- MOMENT checkpoint


def _write_momentfm_checkpoint(folder, t5_cfg: dict, seed: int = 7, extra: dict | None = None, drop: str = ""):
    """A momentfm checkpoint folder as ``MOMENTPipeline.save_pretrained`` writes it: config.json
    (momentfm's keys, ``t5_config``) and model.safetensors with momentfm's state-dict keys
    (``encoder.*`` = a T5 encoder stack with its token embedding, ``patch_embedding.*``,
    ``head.linear.*`` = the reconstruction head). Returns the state dict."""
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    d = t5_cfg["d_model"]
    stack = T5EncoderModel(T5Config(vocab_size=32, **t5_cfg)).get_encoder()
    sd = {"encoder." + k: v.clone() for k, v in stack.state_dict().items()}
    sd.update({"patch_embedding.value_embedding.weight": torch.randn(d, 8),
               "patch_embedding.mask_embedding": torch.randn(d),
               "patch_embedding.position_embedding.pe": sinusoid_table(5000, d)[None],
               "head.linear.weight": torch.randn(8, d), "head.linear.bias": torch.randn(8)})
    sd.update(extra or {})
    sd.pop(drop, None)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "task_name": "reconstruction", "model_name": "MOMENT", "transformer_type": "encoder_only", "d_model": None,
        "seq_len": 512, "patch_len": 8, "patch_stride_len": 8, "device": "cpu",
        "transformer_backbone": "google/flan-t5-small", "t5_config": {**t5_cfg, "vocab_size": 32,
                                                                      "model_type": "t5"}}))
    return sd


def _moment_reference(sd: dict, t5_cfg: dict, x: torch.Tensor, head_w: torch.Tensor, head_b: torch.Tensor):
    """MOMENT's classification pipeline written out from the momentfm state dict, with a
    separately built ``T5EncoderModel`` holding its ``encoder.*`` weights."""
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=32, **t5_cfg)).eval()
    missing, _ = t5.load_state_dict({k: v for k, v in sd.items() if k.startswith("encoder.")}, strict=False)
    assert set(missing) <= {"shared.weight"}
    b, c, t = x.shape
    mu = x.mean(-1, keepdim=True)
    sigma = (x - mu).pow(2).mean(-1, keepdim=True).sqrt() + 1e-5
    patches = ((x - mu) / sigma).reshape(b, c, t // 8, 8)
    emb = patches @ sd["patch_embedding.value_embedding.weight"].T + sd["patch_embedding.position_embedding.pe"][0, :t // 8]
    h = t5(inputs_embeds=emb.reshape(b * c, t // 8, -1)).last_hidden_state.reshape(b, c, t // 8, -1)
    feats = h.permute(0, 2, 3, 1).reshape(b, t // 8, -1).mean(1)  # concat: feature d * C + c
    return feats @ head_w.T + head_b


def test_a_momentfm_checkpoint_maps_onto_the_wrapper_and_gives_moment_s_output(tmp_path):
    t5_cfg = {"d_model": 16, "d_kv": 8, "d_ff": 24, "num_layers": 2, "num_heads": 2,
              "feed_forward_proj": "gated-gelu", "dropout_rate": 0.1}
    sd = _write_momentfm_checkpoint(tmp_path / "moment", t5_cfg)
    m = build_model("moment-lora", 0, CLASSES, None, {"checkpoint": str(tmp_path / "moment"), "dropout": False},
                    spec=InputSpec("timeseries", (C_TS, 64))).eval()
    frozen = make_forward(template_on(m, "cpu")).frozen
    # every encoder weight and the patch embedding landed (LoRA wraps q and v as base_layer)
    for k, v in sd.items():
        if k.startswith("encoder.") and "embed_tokens" not in k:
            assert torch.equal(frozen[k.replace(".q.", ".q.base_layer.").replace(".v.", ".v.base_layer.")], v), k
    assert torch.equal(frozen["patch_embedding.value_embedding.weight"], sd["patch_embedding.value_embedding.weight"])
    assert frozen["encoder.embed_tokens.weight"].shape == (1, 16)  # the 32-token table is not loaded
    x = torch.randn(2, C_TS, 64) * 4 + 2
    want = _moment_reference(sd, t5_cfg, x, m.head.linear.weight, m.head.linear.bias)
    torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)


def test_a_bad_momentfm_checkpoint_names_the_file_and_the_key(tmp_path):
    t5_cfg = {"d_model": 16, "d_kv": 8, "d_ff": 24, "num_layers": 1, "num_heads": 2}
    spec = InputSpec("timeseries", (C_TS, 64))
    _write_momentfm_checkpoint(tmp_path / "a", t5_cfg, extra={"decoder.block.0.weight": torch.zeros(2)})
    with pytest.raises(DataError, match=r"a/model\.safetensors: unexpected key 'decoder\.block\.0\.weight'"):
        build_model("moment-lora", 0, CLASSES, None, {"checkpoint": str(tmp_path / "a")}, spec=spec)
    _write_momentfm_checkpoint(tmp_path / "b", t5_cfg, drop="encoder.final_layer_norm.weight")
    with pytest.raises(DataError, match=r"b/model\.safetensors: missing key 'encoder\.final_layer_norm\.weight'"):
        build_model("moment-lora", 0, CLASSES, None, {"checkpoint": str(tmp_path / "b")}, spec=spec)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    with pytest.raises(DataError, match=r"c/config\.json: not a momentfm config"):
        build_model("moment-lora", 0, CLASSES, None, {"checkpoint": str(tmp_path / "c")}, spec=spec)


# ----------------------------------------------------------------------------- the engine


def _fed(name: str, clients: int = 2, per_client: int = 10) -> FederatedData:
    """``clients`` clients of ``per_client`` random samples (8 train, 2 test each) of the model's
    kind: int64 token ids with padding, float waveforms or time series; CLASSES random labels."""
    n = clients * per_client
    x = _x(name, n, seed=11)
    if name == "roberta-lora":
        lengths = torch.randint(4, L + 1, (n,), generator=torch.Generator().manual_seed(2))
        for i, k in enumerate(lengths.tolist()):
            x[i, k - 1], x[i, k:] = 2, PAD
    labels = torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(3))
    ids = torch.arange(n).view(clients, per_client)
    train = [r[:8].clone() for r in ids]
    hist = torch.stack([torch.bincount(labels[t], minlength=CLASSES).float() for t in train])
    return FederatedData(images=x, labels=labels, num_classes=CLASSES, global_test=torch.empty(0, dtype=torch.int64),
                         client_train=train, client_test=[r[8:].clone() for r in ids], train_hist=hist,
                         device=torch.device("cpu"), kind=SPECS[name].kind, pad_token_id=SPECS[name].pad_token_id)


def test_federated_data_keeps_token_ids_and_builds_the_model_from_its_kind():
    data = _fed("roberta-lora")
    assert data.kind == "tokens" and data.sample_shape == (L,)
    batch = data.x(torch.tensor([0, 3]))
    assert batch.dtype == torch.int64 and torch.equal(batch, data.images[[0, 3]])  # never normalised
    m = build_model_for_data("roberta-lora", data, TINY_ROBERTA)
    assert m.pad_token_id == PAD
    ts = _fed("moment-lora")
    assert ts.kind == "timeseries" and ts.sample_shape == (C_TS, T_TS)
    assert build_model_for_data("moment-lora", ts, TINY_MOMENT).channels == C_TS
    wav = _fed("wav2vec2-lora")
    assert wav.sample_shape == (T,) and torch.equal(wav.x(torch.tensor([1])), wav.images[[1]])
    # token ids are declared (the processed file's kind and pad id), never guessed: without a
    # kind an integer [N, d] array is a vector set, normalised as before; tokens need a pad id
    common = dict(images=data.images, labels=data.labels, num_classes=CLASSES, global_test=data.global_test,
                  client_train=data.client_train, client_test=data.client_test, train_hist=data.train_hist,
                  device=data.device)
    assert FederatedData(**common).kind == "vector"
    with pytest.raises(DataError, match="pad_token_id=None with tokens samples"):
        FederatedData(**common, kind="tokens")


def test_federated_data_build_reads_the_processed_kind_and_pad_id():
    """The processed file's ``kind`` / ``pad_token_id`` (issue 33's interface) reach FederatedData
    from the loaded data set's attributes of those names."""
    from dataclasses import dataclass

    import numpy as np
    import pandas as pd

    from medpfl.data.preprocess import ProcessedData

    @dataclass
    class Tokens(ProcessedData):
        kind: str = "tokens"
        pad_token_id: int | None = 5

    n = 12
    samples = pd.DataFrame({"sample_id": np.arange(n), "label": np.arange(n) % 2, "split": ["train"] * n})
    proc = Tokens(images=np.full((n, 6), 7, dtype=np.int64), labels=samples["label"].to_numpy().copy(), samples=samples,
                  num_classes=2)
    table = pd.DataFrame({"sample_id": np.arange(n), "client_id": np.arange(n) % 2,
                          "local_split": ["train"] * n})
    data = FederatedData.build(proc, table, torch.device("cpu"))
    assert (data.kind, data.pad_token_id, data.sample_shape) == ("tokens", 5, (6,))
    assert data.x(torch.tensor([2])).dtype == torch.int64


@pytest.mark.parametrize("name", NAMES)
def test_one_fedavg_round_is_equal_on_both_executors_and_uploads_only_adapters_and_head(name):
    data = _fed(name)
    args = ZOO[name].tiny_args
    runs = {}
    for executor in ("sequential", "stacked"):
        torch.manual_seed(0)
        cls, cfg = resolve_method("fedavg", {})
        algo = cls(cfg, make_forward(template_on(build_model_for_data(name, data, args), "cpu")), CLASSES)
        train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=4, checkpoint_every=0,
                            model=name, model_args=args)
        runs[executor] = Engine(algo, data, train, EvalConfig(), seed=1, executor_kind=executor,
                                fingerprint="hf").run()
    seq, stk = runs["sequential"], runs["stacked"]
    m = _tiny(name)
    _, lora, head = _hand_counts(name, CLASSES)
    per_client = 4 * (lora + head)  # float32 adapters + head; the backbone never moves
    assert set(seq.global_params) == set(model_state(m))
    assert (seq.rounds["bytes_up"].to_numpy() == 2 * (per_client + 4)).all()  # + the sample count
    assert (seq.rounds["bytes_down"].to_numpy() == 2 * per_client).all()
    assert seq.rounds["bytes_up"].tolist() == stk.rounds["bytes_up"].tolist()
    assert_trees_close(seq.global_params, stk.global_params, atol=1e-5)
    assert any(torch.count_nonzero(v) for k, v in seq.global_params.items() if ".lora_B." in k)  # B left 0: trained
    assert len(seq.records) and seq.records["accuracy"].between(0, 1).all()
