"""Frozen foundation models with LoRA adapters for FHBench's text, audio and time-series tracks
(``../shared/docs/methods-pfedkdwcl-epfl.md`` B.2-B.4, ``fhbench-multimodal-notes.md``): the
zoo's ``roberta-lora``, ``wav2vec2-lora`` and ``moment-lora``.

Every model here is built like ``vit_lora`` (:mod:`medpfl.models.vit`):

* the backbone comes from a Hugging Face hub id (``checkpoint``, loaded with ``from_pretrained``
  / ``huggingface_hub`` through the local cache: ``cache_dir``, else ``HF_HUB_CACHE`` /
  ``HF_HOME``; with ``HF_HUB_OFFLINE=1`` only the cache is read) or, with ``checkpoint: null``,
  from a randomly initialised config (``config``: the tiny models of the tests), drawn from its
  own generator seeded by ``backbone_seed`` so the frozen backbone is the same in every run seed;
  a checkpoint that is neither cached nor downloadable raises :class:`MissingWeightsError` naming
  the hub id and how to provide it;
* ``peft.inject_adapter_in_model`` puts LoRA (rank 8, alpha 16 [P]/[C]; LoRA dropout 0.01 for
  text and audio, 0.05 for time series [C]) on the query and value projections of every block,
  and **every backbone weight is frozen** (``requires_grad=False``): the engine's state holds only
  the adapters and the head, the backbone stays one shared copy outside every state, payload and
  upload (:class:`medpfl.fl.functional.FunctionalModel`);
* a new classification head (FHBench's head, see each class) is drawn from the run seed's RNG
  and trained (``head_trainable``, default True: spec B.2.5 item 4 / C.17). ``head_trainable:
  false`` reproduces the FHBench code's accident for the audio and time-series tracks:
  ``get_peft_model`` is called without ``task_type``/``modules_to_save``, so peft freezes the new
  random head as well (the head is then frozen, shared and never trained; the ``head`` part is
  empty, so methods that keep or share a head apart from the body stop with an error naming the
  part);
* parts: ``head`` = the head module (``head.*``), ``body`` = the adapters, ``lora_A`` /
  ``lora_B`` = the adapters' A (float [r, d_in]) and B (float [d_out, r]) in the backbone's
  module (state-dict) order, the order FHBench's code lists them: block by block, query and value
  as the block registers them (RoBERTa and T5: query first; wav2vec2: ``v_proj`` before
  ``q_proj``), the l-th A pairing with the l-th B (EPFL's psi halves follow this order).
  ``feature_dim`` = the width of the features the head takes (``with_features``).

**Dropout policy.** ``dropout: true`` (default) keeps the backbone's and head's dropout as the
checkpoint's config defines it, the FHBench code's training setting (RoBERTa 0.1; wav2vec2
dropout 0.1, LayerDrop and SpecAugment time masking; MOMENT's T5 dropout 0.1, patch and head
dropout 0.1); ``dropout: false`` sets every backbone and head dropout probability to 0 and turns
LayerDrop and SpecAugment off. LoRA dropout is its own argument (``lora_dropout``). Dropout draws
random masks, which ``torch.func.vmap`` rejects in its default randomness mode: a model with any
dropout active in training therefore declares ``not_stackable_because`` and the engine runs it on
the sequential executor (``train.executor: auto``; ``stacked`` is refused with that reason). Set
``dropout: false`` and ``lora_dropout: 0`` to stack clients. (With vmap's ``randomness=
"different"`` dropout would run, except wav2vec2's LayerDrop, whose Python branch on a random
draw cannot be batched, and SpecAugment, which draws its masks with numpy and so would give
every stacked client the same masks: the notes' measurements.)

Input derivation inside the models (so the engine keeps one input tensor per sample):

* ``roberta-lora``: x int64 [B, L] token ids; the attention mask is ``x != pad_token_id``, passed
  to the backbone as a 4-D additive float mask [B, 1, 1, L] (0 where attended, the dtype's
  minimum where not). A 2-D mask fails under ``vmap`` in transformers 5.23 (its mask code
  branches on tensor values); a 4-D *boolean* mask runs, but transformers returns a 4-D mask
  as is and the eager attention *adds* it to the scores, so a boolean mask adds 1 instead of
  masking (measured: 7.5e-6 off on a tiny model); the additive float mask is exact for eager and
  sdpa attention. Position 0 (RoBERTa's ``<s>``) is always attended, so an all-padding row gives
  finite logits. ``token_type_ids`` are passed as zeros and position ids are RoBERTa's own
  (counted over non-pad tokens from ``pad_token_id + 1``), so the embeddings' ``position_ids`` /
  ``token_type_ids`` buffers are unused and are removed: they would otherwise become per-client
  state.
* ``wav2vec2-lora``: x float32 [B, T] (16 kHz); no attention mask (the FHBench code passes none:
  every clip has the same length).
* ``moment-lora``: x float32 [B, C, T]; MOMENT's classification pipeline with an all-ones input
  mask (the FHBench code passes none).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from medpfl.errors import DataError, MissingWeightsError

# ------------------------------------------------------------------------------------ helpers


def hub_offline() -> bool:
    """Whether Hugging Face hub downloads are off: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``)
    set to 1/true/yes/on now, or ``huggingface_hub`` started in offline mode. Read at build time
    (``huggingface_hub`` reads the variable once, at import)."""
    from huggingface_hub import constants

    on = {"1", "true", "yes", "on"}
    return (os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in on
            or os.environ.get("TRANSFORMERS_OFFLINE", "").strip().lower() in on or bool(constants.HF_HUB_OFFLINE))


def hub_cache_dir(cache_dir: str | None) -> str | None:
    """The hub cache folder: ``cache_dir`` if given, else ``HF_HUB_CACHE``, else ``$HF_HOME/hub``
    as the environment says now, else None (the library's default, ``~/.cache/huggingface/hub``)."""
    if cache_dir:
        return cache_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def missing_weights_message(model: str, checkpoint: str, cache_dir: str | None, err: Exception) -> str:
    """One line: which checkpoint is missing, where it was looked for, and how to provide it."""
    where = hub_cache_dir(cache_dir) or "~/.cache/huggingface/hub"
    mode = "offline (HF_HUB_OFFLINE)" if hub_offline() else "could not be downloaded"
    return (f"train.model={model}, train.model_args.checkpoint={checkpoint!r}: the pretrained weights are not in the "
            f"Hugging Face cache ({where}) and {mode} ({type(err).__name__}). Provide them on a machine with internet "
            f"access with `huggingface-cli download {checkpoint}` and copy the cache folder here (set HF_HOME or "
            "train.model_args.cache_dir to it), or set train.model_args.checkpoint: null with a config for a randomly "
            "initialised backbone (say so when reporting)")


def _check_config(model: str, config_cls: type, config: Mapping[str, Any], fixed: tuple[str, ...],
                  extra: tuple[str, ...] = ()) -> None:
    base = config_cls()
    unknown = sorted(k for k in config if (k not in extra and not hasattr(base, k)) or k in fixed)
    if unknown:
        raise ValueError(f"train.model_args.config: unknown or fixed {config_cls.__name__} keys {unknown} for "
                         f"train.model={model} ({', '.join(fixed)} are set by the data set or the model)")


def _inject_lora(model: str, backbone: nn.Module, lora: Mapping[str, Any], hint: str):
    """LoRA adapters on ``lora['target_modules']`` of ``backbone`` (A drawn from the current
    torch RNG, B = 0: peft's init, spec B.2.1); every non-LoRA weight frozen. Returns the
    ``LoraConfig``. ValueError naming ``target_modules`` when no module matches."""
    from peft import LoraConfig, inject_adapter_in_model

    names = [n for n, _ in backbone.named_modules()]
    targets = [t for t in lora["target_modules"] if any(n == t or n.endswith("." + t) for n in names)]
    missing = [t for t in lora["target_modules"] if t not in targets]
    if missing or not targets:
        raise ValueError(f"train.model_args.target_modules={list(lora['target_modules'])}: no module {missing} in the "
                         f"{model} backbone ({hint})")
    cfg = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=targets,
                     bias="none")
    inject_adapter_in_model(cfg, backbone)
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    return cfg


