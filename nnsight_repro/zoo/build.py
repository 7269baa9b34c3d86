"""Building one zoo unit's torch model from its config's defaults: on meta, or tiny on the CPU.

Runs inside an environment. Nothing is read from the hub: every config is its
class's defaults, shrunk by name where a real forward must run.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Tuple

#: Config keys that count layers; a tiny model keeps two (first and last differ in some stacks).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
              "num_encoder_layers", "num_decoder_layers", "depth")
#: Width keys and their tiny values: consistent with each other (64 = 4 heads of 16).
WIDTH_KEYS = {"hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "intermediate_size": 128,
              "ffn_dim": 128, "d_ff": 128, "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
              "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
              "moe_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
              "num_experts_per_tok": 2}
TINY_LAYERS = 2
#: Values some configs leave to the checkpoint (ESM's vocab_size, pad and mask ids default to None),
#: filled in a tiny config only, with the toy vocabulary's ids (nnsight_repro.models.SPECIALS).
CHECKPOINT_KEYS = {"vocab_size": 64, "pad_token_id": 0, "mask_token_id": 4}
#: A "tiny" model above this was not shrunk by the keys above; building it could exhaust shared memory.
TINY_PARAMETER_CAP = 50_000_000


def model_class(unit: dict):
    module = importlib.import_module("multimolecule" if unit["source"] == "multimolecule" else "transformers")
    return getattr(module, unit["model_class"])


def default_config(cls):
    return cls.config_class()


def _shrink(values: Dict[str, Any]) -> Dict[str, Any]:
    """The config dict with layers and widths made tiny; lists sized per layer are cut to match."""
    shrunk = dict(values)
    old_layers = {values[k] for k in LAYER_KEYS if isinstance(values.get(k), int) and values[k] > TINY_LAYERS}
    for key in LAYER_KEYS:
        if isinstance(values.get(key), int) and values[key] > TINY_LAYERS:
            shrunk[key] = TINY_LAYERS
    for key, tiny in WIDTH_KEYS.items():
        if isinstance(values.get(key), int) and values[key] > tiny:
            shrunk[key] = tiny
    for key, value in values.items():
        if isinstance(value, list) and len(value) in old_layers:
            shrunk[key] = value[:TINY_LAYERS]  # layer_types and the like: one entry per layer
        elif isinstance(value, dict) and (key.endswith("_config") or "model_type" in value):
            shrunk[key] = _shrink(value)  # a composite model's sub-configs (text, vision, encoder, ...)
    for key, placeholder in CHECKPOINT_KEYS.items():
        if key in values and values[key] is None:
            shrunk[key] = placeholder
    return shrunk


def tiny_config(cls):
    config_class = cls.config_class
    return config_class.from_dict(_shrink(default_config(cls).to_dict()))


def on_meta(cls, config):
    import torch

    with torch.device("meta"):
        return cls(config).eval()


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_meta(unit: dict) -> Tuple[object, str, Exception | None]:
    """(model on meta, which config, why not the defaults); the defaults first, tiny if they cannot be built."""
    cls = model_class(unit)
    try:
        return on_meta(cls, default_config(cls)), "default", None
    except Exception as default_error:
        try:
            return on_meta(cls, tiny_config(cls)), "tiny", default_error
        except Exception:
            raise default_error from None


def build_tiny(unit: dict):
    """A tiny CPU model with seeded weights, refused when the shrink did not make it small."""
    import torch

    cls = model_class(unit)
    config = tiny_config(cls)
    count = parameters(on_meta(cls, config))
    if count > TINY_PARAMETER_CAP:
        raise MemoryError(f"tiny config still has {count} parameters (cap {TINY_PARAMETER_CAP})")
    torch.manual_seed(0)
    return cls(config).eval()


def forward_inputs(model) -> Dict[str, Any] | None:
    """Token inputs for a text forward, or None when the forward does not take ``input_ids``."""
    import torch

    accepted = inspect.signature(type(model).forward).parameters
    if "input_ids" not in accepted:
        return None
    vocab = getattr(model.config, "vocab_size", None) or getattr(
        getattr(model.config, "text_config", None), "vocab_size", None) or 16
    ids = torch.tensor([[2, 7, 8, 9, 10, 3]]) % max(int(vocab), 1)
    inputs = {"input_ids": ids}
    if "attention_mask" in accepted:
        inputs["attention_mask"] = torch.ones_like(ids)
    if "decoder_input_ids" in accepted and getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[:, :3]
    return inputs
