"""The model panel: tiny, offline, deterministic models built from configs.

Each entry says how to build the torch model (random weights from a seed), the
Auto class a remote server must rebuild it with, what input to feed, which
token to substitute for the embedding-shift check, and which module holds the
final hidden states. Nothing here touches the Hugging Face hub; models are
saved under the project cache because path-based wrappers need a directory.

What differs between nnsight lines (how a layer's output is read, which
wrapper to use) lives in :mod:`nnsight_repro.lines`, not here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

from .paths import cache_dir

#: Words of the toy vocabulary; sentences are made only of these.
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "big", "small", "red", "blue"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB_SIZE = 32

SENTENCE = "the big cat sat on the red mat"
#: (word index in SENTENCE, replacement word) for the embedding-shift check.
SUBSTITUTION = (2, "dog")


@dataclass(frozen=True)
class PanelModel:
    name: str
    #: Builds the transformers config; layers are a parameter for benchmarks.
    config: Callable[[int], object]
    #: transformers class name of the model built from the config.
    model_class: str
    #: Auto class a server must use to rebuild it (0.7 line: ``automodel``).
    automodel: str
    #: Pipeline task naming the same class (0.8 line: ``task``).
    task: str
    #: Dotted path from the model root to the module whose output is the
    #: final hidden state (for pre-LN stacks this is the encoder, not a layer).
    final_hidden: str
    #: Dotted path of the first layer, whose ``output`` child collides (or not).
    first_layer: str
    encoder: bool
    seed: int = 0
    layers: int = 2
    # The fields below default to the toy-vocabulary models above, so their
    # entries (and every number they produce) are unchanged. Panels of real
    # model families (nnsight_repro.panel_rna) set them.
    #: Module that defines ``model_class`` (and registers its Auto classes on import).
    module: str = "transformers"
    #: Packages a process must import before it can build, load or rebuild this model.
    requires: tuple = ()
    #: Builds the checkpoint's real tokenizer; None: the toy word-level one.
    tokenizer: Callable[[], object] | None = None
    #: The input text and ``(index, replacement)`` of the substituted unit (word, nucleotide, codon, residue).
    text: str = SENTENCE
    substitution: tuple = SUBSTITUTION
    #: How units are joined into the text the tokenizer gets ("" for raw sequences).
    separator: str = " "
    #: Length in characters of one substitution unit (3 for codons).
    unit: int = 1
    #: Directory of real pretrained weights; None: seeded random weights from ``config``.
    pretrained: Callable[[], Path] | None = None
    #: Whether a layer has a submodule named ``output`` (what 0.7.0 trips over).
    has_output_child: bool = True

    def config_for(self, layers: int | None = None):
        return self.config(self.layers if layers is None else layers)


def _bert_config(layers: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
    )


def _esm_config(layers: int):
    from transformers import EsmConfig

    return EsmConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, mask_token_id=4,
        position_embedding_type="absolute",
    )


def _gpt2_config(layers: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=32, n_layer=layers, n_head=2, n_positions=64,
        bos_token_id=2, eos_token_id=3, pad_token_id=0,
    )


PANEL: Dict[str, PanelModel] = {
    m.name: m
    for m in [
        PanelModel("bert-mlm", _bert_config, "BertForMaskedLM", "AutoModelForMaskedLM", "fill-mask",
                   final_hidden="bert.encoder.layer.-1", first_layer="bert.encoder.layer.0", encoder=True),
        PanelModel("bert-base", _bert_config, "BertModel", "AutoModel", "feature-extraction",
                   final_hidden="encoder.layer.-1", first_layer="encoder.layer.0", encoder=True),
        PanelModel("esm-mlm", _esm_config, "EsmForMaskedLM", "AutoModelForMaskedLM", "fill-mask",
                   final_hidden="esm.encoder", first_layer="esm.encoder.layer.0", encoder=True),
        PanelModel("gpt2", _gpt2_config, "GPT2LMHeadModel", "AutoModelForCausalLM", "text-generation",
                   final_hidden="transformer.h.-1", first_layer="transformer.h.0", encoder=False,
                   has_output_child=False),
    ]
}


def extended() -> Dict[str, PanelModel]:
    """Every model the check routine knows: PANEL plus the RNA/protein panel (nnsight_repro.panel_rna).

    The RNA/protein panel is kept out of PANEL, which the pytest suite is
    parametrized over: its models need multimolecule (a ~10 s import) and real
    weights, so they run through the check routine, once per environment.
    """
    from .panel_rna import RNA_PANEL

    return {**PANEL, **RNA_PANEL}


def get(name: str) -> PanelModel:
    known = extended()
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"Unknown model {name!r}; the panel has: {', '.join(known)}.") from None


def import_requirements(entry: PanelModel) -> None:
    """Import what registers this model's classes (importlib caches: each package loads once per process)."""
    import importlib

    for package in entry.requires:
        importlib.import_module(package)