class HFLoRAClassifier(nn.Module):
    """Base of the three models: a frozen backbone with LoRA adapters and a head module ``head``.

    Subclasses set ``self.backbone``, ``self.head``, ``self.feature_dim`` and implement
    ``features(x) -> z float [B, feature_dim]``. forward(x, mask=None, with_features=False) ->
    logits float [B, classes] (``(z, logits)`` with ``with_features``); ``mask`` (the engine's
    padded-batch marker) is unused: no BatchNorm.
    """

    head_name = "head"

    def _finish(self, lora_cfg: Any, head_trainable: bool, dropout_on: bool, lora_dropout: float) -> None:
        self.lora_config = lora_cfg
        for p in self.head.parameters():
            p.requires_grad_(head_trainable)
        why = []
        if dropout_on:
            why.append("train.model_args.dropout: true (the backbone's dropout)")
        if lora_dropout > 0:
            why.append(f"train.model_args.lora_dropout: {lora_dropout}")
        #: why the stacked executor cannot run this model's training step (None: it can), read by
        #: :func:`medpfl.fl.engine.make_executor` through :class:`~medpfl.fl.functional.FunctionalModel`
        self.not_stackable_because = (
            f"{' and '.join(why)} draws random dropout masks, which torch.func.vmap rejects; set dropout: false and "
            "lora_dropout: 0 to stack clients" if why else None)

    def extra_parts(self) -> dict[str, list[str]]:
        """``lora_A`` / ``lora_B``: the adapters' weights in module order."""
        names = [n for n, p in self.named_parameters() if p.requires_grad]
        return {"lora_A": [n for n in names if ".lora_A." in n], "lora_B": [n for n in names if ".lora_B." in n]}

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        if x.shape[0] == 0:  # an empty batch (Per-FedAvg's half of a short last batch): run one zero sample and
            # keep none of it (the attention reshapes cannot take 0 samples)
            z, logits = self.forward(x.new_zeros(1, *x.shape[1:]), with_features=True)
            return (z[:0], logits[:0]) if with_features else logits[:0]
        z = self.features(x)
        logits = self.head(z)
        return (z, logits) if with_features else logits


