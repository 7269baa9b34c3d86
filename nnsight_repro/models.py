"""The model panel: ``PANEL``, the tiny toy-vocabulary models the suite is parametrized over, and
``RNA_PANEL``, the models our users study (multimolecule's RNA/codon masked LMs, tiny, and AntiBERTy
with its real weights); :func:`extended` is both, :func:`get` one by name.

Each entry says how to build the torch model (random weights from a seed), the
Auto class a remote server must rebuild it with, what input to feed, which
token to substitute for the embedding-shift check, and which module holds the
final hidden states. Nothing here touches the Hugging Face hub; models are
saved under the project cache because path-based wrappers need a directory.

What differs between nnsight lines (how a layer's output is read, which
wrapper to use) lives in :mod:`nnsight_repro.lines`, and what counts as a pass in
the check routine and ``tests/test_panel.py``, not here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

from . import fsutil
from .settings import cache_dir

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
    # model families (RNA_PANEL) set them.
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
    #: What the model's forward raises when it is loaded in bfloat16, as NDIF loads models by default;
    #: None: it runs (``tests/test_upstream_repros.py`` loads every panel model so and checks this).
    fails_in_bfloat16: str | None = None
    #: The fix series (``patches/<name>``) under which it runs in bfloat16 (an extra applies it:
    #: ``ndif.server_packages.Extra.series``).
    bfloat16_fix: str | None = None

    def config_for(self, layers: int | None = None):
        return self.config(self.layers if layers is None else layers)

    @property
    def output_field(self) -> str:
        """The field of the model's output a trace reads last: a base model (``AutoModel``) has no head,
        so no logits; its output ends in the final hidden state."""
        return "last_hidden_state" if self.automodel == "AutoModel" else "logits"


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
    """Every model the check routine knows: PANEL plus the RNA/protein panel (RNA_PANEL, below).

    The RNA/protein panel is kept out of PANEL, which the pytest suite is
    parametrized over: its models need multimolecule (a ~10 s import) and real
    weights, so they run through the check routine, once per environment.
    """
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
    try:
        with fsutil.staged_directory(target) as staging:
            if entry.pretrained is not None:
                # Link the packaged weights instead of copying 100 MB: the wrapper only needs one directory
                # holding both the model and its tokenizer.
                for item in entry.pretrained().iterdir():
                    os.symlink(item, staging / item.name)
            else:
                build_model(entry, layers).save_pretrained(staging)
            tokenizer_for(entry).save_pretrained(staging)
    except OSError:
        # No lock around the build: a process that built the same model first wins the rename, harmlessly.
        if not (target / "config.json").is_file():
            raise
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


# The RNA/protein panel: the models our users study, through the same check routine as PANEL -------
#
# - The ten RNA/codon masked LMs of multimolecule 0.2.2, each as a tiny 2-layer
#   model with seeded random weights (multimolecule ships no weights) and the
#   tokenizer arguments its checkpoint's converter writes (nmers, codon).
# - AntiBERTy, the one real pretrained masked LM we can load offline: the
#   ``antiberty==0.1.3`` wheel bundles its weights (25.8 M parameters).
#
# Nine of the ten multimolecule models have BERT-style layers with ``output``
# submodules, so 0.7.0 synthesizes a class per such envoy; RNA-MSM has none and
# is the control that the release handles. Every multimolecule model needs
# ``import multimolecule`` wherever it is built *or rebuilt from its key*: its
# config's model_type is registered with transformers only by that import, and
# the checkpoints carry no ``auto_map``.

MULTIMOLECULE = ("multimolecule",)

#: 40 nt; the substitution is the C at 0-based 20 -> A (the survey's sequence, so its numbers can be compared).
RNA = "ACGUAGCUAGCUAGGCUAACGUUAGCAUCGAUCGGAUCCA"
RNA_SUBSTITUTION = (20, "A")
#: 16 codons of a coding sequence (the start of GFP); codon 5 (GAA, Glu) -> AAA (Lys), a missense change.
CDS = "ATGGCTAGCAAAGGTGAAGAACTGTTCACCGGTGTTGTTCCGATCCTG"
CDS_SUBSTITUTION = (5, "AAA")
#: The start of a human antibody heavy chain (VH3 framework 1 + CDR1), residue by residue.
HEAVY_CHAIN = "E V Q L V E S G G G L V Q P G G S L R L S C A A S G F T F S S Y A M S W V R Q A P G K G L E W V S"
#: S at 0-based 30 (in CDR1, GFTFSSYAMS) -> Y.
HEAVY_SUBSTITUTION = (30, "Y")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)


def _tiny(config_class: str, **extra):
    """A config builder: the family's config at the panel's tiny size (layers are a parameter)."""
    def build(layers: int):
        import multimolecule

        return getattr(multimolecule, config_class)(**{**TINY, "num_hidden_layers": layers, **extra})

    return build


def _rna_tokenizer(**kwargs):
    def build():
        from multimolecule import RnaTokenizer

        return RnaTokenizer(**kwargs)

    return build


def _dna_tokenizer(**kwargs):
    def build():
        from multimolecule import DnaTokenizer

        return DnaTokenizer(**kwargs)

    return build


def antiberty_dir() -> Path:
    """``<antiberty package>/trained_models``, found without importing antiberty (its runner breaks on transformers 5)."""
    spec = importlib.util.find_spec("antiberty")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("antiberty==0.1.3 is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0]) / "trained_models"


def _antiberty_weights() -> Path:
    return antiberty_dir() / "AntiBERTy_md_smooth"


def _antiberty_tokenizer():
    from transformers import BertTokenizer

    # Not BertTokenizer(vocab_file=...): on transformers 5 that silently yields a
    # 5-token vocabulary, every residue becomes [UNK] and every shift is zero.
    return BertTokenizer.from_pretrained(str(antiberty_dir()), do_lower_case=False)


def _multimolecule(name: str, family: str, config_class: str, tokenizer, *, seed: int, text=RNA,
                   substitution=RNA_SUBSTITUTION, unit=1, has_output_child=True, fails_in_bfloat16=None,
                   bfloat16_fix=None, **config_extra) -> PanelModel:
    return PanelModel(
        name, _tiny(config_class, **config_extra), f"{family}ForMaskedLM", "AutoModelForMaskedLM", "fill-mask",
        # The encoder's output, not the last layer's: for the pre-LN families
        # (RNA-FM, RiNALMo, UTR-LM, CaLM) the final LayerNorm sits after the
        # last layer, and only the encoder's output equals hidden_states[-1].
        final_hidden="model.encoder", first_layer="model.encoder.layer.0", encoder=True,
        module="multimolecule", requires=MULTIMOLECULE, tokenizer=tokenizer, text=text, substitution=substitution,
        separator="", unit=unit, has_output_child=has_output_child, seed=seed,
        fails_in_bfloat16=fails_in_bfloat16, bfloat16_fix=bfloat16_fix,
    )


#: What multimolecule 0.2.2's ERNIE-RNA raises when loaded in bfloat16 (``from_pretrained(dtype=torch.bfloat16)``).
BF16_MIXED_DTYPE = "RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float"

# Each multimolecule model has its own seed: RNABERT and SpliceBERT share the tiny shape and the
# tokenizer, so with one seed they came out weight for weight identical and their numbers could
# not tell them apart.
RNA_PANEL: Dict[str, PanelModel] = {
    m.name: m
    for m in [
        _multimolecule("rnabert", "RnaBert", "RnaBertConfig", _rna_tokenizer(), seed=1),
        _multimolecule("splicebert", "SpliceBert", "SpliceBertConfig", _rna_tokenizer(), seed=2),
        # The ncRNA RNA-FM checkpoint (the mRNA one is codon=True).
        _multimolecule("rnafm", "RnaFm", "RnaFmConfig", _rna_tokenizer(), vocab_size=28, seed=3),
        _multimolecule("rinalmo", "RiNALMo", "RiNALMoConfig", _rna_tokenizer(), seed=4),
        # Its sinusoidal position table (multimolecule's SinusoidalEmbedding, a non-persistent buffer) is
        # built float32 whatever dtype the model is loaded in; added to bfloat16 word embeddings it makes
        # the sum float32, which the bfloat16 LayerNorm after it refuses on the CPU. The fix, for upstream:
        # patches/multimolecule-v0.2.2/0002-build-the-sinusoidal-position-table-in-the-default-d.patch
        # (tests/test_upstream_repros.py runs it); the panel serves multimolecule 0.2.2 as released, and
        # with the fix on a server with the multimolecule-patched extra.
        _multimolecule("ernierna", "ErnieRna", "ErnieRnaConfig", _rna_tokenizer(), seed=5,
                       fails_in_bfloat16=BF16_MIXED_DTYPE, bfloat16_fix="multimolecule-v0.2.2"),
        _multimolecule("utrlm", "UtrLm", "UtrLmConfig", _rna_tokenizer(), seed=6),
        # utrbert-3mer: overlapping 3-mers, so one nucleotide change moves three tokens.
        _multimolecule("utrbert", "UtrBert", "UtrBertConfig", _rna_tokenizer(nmers=3), nmers=3, seed=7),
        _multimolecule("rnaernie", "RnaErnie", "RnaErnieConfig", _rna_tokenizer(), seed=8),
        # Axial attention over an MSA; its layers have no ``output`` child: the control.
        _multimolecule("rnamsm", "RnaMsm", "RnaMsmConfig", _rna_tokenizer(), has_output_child=False, seed=9),
        # Codon tokens over DNA; one codon substituted.
        _multimolecule("calm", "CaLm", "CaLmConfig", _dna_tokenizer(codon=True), text=CDS,
                       substitution=CDS_SUBSTITUTION, unit=3, seed=10),
        PanelModel("antiberty", lambda layers: None, "BertForMaskedLM", "AutoModelForMaskedLM", "fill-mask",
                   final_hidden="bert.encoder.layer.-1", first_layer="bert.encoder.layer.0", encoder=True,
                   tokenizer=_antiberty_tokenizer, text=HEAVY_CHAIN, substitution=HEAVY_SUBSTITUTION,
                   pretrained=_antiberty_weights, layers=8),
    ]
}

#: The multimolecule models with ``output`` submodules: the ones 0.7.0 cannot send (all but RNA-MSM).
THE_NINE = [name for name, m in RNA_PANEL.items() if m.module == "multimolecule" and m.has_output_child]
