"""The model zoo: every model by its params name (``train.model``), with its own validated
arguments (``train.model_args``).

A zoo entry declares an ``Args`` model (pydantic, unknown keys are errors, every field has a
default and a description with its source) and a builder ``(input_shape, num_classes, args) ->
nn.Module``. ``input_shape`` is one sample's shape: ``(C, H, W)`` for images, ``(d,)`` for
vectors. ``train.model_args`` is validated against the entry's ``Args`` when params are read
(:class:`medpfl.config.TrainConfig`, by way of :mod:`medpfl.compose`) and again by
:func:`build_model`; errors name the params key (``train.model`` or ``train.model_args``), the
model and its known arguments.

Adding a model (a ResNet, a ViT): write the module (contract below), an ``Args`` class for its
knobs (or :class:`NoArgs`), a builder, and one :data:`ZOO` entry; ``tests/test_models.py`` then
checks it (forward shapes, parts, both executors) without being edited.

Sequence models (the FHBench text, time-series and audio tracks) declare the sample kind they
take as the entry's ``input`` (``tokens``: int64 ``[L]`` token ids; ``timeseries``: float32
``[C, T]``; ``waveform``: float32 ``[T]``; :data:`medpfl.data.multimodal.KINDS`) and are built with
``build_model(..., sample_shape=..., kind=..., pad_token_id=...)`` (the training stage passes
:attr:`medpfl.fl.data.FederatedData.sample_shape`, ``.kind`` and ``.pad_token_id``); their
builder is called as ``build(shape, num_classes, args, kind=kind, pad_token_id=pad_token_id)``.

The contract every zoo model meets: ``forward(x, mask=None, with_features=False)`` returns logits
float [B, C] (``(z, logits)`` with the penultimate features z float [B, d] when
``with_features``); ``mask`` (bool [B]) marks the real samples of a padded batch, for BatchNorm;
``head_name`` names the final classifier submodule (the ``head`` part; everything else is the
``body``), and optionally ``extra_parts()`` declares more named parts (see
:class:`medpfl.fl.functional.FunctionalModel`). Written so that ``torch.func.vmap`` can run it
(no data-dependent Python control flow, no in-place ops on inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from medpfl.models.cnn import CNN4
from medpfl.models.linear import MLP, MLR
from medpfl.models.resnet import ResNet
from medpfl.models.simplecnn import SimpleCNN, simplecnn_side
from medpfl.models.vit import ViTClassifier


class ModelArgs(BaseModel):
    """Base of a model's arguments (``train.model_args``): unknown keys are errors, values typed."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoArgs(ModelArgs):
    """The model takes no arguments."""


class MLPArgs(ModelArgs):
    """``mlp``'s hidden width: 128 is the pFedKD-WCL paper's (MNIST and Synthetic) [P]; its
    official code uses 20 on Synthetic (``SyntheticMLP(input_dim=60, hidden_dim=20)``) [C], set
    ``train.model_args: {hidden: 20}`` to match it."""

    hidden: int = Field(128, ge=1, description="hidden units (paper: 128; official code on Synthetic: 20)")


class SimpleCNNArgs(ModelArgs):
    """``simplecnn``'s BatchNorm switch: the PFPS-LWC paper's CNN is unstated; its FedBN baseline
    only differs from FedAvg with BatchNorm, so the spec's option ``use_bn`` (B.1, item 16)."""

    batch_norm: bool = Field(False, description="BatchNorm after each convolution (conv-BN-ReLU-pool; PFPS-LWC "
                                                "spec B.1 option use_bn)")


class ResNetArgs(ModelArgs):
    """A ResNet's stem and width (:mod:`medpfl.models.resnet`). FedMIC (spec A.9) trains
    ResNet101 on 64-px images without saying how the stem meets them; ``small`` keeps the
    resolution (layer4 at 8x8 for 64 px), ``imagenet`` is He et al.'s stem (layer4 at 2x2)."""

    stem: Literal["small", "imagenet"] = Field(
        "small", description="small: 3x3 stride-1 conv, no max pooling (small images; MedMNIST's own ResNets); "
                             "imagenet: 7x7 stride-2 conv + 3x3 stride-2 max pooling (He et al. 2016)")
    width: int = Field(64, ge=1, description="base channels: stages of width, 2, 4, 8 x width (He et al.: 64)")