def _init_linear_(layer: nn.Linear, std: float) -> None:
    """transformers' ``_init_weights`` rule for a new Linear: weight ~ N(0, std), bias 0."""
    with torch.no_grad():
        layer.weight.normal_(0.0, std)
        if layer.bias is not None:
            layer.bias.zero_()


# ------------------------------------------------------------------------------------ RoBERTa

#: dropout keys of RobertaConfig that ``dropout: false`` sets to 0
ROBERTA_DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")


class RobertaHead(nn.Module):
    """``RobertaClassificationHead`` on the ``<s>`` features z float [B, H] (the HF head takes the
    whole sequence and slices token 0 itself): dropout, dense H->H, tanh, dropout, out_proj H->C.
    With 5 classes and H = 768: 768*768 + 768 + 768*5 + 5 = 594,437 parameters (spec B.7)."""

    def __init__(self, hidden: int, num_classes: int, p: float):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(p)
        self.out_proj = nn.Linear(hidden, num_classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(z)))))


class RobertaLoRAClassifier(HFLoRAClassifier):
    """``roberta-lora``: ``RobertaForSequenceClassification`` (FHBench: ``roberta-base`` via
    ``AutoModelForSequenceClassification``) as a frozen ``RobertaModel`` (no pooler, as in the
    HF class) + LoRA on ``query``/``value`` + :class:`RobertaHead` on the ``<s>`` token.

    seq_len: L of the token samples; pad_token_id: the tokenizer's padding id (None: the
    config's); vocab_size: the tokenizer's vocabulary size (None: unchecked / the config's).
    forward(x int64 [B, L]) -> logits float [B, C]; features z = the last layer's ``<s>`` state
    float [B, H]. Raises MissingWeightsError (checkpoint unavailable), ValueError (a config or
    data set the model cannot take: L beyond the position table, a pad id or vocabulary that
    differs from the checkpoint's).
    """

    def __init__(self, seq_len: int, num_classes: int, checkpoint: str | None, config: Mapping[str, Any],
                 cache_dir: str | None, backbone_seed: int, lora: Mapping[str, Any], dropout: bool,
                 head_trainable: bool, attn_implementation: str, pad_token_id: int | None = None,
                 vocab_size: int | None = None):
        super().__init__()
        from transformers import RobertaConfig, RobertaModel

        name = "roberta-lora"
        off = {k: 0.0 for k in ROBERTA_DROPOUT_KEYS} if not dropout else {}
        if checkpoint is None:
            _check_config(name, RobertaConfig, config, ("num_labels",))
            kw = dict(config)
            if pad_token_id is not None:
                kw.setdefault("pad_token_id", int(pad_token_id))
            if vocab_size is not None:
                kw.setdefault("vocab_size", int(vocab_size))
            cfg = RobertaConfig(attn_implementation=attn_implementation, **{**kw, **off})
        else:
            try:
                cfg = RobertaConfig.from_pretrained(checkpoint, cache_dir=hub_cache_dir(cache_dir),
                                                    local_files_only=hub_offline(), **off)
            except (OSError, ValueError) as e:
                raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir, e)) from None
        pad = cfg.pad_token_id if pad_token_id is None else int(pad_token_id)
        if pad != cfg.pad_token_id:
            raise ValueError(f"train.model={name}: the data set's tokenizer pads with id {pad}, the backbone's "
                             f"padding id (RobertaConfig.pad_token_id) is {cfg.pad_token_id}; tokenise with the "
                             "checkpoint's own tokenizer")
        if vocab_size is not None and int(vocab_size) > cfg.vocab_size:
            raise ValueError(f"train.model={name}: the tokenizer has {vocab_size} token ids, the backbone's embedding "
                             f"{cfg.vocab_size}")
        if seq_len + pad + 1 > cfg.max_position_embeddings:
            raise ValueError(f"train.model={name}: token samples of length {seq_len} need {seq_len + pad + 1} position "
                             f"embeddings (RoBERTa counts positions from pad_token_id + 1), the backbone has "
                             f"{cfg.max_position_embeddings}")
        self.pad_token_id = int(pad)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(backbone_seed)
            if checkpoint is None:
                backbone = RobertaModel(cfg, add_pooling_layer=False)
            else:
                try:
                    backbone = RobertaModel.from_pretrained(
                        checkpoint, config=cfg, cache_dir=hub_cache_dir(cache_dir), local_files_only=hub_offline(),
                        add_pooling_layer=False, attn_implementation=attn_implementation)
                except (OSError, ValueError) as e:
                    raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir, e)) from None
        emb = backbone.embeddings
        for buf in ("position_ids", "token_type_ids"):  # unused (see the module docstring); never per-client state
            if buf in emb._buffers:
                del emb._buffers[buf]
        lora_cfg = _inject_lora(name, backbone, lora, "RoBERTa names them query, key, value")
        self.backbone = backbone
        p = cfg.classifier_dropout if cfg.classifier_dropout is not None else cfg.hidden_dropout_prob
        self.head = RobertaHead(cfg.hidden_size, num_classes, p)
        _init_linear_(self.head.dense, cfg.initializer_range)
        _init_linear_(self.head.out_proj, cfg.initializer_range)
        self.feature_dim = cfg.hidden_size
        self._finish(lora_cfg, head_trainable, dropout and (cfg.hidden_dropout_prob > 0
                                                             or cfg.attention_probs_dropout_prob > 0 or p > 0),
                     float(lora["dropout"]))

    def attention_mask(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float [B, 1, 1, L]: 0 on the tokens that are not padding (and always on position 0), the
        dtype's minimum on padding: the additive mask the attention adds to its scores."""
        keep = x != self.pad_token_id
        keep = keep | (torch.arange(x.shape[-1], device=x.device) == 0)
        neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=x.device)
        return torch.where(keep, torch.zeros((), dtype=dtype, device=x.device), neg)[:, None, None, :]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            raise ValueError("train.model=roberta-lora takes int64 token ids; the batch is floating point (the data "
                             "set's kind must be 'tokens')")
        dtype = self.backbone.embeddings.word_embeddings.weight.dtype
        out = self.backbone(input_ids=x, attention_mask=self.attention_mask(x, dtype),
                            token_type_ids=torch.zeros_like(x))
        return out.last_hidden_state[:, 0]