def build_tokenizer(encoder: bool):
    """A word-level fast tokenizer over WORDS; encoders get [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", bos_token="[CLS]", eos_token="[SEP]",
    )


def build_model(entry: PanelModel, layers: int | None = None):
    """The torch model with seeded random weights, in eval mode."""
    import importlib

    import torch

    import_requirements(entry)
    if entry.pretrained is not None:
        import transformers

        return getattr(transformers, entry.automodel).from_pretrained(str(entry.pretrained())).eval()
    torch.manual_seed(entry.seed)
    model = getattr(importlib.import_module(entry.module), entry.model_class)(entry.config_for(layers))
    return model.eval()


def tokenizer_for(entry: PanelModel):
    import_requirements(entry)
    return entry.tokenizer() if entry.tokenizer is not None else build_tokenizer(entry.encoder)


def _fingerprint(entry: PanelModel, layers: int) -> str:
    import transformers

    if entry.pretrained is not None:
        # Real weights: the fingerprint is the package directory's files, by name and size.
        source = entry.pretrained()
        config = sorted((p.name, p.stat().st_size) for p in source.iterdir())
    else:
        import_requirements(entry)
        config = entry.config_for(layers).to_json_string(use_diff=False)
    vocabulary = SPECIALS + WORDS if entry.tokenizer is None else [entry.name, entry.module]
    blob = json.dumps([entry.name, entry.model_class, entry.seed, config, transformers.__version__, vocabulary])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def saved_model(name: str, layers: int | None = None) -> Path:
    """A directory with the model and its tokenizer, built once and reused.

    Written to a temporary directory and renamed into place, so a concurrent
    or interrupted build never leaves a half-written model behind.
    """
    entry = get(name)
    layers = entry.layers if layers is None else layers
    target = cache_dir() / "models" / f"{name}-{layers}l-{_fingerprint(entry, layers)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if entry.pretrained is not None:
            # Link the packaged weights instead of copying 100 MB: the wrapper only needs one directory
            # holding both the model and its tokenizer.
            for item in entry.pretrained().iterdir():
                os.symlink(item, staging / item.name)
        else:
            build_model(entry, layers).save_pretrained(staging)
        tokenizer_for(entry).save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def token_ids(tokenizer, text: str):
    return tokenizer(text, return_tensors="pt")["input_ids"]


def texts_for(entry: PanelModel) -> List[str]:
    """The entry's reference text and the text with its one unit substituted."""
    if entry.separator:
        units = entry.text.split(entry.separator)
    else:
        units = [entry.text[i:i + entry.unit] for i in range(0, len(entry.text), entry.unit)]
    position, replacement = entry.substitution
    if units[position] == replacement:
        raise ValueError(f"{entry.name}: substituting {replacement!r} at {position} changes nothing")
    changed = list(units)
    changed[position] = replacement
    return [entry.separator.join(units), entry.separator.join(changed)]
