"""Vision transformers from ``transformers``, fine-tuned in full or through LoRA adapters from
``peft`` (the FHBench paper's setting, ``../shared/docs/methods-pfedkdwcl-epfl.md`` B.2).

:class:`ViTClassifier` wraps a ``transformers`` ``ViTModel`` (no pooler) and a new linear
classification head on the final [CLS] token (after the backbone's last LayerNorm), the
classifier of ``ViTForImageClassification``. The backbone is either

* a pretrained checkpoint from the Hugging Face hub (``checkpoint``, default
  ``google/vit-base-patch16-224``, ViT-B/16 at 224 px: ImageNet-21k pretraining, ImageNet-1k
  fine-tuning, the ``transformers`` counterpart of the FHBench code's timm
  ``vit_base_patch16_224``), loaded with ``from_pretrained`` through the normal hub cache
  (``cache_dir`` or ``HF_HOME``); offline without the files the build stops with
  :class:`MissingWeightsError` naming the checkpoint and how to provide it; or
* a randomly initialised ``ViTConfig`` (``checkpoint: null`` and ``config``: e.g. the tiny ViT
  the tests and CPU runs use), drawn from its own generator seeded by ``backbone_seed`` so the
  frozen backbone is the same in every run seed and every build.

With LoRA (``vit_lora``), ``peft.inject_adapter_in_model`` puts a ``LoraConfig`` (rank 8,
alpha 16, no dropout: FHBench [P]/[C]) on the query and value projections of every block
(``q_proj``/``v_proj`` in transformers 5; ``query``/``value`` in older releases), and every
backbone weight is frozen (``requires_grad=False``): the engine's state then holds only the
adapters and the head, and the frozen backbone stays one shared copy (see
:class:`medpfl.fl.functional.FunctionalModel`). peft's LoRA init: A ~ kaiming_uniform(a=sqrt 5),
B = 0, scale alpha / r (FHBench spec B.2.1). Without LoRA (``vit``) every weight trains: the
"full fine-tuning" reference of the same model.

Parts: ``head`` = the classifier; ``body`` = every other state entry (the adapters under LoRA);
``lora_A`` / ``lora_B`` = the adapters' A (float [r, d_in]) and B (float [d_out, r]) weights in
module order (block 0 query, block 0 value, block 1 query, ...), the l-th A pairing with the
l-th B (EPFL's psi selects among them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from medpfl.errors import MissingWeightsError  # noqa: F401  (defined in medpfl.errors; importable here as before)


def _vit_config(checkpoint: str | None, config: dict[str, Any], cache_dir: str | None, image_size: int,
                in_channels: int, attn_implementation: str):
    from transformers import ViTConfig

    if checkpoint is None:
        unknown = sorted(k for k in config if not hasattr(ViTConfig(), k) or k in ("image_size", "num_channels"))
        if unknown:
            raise ValueError(f"train.model_args.config: unknown or fixed ViTConfig keys {unknown} (image_size and "
                             "num_channels come from the data set)")
        kw = {"image_size": image_size, "num_channels": in_channels, **config}
        return ViTConfig(attn_implementation=attn_implementation, **kw)
    try:
        cfg = ViTConfig.from_pretrained(checkpoint, cache_dir=cache_dir)
    except (OSError, ValueError) as e:
        raise MissingWeightsError(_missing(checkpoint, cache_dir, e)) from None
    return cfg


def _missing(checkpoint: str, cache_dir: str | None, err: Exception) -> str:
    where = cache_dir or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return (f"train.model_args.checkpoint={checkpoint!r}: the pretrained weights are not in the Hugging Face cache "
            f"({where}) and could not be downloaded ({type(err).__name__}). Provide them on a machine with internet "
            f"access with `huggingface-cli download {checkpoint}` (or `python -c \"from transformers import ViTModel; "
            f"ViTModel.from_pretrained('{checkpoint}')\"`) and copy the cache folder here (set HF_HOME or "
            "train.model_args.cache_dir to it), or set train.model_args.checkpoint: null with a config for a "
            "randomly initialised ViT (say so when reporting)")


class ViTClassifier(nn.Module):
    """``ViTModel`` backbone + linear head on the [CLS] token; optional LoRA adapters.

    in_channels: channels of the input images; a 1-channel input to a 3-channel backbone is
    repeated to 3 channels (grayscale to RGB, as the FHBench code does). image_size: the input
    side in pixels; a pretrained backbone made for another size interpolates its position
    embeddings (``interpolate_pos_encoding``). lora: None (full fine-tuning) or a dict with
    ``rank``, ``alpha``, ``dropout``, ``target_modules``.

    forward(x float [B, C, H, W], mask=None, with_features=False) -> logits float [B, classes]
    (``(z float [B, hidden], logits)`` with ``with_features``). Raises MissingWeightsError when a
    checkpoint cannot be loaded, ValueError for an input the backbone cannot take.
    """

    head_name = "classifier"

    def __init__(self, in_channels: int, num_classes: int, image_size: int, checkpoint: str | None,
                 config: dict[str, Any], cache_dir: str | None, backbone_seed: int, lora: dict[str, Any] | None,
                 attn_implementation: str = "eager"):
        super().__init__()
        from transformers import ViTModel

        cfg = _vit_config(checkpoint, config, cache_dir, image_size, in_channels, attn_implementation)
        if in_channels not in (cfg.num_channels, 1):
            raise ValueError(f"train.model: the ViT backbone takes {cfg.num_channels}-channel images, the data set has "
                             f"{in_channels} channels")
        if image_size % cfg.patch_size:
            raise ValueError(f"train.model: image side {image_size} px is not a multiple of the ViT patch size "
                             f"{cfg.patch_size} (train.model_args.config.patch_size, or a data set size such as _224)")
        self.repeat_channels = cfg.num_channels if in_channels == 1 and cfg.num_channels != 1 else 1
        self.interpolate = image_size != cfg.image_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(backbone_seed)
            if checkpoint is None:
                backbone = ViTModel(cfg, add_pooling_layer=False)
            else:
                try:
                    backbone = ViTModel.from_pretrained(checkpoint, cache_dir=cache_dir, add_pooling_layer=False,
                                                        attn_implementation=attn_implementation)
                except (OSError, ValueError) as e:
                    raise MissingWeightsError(_missing(checkpoint, cache_dir, e)) from None
        self.lora_config = None
        if lora is not None:
            from peft import LoraConfig, inject_adapter_in_model

            targets = [t for t in lora["target_modules"] if any(n.endswith("." + t) for n, _ in
                                                                  backbone.named_modules())]
            if not targets:
                raise ValueError(f"train.model_args.target_modules={lora['target_modules']}: no such module in the ViT "
                                 "backbone (transformers 5 names them q_proj, k_proj, v_proj, o_proj)")
            self.lora_config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                          target_modules=targets, bias="none")
            backbone = inject_adapter_in_model(self.lora_config, backbone)  # A, B drawn from the run seed's RNG
            for name, p in backbone.named_parameters():
                p.requires_grad_("lora_" in name)
        self.backbone = backbone
        self.classifier = nn.Linear(cfg.hidden_size, num_classes)

    def extra_parts(self) -> dict[str, list[str]]:
        """``lora_A`` / ``lora_B``: the adapters' weights in module order (empty without LoRA)."""
        names = [n for n, p in self.named_parameters() if p.requires_grad]
        return {"lora_A": [n for n in names if ".lora_A." in n], "lora_B": [n for n in names if ".lora_B." in n]}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, with_features: bool = False):
        if x.shape[0] == 0:  # an empty batch (Per-FedAvg's second half of a short last batch): the attention
            # reshapes cannot take 0 samples, so run one zero image and keep none of it (zero gradients, same graph)
            z, logits = self.forward(x.new_zeros(1, *x.shape[1:]), with_features=True)
            return (z[:0], logits[:0]) if with_features else logits[:0]
        if self.repeat_channels > 1:
            x = x.expand(*x.shape[:-3], self.repeat_channels, *x.shape[-2:])
        out = self.backbone(pixel_values=x, interpolate_pos_encoding=self.interpolate)
        z = out.last_hidden_state[:, 0]
        logits = self.classifier(z)
        return (z, logits) if with_features else logits


def lora_adapter_numel(lora_config: Any, module: nn.Module) -> int:
    """Adapter elements a ``LoraConfig`` implies on ``module``: ``r * (d_in + d_out)`` per
    adapted ``nn.Linear`` (A: [r, d_in], B: [d_out, r]). Used to check payload sizes."""
    r = int(lora_config.r)
    total = 0
    for name, mod in module.named_modules():
        base = getattr(mod, "base_layer", None)
        if isinstance(base, nn.Linear):
            total += r * (base.in_features + base.out_features)
    return total


__all__ = ["MissingWeightsError", "ViTClassifier", "lora_adapter_numel"]