# ------------------------------------------------------------------------------------ wav2vec 2.0

#: dropout keys of Wav2Vec2Config that ``dropout: false`` sets to 0 (and SpecAugment off)
WAV2VEC2_DROPOUT_OFF = {"hidden_dropout": 0.0, "activation_dropout": 0.0, "attention_dropout": 0.0,
                        "feat_proj_dropout": 0.0, "final_dropout": 0.0, "layerdrop": 0.0, "mask_time_prob": 0.0,
                        "mask_feature_prob": 0.0, "apply_spec_augment": False}


class Wav2Vec2Head(nn.Module):
    """``Wav2Vec2ForSequenceClassification``'s head on the frame-mean features z float [B, H]:
    ``classifier(projector(z))``. The HF class projects every frame and then averages; both are
    linear, so this is the same map (up to float rounding). 768 -> 256 -> C: 196,864 + 257 C
    parameters (197,892 for 4 classes, 198,663 for 7; the notes)."""

    def __init__(self, hidden: int, proj: int, num_classes: int):
        super().__init__()
        self.projector = nn.Linear(hidden, proj)
        self.classifier = nn.Linear(proj, num_classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.projector(z))


class Wav2Vec2LoRAClassifier(HFLoRAClassifier):
    """``wav2vec2-lora``: ``Wav2Vec2ForSequenceClassification`` (FHBench:
    ``facebook/wav2vec2-base-960h``) as a frozen ``Wav2Vec2Model`` with ``freeze_feature_encoder()``
    (the convolutional stem runs without keeping its activations for the backward pass: 155 MiB
    per 8-s clip instead of 416 MiB, the notes; the FHBench code does not call it, which changes
    memory, not results) + LoRA on ``q_proj``/``v_proj`` + :class:`Wav2Vec2Head`.

    num_samples: T of the waveforms (16 kHz). forward(x float32 [B, T]) -> logits float [B, C];
    features z = the mean over frames of the last hidden state float [B, H]. Raises
    MissingWeightsError, ValueError (a clip too short for one frame of the convolutional stem).
    """

    def __init__(self, num_samples: int, num_classes: int, checkpoint: str | None, config: Mapping[str, Any],
                 cache_dir: str | None, backbone_seed: int, lora: Mapping[str, Any], dropout: bool,
                 head_trainable: bool, attn_implementation: str):
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        name = "wav2vec2-lora"
        off = dict(WAV2VEC2_DROPOUT_OFF) if not dropout else {}
        if checkpoint is None:
            _check_config(name, Wav2Vec2Config, config, ("num_labels", "use_weighted_layer_sum"))
            cfg = Wav2Vec2Config(attn_implementation=attn_implementation, **{**dict(config), **off})
        else:
            try:
                cfg = Wav2Vec2Config.from_pretrained(checkpoint, cache_dir=hub_cache_dir(cache_dir),
                                                     local_files_only=hub_offline(), **off)
            except (OSError, ValueError) as e:
                raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir, e)) from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(backbone_seed)
            if checkpoint is None:
                backbone = Wav2Vec2Model(cfg)
            else:
                try:
                    backbone = Wav2Vec2Model.from_pretrained(
                        checkpoint, config=cfg, cache_dir=hub_cache_dir(cache_dir), local_files_only=hub_offline(),
                        attn_implementation=attn_implementation)
                except (OSError, ValueError) as e:
                    raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir, e)) from None
        frames = int(backbone._get_feat_extract_output_lengths(int(num_samples)))
        if frames < 1:
            raise ValueError(f"train.model={name}: waveforms of {num_samples} samples give no frame of the "
                             "convolutional feature encoder")
        backbone.freeze_feature_encoder()
        lora_cfg = _inject_lora(name, backbone, lora, "wav2vec2 names them q_proj, k_proj, v_proj, out_proj")
        self.backbone = backbone
        self.head = Wav2Vec2Head(cfg.hidden_size, cfg.classifier_proj_size, num_classes)
        _init_linear_(self.head.projector, cfg.initializer_range)
        _init_linear_(self.head.classifier, cfg.initializer_range)
        self.feature_dim = cfg.hidden_size
        active = dropout and (any(getattr(cfg, k) for k in ("hidden_dropout", "activation_dropout",
                                                           "attention_dropout", "feat_proj_dropout", "layerdrop"))
                              or (cfg.apply_spec_augment and (cfg.mask_time_prob > 0 or cfg.mask_feature_prob > 0)))
        self._finish(lora_cfg, head_trainable, bool(active), float(lora["dropout"]))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.backbone(x)
        return out.last_hidden_state.mean(dim=1)