class ViTArgs(ModelArgs):
    """``vit``: a ViT from ``transformers`` with a new linear head, every weight trained (full
    fine-tuning). Defaults: the FHBench paper's ViT-B/16 at 224 px ([P]; the code's timm
    ``vit_base_patch16_224``; ``google/vit-base-patch16-224`` is its ``transformers``
    checkpoint). ``checkpoint: null`` builds a randomly initialised ViT from ``config`` (the tiny
    ViT of the tests and CPU runs)."""

    checkpoint: str | None = Field("google/vit-base-patch16-224",
                                   description="Hugging Face hub id of the pretrained ViT (null: random init from "
                                               "config)")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="ViTConfig overrides for checkpoint: null (hidden_size, "
                                               "num_hidden_layers, num_attention_heads, intermediate_size, "
                                               "patch_size); image_size and num_channels come from the data")
    cache_dir: str | None = Field(None, description="Hugging Face cache folder (null: HF_HOME or ~/.cache/huggingface)")
    backbone_seed: int = Field(0, ge=0, description="seed of a randomly initialised backbone (checkpoint: null): the "
                                                    "same backbone in every run seed")
    attn_implementation: Literal["eager", "sdpa"] = Field(
        "eager", description="transformers attention kernel (eager runs under torch.func.vmap everywhere)")

    @model_validator(mode="after")
    def _config_only_without_checkpoint(self) -> "ViTArgs":
        if self.checkpoint is not None and self.config:
            raise ValueError("config applies to a randomly initialised ViT (checkpoint: null); a pretrained "
                             "checkpoint brings its own")
        return self


class ViTLoRAArgs(ViTArgs):
    """``vit_lora``: ``vit`` with the backbone frozen and LoRA adapters from ``peft`` on the
    query and value projections of every block (FHBench spec B.2.1-B.2.2: rank 8 [P], alpha 16
    [C] (scale 2), no dropout for ViT [C])."""

    rank: int = Field(8, ge=1, description="LoRA rank r (FHBench: 8, fixed)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank (FHBench code: 16)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout (FHBench code: none for ViT)")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"],
                                      description="adapted projections (transformers 5 names: q_proj, v_proj = "
                                                  "query, value)")


#: a tiny randomly initialised ViT (2 blocks, width 32, 7-px patches: 28-px images; ~22k backbone
#: parameters) that builds offline: the tests' and CPU runs' stand-in for ViT-B/16
TINY_VIT: dict[str, Any] = {"checkpoint": None, "config": {"hidden_size": 32, "num_hidden_layers": 2,
                                                           "num_attention_heads": 2, "intermediate_size": 64,
                                                           "patch_size": 7}}


def _vit(lora: bool) -> Callable[[tuple[int, ...], int, ModelArgs], nn.Module]:
    def build(shape: tuple[int, ...], num_classes: int, args: ViTArgs) -> nn.Module:
        name = "vit_lora" if lora else "vit"
        if len(shape) != 3:
            raise ValueError(f"train.model={name} needs image samples [C, H, W]; this data set's samples have shape "
                             f"{list(shape)} (vector data: use mlr or mlp)")
        if shape[1] != shape[2]:
            raise ValueError(f"train.model={name} needs square images, got {shape[1]}x{shape[2]}")
        adapters = ({"rank": args.rank, "alpha": args.alpha, "dropout": args.dropout,
                     "target_modules": list(args.target_modules)} if lora else None)
        return ViTClassifier(shape[0], num_classes, shape[1], args.checkpoint, dict(args.config), args.cache_dir,
                             args.backbone_seed, adapters, args.attn_implementation)

    return build


def _image_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(f"train.model={name} needs image samples [C, H, W]; this data set's samples have shape "
                         f"{list(shape)} (vector data: use mlr or mlp)")
    c, h, w = shape
    if h != w or h % 4:
        raise ValueError(f"train.model={name} needs square images with a side divisible by 4, got {h}x{w}")
    return c, h, w


def _cnn4(batch_norm: bool) -> Callable[[tuple[int, ...], int, ModelArgs], nn.Module]:
    def build(shape: tuple[int, ...], num_classes: int, args: ModelArgs) -> nn.Module:
        c, h, _ = _image_shape("cnn4bn" if batch_norm else "cnn4", shape)
        return CNN4(c, num_classes, h, batch_norm=batch_norm)

    return build


