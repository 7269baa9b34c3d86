"""The RNA/protein panel: the models our users study, through the same check routine as PANEL.

- The ten RNA/codon masked LMs of multimolecule 0.2.2, each as a tiny 2-layer
  model with seeded random weights (multimolecule ships no weights) and the
  tokenizer arguments its checkpoint's converter writes (nmers, codon).
- AntiBERTy, the one real pretrained masked LM we can load offline: the
  ``antiberty==0.1.3`` wheel bundles its weights (25.8 M parameters).

Nine of the ten multimolecule models have BERT-style layers with ``output``
submodules, so 0.7.0 synthesizes a class per such envoy; RNA-MSM has none and
is the control that the release handles. Every multimolecule model needs
``import multimolecule`` wherever it is built *or rebuilt from its key*: its
config's model_type is registered with transformers only by that import, and
the checkpoints carry no ``auto_map``.

This module deliberately does not decide how a layer's output is read on an
nnsight line (that is :mod:`nnsight_repro.lines`) or what counts as a pass
(that is the check routine and ``tests/test_panel.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Dict

from .models import PanelModel

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
                   substitution=RNA_SUBSTITUTION, unit=1, has_output_child=True, **config_extra) -> PanelModel:
    return PanelModel(
        name, _tiny(config_class, **config_extra), f"{family}ForMaskedLM", "AutoModelForMaskedLM", "fill-mask",
        # The encoder's output, not the last layer's: for the pre-LN families
        # (RNA-FM, RiNALMo, UTR-LM, CaLM) the final LayerNorm sits after the
        # last layer, and only the encoder's output equals hidden_states[-1].
        final_hidden="model.encoder", first_layer="model.encoder.layer.0", encoder=True,
        module="multimolecule", requires=MULTIMOLECULE, tokenizer=tokenizer, text=text, substitution=substitution,
        separator="", unit=unit, has_output_child=has_output_child, seed=seed,
    )


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
        _multimolecule("ernierna", "ErnieRna", "ErnieRnaConfig", _rna_tokenizer(), seed=5),
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