# ------------------------------------------------------------------------------------ MOMENT

#: MOMENT-1-small's T5 encoder as assumed when no checkpoint config is read (google/flan-t5-small's
#: encoder, the momentfm ``transformer_backbone`` of MOMENT-1-small; the notes: "not verified")
MOMENT_SMALL_T5 = {"d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8, "num_heads": 6,
                   "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
                   "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "dropout_rate": 0.1}
#: momentfm's own (non-T5) options this wrapper reads from a checkpoint's config.json, with
#: momentfm's defaults (``MOMENT.__init__`` / ``PatchEmbedding`` / ``ClassificationHead``)
MOMENT_OPTIONS = {"seq_len": 512, "patch_len": 8, "patch_stride_len": 8, "revin_affine": False,
                  "add_positional_embedding": True, "value_embedding_bias": False, "patch_dropout": 0.1,
                  "head_dropout": 0.1}
#: keys of a momentfm checkpoint this wrapper does not use: the reconstruction head (the
#: classification head is new), the mask token embedding (the input mask is all ones), the
#: T5 token embedding (MOMENT feeds patch embeddings) and the sinusoid table (recomputed)
MOMENT_UNUSED_PREFIXES = ("head.", "patch_embedding.mask_embedding", "encoder.embed_tokens.",
                          "patch_embedding.position_embedding.pe")


def sinusoid_table(n: int, d: int) -> torch.Tensor:
    """float32 [n, d]: the Transformer sinusoid (Vaswani et al. 2017) as momentfm's
    ``PositionalEmbedding`` computes it: sin on even, cos on odd features, wavelengths
    10000^(2i/d)."""
    pe = torch.zeros(n, d)
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    div = (torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d)).exp()
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class MomentHead(nn.Module):
    """momentfm's ``ClassificationHead`` on the patch-mean features z float [B, F]: dropout, then
    Linear(F, C); F = C_in * d_model (``reduction: concat``, FHBench) or d_model (``mean``)."""

    def __init__(self, in_features: int, num_classes: int, p: float):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.linear(self.dropout(z))