def _simplecnn(shape: tuple[int, ...], num_classes: int, args: SimpleCNNArgs) -> nn.Module:
    if len(shape) != 3:
        raise ValueError(f"train.model=simplecnn needs image samples [C, H, W]; this data set's samples have shape "
                         f"{list(shape)} (vector data: use mlr or mlp)")
    if shape[1] != shape[2]:
        raise ValueError(f"train.model=simplecnn needs square images, got {shape[1]}x{shape[2]}")
    simplecnn_side(shape[1])
    return SimpleCNN(shape[0], num_classes, shape[1], batch_norm=args.batch_norm)


def _resnet(arch: str, dim: int = 2) -> Callable[[tuple[int, ...], int, ModelArgs], nn.Module]:
    def build(shape: tuple[int, ...], num_classes: int, args: ResNetArgs) -> nn.Module:
        name = arch + ("_3d" if dim == 3 else "")
        if len(shape) != 3:
            raise ValueError(f"train.model={name} needs image samples [C, H, W]; this data set's samples have shape "
                             f"{list(shape)} (vector data: use mlr or mlp)")
        return ResNet(arch, shape[0], num_classes, width=args.width, stem=args.stem, dim=dim)

    return build


def _mlr(shape: tuple[int, ...], num_classes: int, args: ModelArgs) -> nn.Module:
    return MLR(math.prod(shape), num_classes)


def _mlp(shape: tuple[int, ...], num_classes: int, args: MLPArgs) -> nn.Module:
    return MLP(math.prod(shape), num_classes, hidden=args.hidden)


@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[tuple[int, ...], int, Any], nn.Module]
    summary: str
    Args: type[ModelArgs] = NoArgs
    #: input the model takes: "image" ([C, H, W] samples only), "any" (flattened: images, vectors, time
    #: series, waveforms; not token ids), or one sequence kind: "tokens", "timeseries", "waveform"
    #: (such a builder also gets the keywords kind and pad_token_id)
    input: str = "image"
    #: arguments of a small stand-in that builds offline (no download) for tests and CPU runs
    tiny_args: Mapping[str, Any] | None = None


ZOO: dict[str, ZooEntry] = {
    "cnn4": ZooEntry(_cnn4(False), "the standard 4-layer FL CNN (McMahan et al. 2017; FedKPer's MedMNISTNet); "
                                   "head = classifier"),
    "cnn4bn": ZooEntry(_cnn4(True), "cnn4 with BatchNorm after each convolution (masked statistics)"),
    "simplecnn": ZooEntry(_simplecnn, "the five-layer SimpleCNN (PFPS-LWC spec B.1): 2 conv (6, 16) + 120 + 84 + "
                                      "classifier; optional BatchNorm; head = classifier", SimpleCNNArgs),
    "resnet18": ZooEntry(_resnet("resnet18"), "ResNet-18 (He et al. 2016; BasicBlock [2, 2, 2, 2]) with masked "
                                              "BatchNorm, a small-image stem (or imagenet) and a width; head = fc; "
                                              "parts bn", ResNetArgs, tiny_args={"width": 4}),
    "resnet101": ZooEntry(_resnet("resnet101"), "ResNet-101 (He et al. 2016; Bottleneck [3, 4, 23, 3]; FedMIC's model) "
                                                "with masked BatchNorm; head = fc; parts bn", ResNetArgs,
                          tiny_args={"width": 2, "stem": "imagenet"}),
    "resnet18_3d": ZooEntry(_resnet("resnet18", dim=3), "ResNet-18 with 3D convolutions: a sample [D, H, W] (a "
                                                        "MedMNIST 3D volume) as a 1-channel volume; head = fc; parts "
                                                        "bn", ResNetArgs, tiny_args={"width": 2}),
    "vit": ZooEntry(_vit(False), "a ViT from transformers (default: pretrained ViT-B/16 at 224 px) with a new linear "
                                 "head on [CLS]; every weight trained (full fine-tuning); head = classifier", ViTArgs,
                    tiny_args=TINY_VIT),
    "vit_lora": ZooEntry(_vit(True), "vit with the backbone frozen (one shared copy) and peft LoRA adapters (r 8, "
                                     "alpha 16) on the query and value projections; state = adapters + head; parts "
                                     "lora_A, lora_B, head", ViTLoRAArgs, tiny_args=TINY_VIT),
    "mlr": ZooEntry(_mlr, "multinomial logistic regression: Linear(d_in, C) on the flattened input; "
                          "head = the layer, body empty", input="any"),
    "mlp": ZooEntry(_mlp, "Linear(d_in, hidden) -> ReLU -> Linear(hidden, C) on the flattened input; "
                          "body = first layer, head = last", MLPArgs, input="any"),
}