def read_moment_checkpoint(checkpoint: str, cache_dir: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """``(config, state dict, weights file)`` of a momentfm checkpoint: a local folder or a hub id
    (``AutonLab/MOMENT-1-small``) holding ``config.json`` and ``model.safetensors`` (or
    ``pytorch_model.bin``), the layout ``PyTorchModelHubMixin.save_pretrained`` writes. Reads the
    hub through the local cache (offline: the cache only). Raises MissingWeightsError when the
    files are neither here nor downloadable, DataError naming the file when one is unreadable."""
    name = "moment-lora"
    folder = Path(checkpoint)

    def fetch(filename: str) -> Path | None:
        if folder.is_dir():
            p = folder / filename
            return p if p.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

        try:
            return Path(hf_hub_download(checkpoint, filename, cache_dir=hub_cache_dir(cache_dir),
                                        local_files_only=hub_offline()))
        except (EntryNotFoundError, RemoteEntryNotFoundError):
            return None
        except Exception as e:  # noqa: BLE001 - offline, no cache, no network, bad id: all mean "not here"
            raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir, e)) from None

    cfg_path = fetch("config.json")
    if cfg_path is None:
        raise MissingWeightsError(missing_weights_message(name, checkpoint, cache_dir,
                                                          FileNotFoundError("config.json")))
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{cfg_path}: unreadable momentfm config ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("t5_config"), dict):
        raise DataError(f"{cfg_path}: not a momentfm config (no 't5_config' mapping)")
    weights = fetch("model.safetensors")
    try:
        if weights is not None:
            from safetensors.torch import load_file

            state = load_file(str(weights))
        else:
            weights = fetch("pytorch_model.bin")
            if weights is None:
                raise MissingWeightsError(missing_weights_message(
                    name, checkpoint, cache_dir, FileNotFoundError("model.safetensors / pytorch_model.bin")))
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except MissingWeightsError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged weights file
        raise DataError(f"{weights}: unreadable weights file ({type(e).__name__}: {e})") from None
    return config, state, str(weights)


def moment_state_to_ours(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Map a momentfm state dict (``MOMENT``'s keys: ``normalizer.*``, ``patch_embedding.
    value_embedding.*``, ``encoder.*`` = the T5 stack, ``head.*``, ...) to
    :class:`MomentLoRAClassifier`'s backbone keys: ``encoder.*`` and ``patch_embedding.
    value_embedding.*`` keep their names (our modules mirror momentfm's), ``normalizer.affine_*``
    too; the keys in :data:`MOMENT_UNUSED_PREFIXES` are dropped. Raises DataError naming
    ``source`` and the key for any other key."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k.startswith(MOMENT_UNUSED_PREFIXES):
            continue
        if k.startswith(("encoder.", "patch_embedding.value_embedding.", "normalizer.affine_")):
            out[k] = v
            continue
        raise DataError(f"{source}: unexpected key {k!r} for a MOMENT checkpoint (known: encoder.*, "
                        "patch_embedding.value_embedding.*, normalizer.affine_*, and unused head.*, "
                        "patch_embedding.mask_embedding, patch_embedding.position_embedding.pe)")
    return out


class RevIN(nn.Module):
    """Reversible instance normalisation (Kim et al. 2022) as momentfm applies it before
    patching, with an all-ones input mask: per sample and channel, (x - mean_t) / (std_t + eps),
    std without Bessel correction, eps 1e-5, statistics detached; then NaN/inf -> 0; optional
    affine (``revin_affine``; off in momentfm by default). x float [B, C, T] -> same."""

    def __init__(self, affine: bool, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        if affine:
            self.affine_weight = nn.Parameter(torch.ones(1, 1, 1))
            self.affine_bias = nn.Parameter(torch.zeros(1, 1, 1))
        self.affine = affine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True).detach()
        std = ((x - mean).square().mean(dim=-1, keepdim=True).sqrt() + self.eps).detach()
        y = (x - mean) / std
        if self.affine:
            y = y * self.affine_weight + self.affine_bias
        return torch.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)


class PatchEmbedding(nn.Module):
    """momentfm's ``PatchEmbedding`` with an all-ones mask: ``value_embedding`` Linear(patch_len,
    d) of every patch, plus the sinusoid position table (a frozen parameter [P, d], never state),
    then dropout. x float [B, C, P, patch_len] -> [B, C, P, d]."""

    def __init__(self, patch_len: int, d_model: int, n_patches: int, bias: bool, positional: bool, p: float):
        super().__init__()
        self.value_embedding = nn.Linear(patch_len, d_model, bias=bias)
        self.position_embedding = (nn.Parameter(sinusoid_table(n_patches, d_model), requires_grad=False)
                                   if positional else None)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.value_embedding(x)
        if self.position_embedding is not None:
            y = y + self.position_embedding[: y.shape[-2]]
        return self.dropout(y)


class MomentLoRAClassifier(HFLoRAClassifier):
    """``moment-lora``: MOMENT-1 (Goswami et al. 2024; FHBench: ``AutonLab/MOMENT-1-small``,
    ``task_name: classification``, ``reduction: concat``) without the ``momentfm`` package (its
    pins clash with ours, the notes): :class:`RevIN` -> patches of ``patch_len`` (8,
    non-overlapping) -> :class:`PatchEmbedding` -> transformers' T5 encoder stack
    (``T5EncoderModel(...).get_encoder()``, as momentfm builds it) over the B*C channel sequences
    of P patches, no attention mask -> [B, C, P, d] -> channels concatenated (momentfm's order:
    feature index = d_index * C + channel) or averaged -> mean over patches -> :class:`MomentHead`.
    LoRA on the T5 ``q``/``v``. The T5 token embedding is never used (momentfm feeds
    ``inputs_embeds``), so the stack is built with a 1-token vocabulary (the checkpoint's 32,128 x
    512 table, 16.4 M parameters, is not loaded).

    channels, length: C and T of the samples (T a multiple of ``patch_len`` and at most the
    checkpoint's ``seq_len``, 512). forward(x float32 [B, C, T]) -> logits float [B, classes];
    features z float [B, C*d] (``concat``) or [B, d] (``mean``). Raises MissingWeightsError,
    DataError (a checkpoint file with unknown or missing keys, naming it), ValueError (a shape
    the model cannot take).
    """

    def __init__(self, channels: int, length: int, num_classes: int, checkpoint: str | None,
                 config: Mapping[str, Any], cache_dir: str | None, backbone_seed: int, lora: Mapping[str, Any],
                 dropout: bool, head_trainable: bool, reduction: str, attn_implementation: str = "eager"):
        super().__init__()
        from transformers import T5Config, T5EncoderModel

        name = "moment-lora"
        state = None
        if checkpoint is None:
            _check_config(name, T5Config, config, ("vocab_size", "is_decoder", "use_cache"),
                          extra=tuple(MOMENT_OPTIONS))
            opts = {**MOMENT_OPTIONS, **{k: v for k, v in config.items() if k in MOMENT_OPTIONS}}
            t5 = {**MOMENT_SMALL_T5, **{k: v for k, v in config.items() if k not in MOMENT_OPTIONS}}
            source = "config"
        else:
            raw, sd, source = read_moment_checkpoint(checkpoint, cache_dir)
            opts = {**MOMENT_OPTIONS, **{k: raw[k] for k in MOMENT_OPTIONS if raw.get(k) is not None}}
            t5 = dict(raw["t5_config"])
            state = moment_state_to_ours(sd, source)
        if opts["patch_stride_len"] != opts["patch_len"]:
            raise ValueError(f"train.model={name}: {source} has patch_stride_len {opts['patch_stride_len']} != "
                             f"patch_len {opts['patch_len']}; only non-overlapping patches are supported")
        plen = int(opts["patch_len"])
        if length % plen or length > int(opts["seq_len"]):
            raise ValueError(f"train.model={name} needs samples [C, T] with T a multiple of patch_len {plen} and at "
                             f"most seq_len {opts['seq_len']} (MOMENT: 512); this data set's T is {length}")
        t5.update(vocab_size=1, is_decoder=False, use_cache=False, eos_token_id=None, pad_token_id=None,
                  decoder_start_token_id=None)
        if not dropout:
            t5["dropout_rate"] = 0.0
        cfg = T5Config(attn_implementation=attn_implementation,
                       **{k: v for k, v in t5.items() if k not in ("architectures", "_name_or_path",
                                                                   "attn_implementation")})
        d = int(cfg.d_model)
        p_patch = float(opts["patch_dropout"]) if dropout else 0.0
        p_head = float(opts["head_dropout"]) if dropout else 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(backbone_seed)
            self.normalizer = RevIN(bool(opts["revin_affine"]))
            self.patch_embedding = PatchEmbedding(plen, d, int(opts["seq_len"]) // plen,
                                                  bool(opts["value_embedding_bias"]),
                                                  bool(opts["add_positional_embedding"]), p_patch)
            if checkpoint is None:  # momentfm's init of the value embedding (orthogonal, gain 1.41)
                nn.init.orthogonal_(self.patch_embedding.value_embedding.weight, gain=1.41)
                if self.patch_embedding.value_embedding.bias is not None:
                    nn.init.zeros_(self.patch_embedding.value_embedding.bias)
            self.encoder = T5EncoderModel(cfg).get_encoder()
        if state is not None:
            own = self.state_dict()
            missing = sorted(k for k in own if k not in state and not k.startswith("encoder.embed_tokens.")
                             and k != "patch_embedding.position_embedding")
            if missing:
                raise DataError(f"{source}: missing key {missing[0]!r} of a MOMENT checkpoint ({len(missing)} missing)")
            bad = [k for k, v in state.items() if k not in own or tuple(own[k].shape) != tuple(v.shape)]
            if bad:
                k = bad[0]
                raise DataError(f"{source}: key {k!r} has shape {tuple(state[k].shape)}, the config implies "
                                f"{tuple(own[k].shape) if k in own else 'no such weight'}")
            self.load_state_dict(state, strict=False)
        self.patch_len = plen
        self.channels = int(channels)
        self.d_model = d
        self.reduction = reduction
        lora_cfg = _inject_lora(name, self.encoder, lora, "T5 names them q, k, v, o")
        for p in [*self.normalizer.parameters(), *self.patch_embedding.parameters()]:
            p.requires_grad_(False)
        self.feature_dim = d * channels if reduction == "concat" else d
        self.head = MomentHead(self.feature_dim, num_classes, p_head)  # nn.Linear's own init, as momentfm's
        self._finish(lora_cfg, head_trainable, dropout and (cfg.dropout_rate > 0 or p_patch > 0 or p_head > 0),
                     float(lora["dropout"]))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        x = self.normalizer(x)
        patches = x.unfold(-1, self.patch_len, self.patch_len)  # [B, C, P, patch_len]
        emb = self.patch_embedding(patches)  # [B, C, P, d]
        n = emb.shape[2]
        out = self.encoder(inputs_embeds=emb.reshape(b * c, n, self.d_model)).last_hidden_state
        out = out.reshape(b, c, n, self.d_model)
        if self.reduction == "concat":
            out = out.permute(0, 2, 3, 1).reshape(b, n, self.d_model * c)
        else:
            out = out.mean(dim=1)
        return out.mean(dim=1)


def lora_numel(module: nn.Module) -> int:
    """Adapter elements of ``module``: ``r * (d_in + d_out)`` per adapted Linear (A [r, d_in], B
    [d_out, r])."""
    total = 0
    for mod in module.modules():
        base = getattr(mod, "base_layer", None)
        if isinstance(base, nn.Linear):
            r = int(next(iter(mod.r.values())))
            total += r * (base.in_features + base.out_features)
    return total


#: tiny random backbones that build offline in milliseconds: the tests' and CPU runs' stand-ins
TINY_ROBERTA: dict[str, Any] = {"checkpoint": None, "dropout": False, "lora_dropout": 0.0,
                                "config": {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
                                           "num_attention_heads": 2, "intermediate_size": 32,
                                           "max_position_embeddings": 40}}
TINY_WAV2VEC2: dict[str, Any] = {"checkpoint": None, "dropout": False, "lora_dropout": 0.0,
                                 "config": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                                            "intermediate_size": 32, "conv_dim": [8, 8], "conv_stride": [5, 2],
                                            "conv_kernel": [10, 3], "num_conv_pos_embeddings": 16,
                                            "num_conv_pos_embedding_groups": 2, "classifier_proj_size": 12}}
TINY_MOMENT: dict[str, Any] = {"checkpoint": None, "dropout": False, "lora_dropout": 0.0,
                               "config": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 2, "num_heads": 2}}

__all__ = ["HFLoRAClassifier", "MissingWeightsError", "MomentLoRAClassifier", "RobertaLoRAClassifier",
           "TINY_MOMENT", "TINY_ROBERTA", "TINY_WAV2VEC2", "Wav2Vec2LoRAClassifier", "lora_numel",
           "moment_state_to_ours", "read_moment_checkpoint", "sinusoid_table"]