#: the params names of the zoo's models (``train.model``)
MODEL_NAMES = tuple(ZOO)


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    return ZOO[name]


def check_model_name(name: str) -> str:
    """``name`` if it is a zoo model; else ValueError (message relative to ``train.model``)."""
    _entry(name)
    return name


def resolve_model_args(name: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The validated arguments of model ``name`` with every default filled in (a plain dict).

    Raises ValueError for an unknown model, a non-mapping, an unknown argument (listing the
    model's arguments) or a bad value; the message is relative to ``train.model_args``.
    """
    entry = _entry(name)
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(f"must be a mapping of argument names to values, got {type(args).__name__}")
    known = tuple(entry.Args.model_fields)
    unknown = sorted(str(k) for k in args if k not in known)
    if unknown:
        takes = f"its arguments: {', '.join(known)}" if known else "it takes no arguments"
        raise ValueError(f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"for train.model={name} ({takes})")
    try:
        return entry.Args.model_validate(dict(args)).model_dump()
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{msgs} (train.model={name})") from None


def parameter_counts(module: nn.Module) -> dict[str, int]:
    """``{"trainable": ..., "frozen": ..., "total": ...}``: numbers of parameter elements of
    ``module`` (ints; trainable = ``requires_grad``, frozen = the rest, e.g. ``vit_lora``'s
    backbone). Buffers (BatchNorm statistics) are not parameters and not counted."""
    tr = sum(p.numel() for p in module.parameters() if p.requires_grad)
    tot = sum(p.numel() for p in module.parameters())
    return {"trainable": int(tr), "frozen": int(tot - tr), "total": int(tot)}


SEQUENCE_KINDS = ("tokens", "timeseries", "waveform")


def build_model(name: str, in_channels: int, num_classes: int, image_size: int | None = None,
                model_args: Mapping[str, Any] | None = None, *, sample_shape: tuple[int, ...] | None = None,
                kind: str | None = None, pad_token_id: int | None = None) -> nn.Module:
    """Build a model by its params name (``train.model``) with its ``train.model_args``.

    Samples are images [in_channels, image_size, image_size], or vectors of ``in_channels``
    features when ``image_size`` is None (``kind`` None, ``image`` or ``vector``: this path is
    unchanged, ``sample_shape`` is not read). For a sequence ``kind`` (``tokens``,
    ``timeseries``, ``waveform``) the sample is ``sample_shape`` (``(L,)``, ``(C, T)``, ``(T,)``)
    and the model must take that kind (its entry's ``input``; ``any`` takes all but tokens);
    ``pad_token_id`` is the data's padding id (tokens). Weights: PyTorch default initialisation
    from the current torch RNG. Raises ValueError naming ``train.model`` / ``train.model_args``.
    """
    try:
        entry = _entry(name)
    except ValueError as e:
        raise ValueError(f"train.model: {e}") from None
    try:
        args = entry.Args.model_validate(resolve_model_args(name, model_args))
    except ValueError as e:
        raise ValueError(f"train.model_args: {e}") from None
    if kind in SEQUENCE_KINDS:
        if sample_shape is None:
            raise ValueError(f"train.model={name}: {kind} samples need their sample_shape (internal error)")
        shape = tuple(int(v) for v in sample_shape)
        if entry.input == kind:
            model = entry.build(shape, num_classes, args, kind=kind, pad_token_id=pad_token_id)
        elif entry.input == "any" and kind != "tokens":
            model = entry.build(shape, num_classes, args)
        else:
            takes = "any samples but token ids (flattened)" if entry.input == "any" else f"{entry.input} samples"
            raise ValueError(f"train.model={name} takes {takes}; this data set's samples are {kind} {list(shape)}")
    else:
        if entry.input in SEQUENCE_KINDS:
            raise ValueError(f"train.model={name} takes {entry.input} samples; this data set's samples are "
                             f"{kind or ('image' if image_size is not None else 'vector')}")
        shape = (int(in_channels),) if image_size is None else (int(in_channels), int(image_size), int(image_size))
        model = entry.build(shape, num_classes, args)
    model.zoo_name = name
    return model
