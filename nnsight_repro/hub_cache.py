"""A stand-in for ``openai-community/gpt2`` on the Hugging Face hub, fabricated offline in the hub's own cache
layout, so nnsight's tests that load it by that id (``tests/test_negative_control.py``, ``UPSTREAM_OFFLINE``)
run in this sandbox with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at :func:`hub_cache`.

Owns: what the checkpoint holds (GPT-2's published config, weights drawn from a seed, a byte-level BPE tokenizer
trained here on :data:`CORPUS`), where it lives in the project cache (one folder per :func:`key`, so a change of
any of those inputs, or of :data:`VERSION` for a change of how it is written, builds a new one beside the old),
and building it once, whole or not at all. The weights come from the building environment's torch (``main`` by
default) and are not in the key: every environment then reads the same files, which is what a comparison of
``main`` with ``patched`` needs. A build left behind by an older key stays (a checkout of that age may still use
it); deleting ``<cache>/hf-hub`` reclaims the space (about 500 MB a build).

Does not own: the real GPT-2. The architecture and shapes are the published ones, the numbers are not: a test
that compares generations or predictions with the real model's (" Paris", " New York City") fails here, on
every build alike. Nor which tests use it, or how an environment runs a child (:mod:`nnsight_repro.envs`,
:mod:`nnsight_repro.channel`).

The host side (:func:`ensure`) is stdlib only; the build needs torch, transformers and tokenizers, so it runs
in a project environment as ``python -m nnsight_repro.hub_cache``, which sends the cache folder back.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from . import fsutil, settings
from .settings import cache_dir

#: Bump when the way the checkpoint is written changes (its inputs below are part of :func:`key` already).
VERSION = 1

REPO_ID = "openai-community/gpt2"

#: The published ``config.json`` of openai-community/gpt2, value for value.
CONFIG = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}

#: GPT-2's one special token: beginning, end and unknown at once, the last id of the vocabulary.
ENDOFTEXT = "<|endoftext|>"

SEED = 0

#: What the tokenizer's merges are learned from. Written here rather than read from a file of the machine, so
#: every checkout trains the same tokenizer. It holds the prompts nnsight's tests use, so those come out as a
#: few tokens each rather than a byte each; some tests need two prompts of equal length, as GPT-2's tokenizer
#: makes them (test_lm.py moves the embeddings of "Madison Square Garden is located in the city of" into
#: "_ _ _ _ _ _ _ _ _": 9 tokens each when " _" is one token).
CORPUS = """\
The Eiffel Tower is located in the city of Paris, in France.
Madison Square Garden is located in the city of New York, in the United States.
Hello, world. Hello again; the world says hello back.
The quick brown fox jumps over the lazy dog, and the dog does not mind.
A language model reads a sequence of tokens and predicts the token that comes next.
Each layer of the transformer adds what its attention and its multilayer perceptron compute to the residual stream.
The hidden states of the last layer go through a final layer norm and the language model head to give the logits.
Researchers patch activations from one prompt into another to find where a fact is stored.
It was a bright cold day in April, and the clocks were striking thirteen.
Call me by my name, said the stranger, and sat down by the fire to wait for the rain to stop.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text as often as words do.
She sells sea shells by the sea shore; the shells she sells are sea shells, I am sure.
To be, or not to be, that is the question the play asks again and again.
The city of London lies on the river Thames, and the city of Rome on the river Tiber.
Hi! Goodbye, world. A B C D E F G are the letters a child learns first, one test input at a time.
Fill in each blank with a word: _ _ _ _ _ _ _ _ _; then count the fish in the pond.
"""

#: Where the tokenizer's learned vocabulary ends, the rest up to the special token is filled with tokens no merge
#: can produce, so every id the model can emit (it has ``vocab_size`` logits) decodes to something.
FILLER = "<|unused{}|>"


def key() -> str:
    """Digest of everything the checkpoint is made from; it names the folder, so another input is another build."""
    blob = json.dumps([VERSION, REPO_ID, CONFIG, ENDOFTEXT, SEED, CORPUS, FILLER], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def commit() -> str:
    """The snapshot's revision: 40 hex digits like a git commit, derived from :func:`key`."""
    return hashlib.sha1(key().encode()).hexdigest()


def hub_cache() -> Path:
    """The folder to name in ``HF_HUB_CACHE``: it holds ``models--openai-community--gpt2/`` and nothing else."""
    return cache_dir() / "hf-hub" / f"gpt2-{key()[:16]}"


def repo_folder(cache: Path) -> Path:
    return cache / ("models--" + REPO_ID.replace("/", "--"))


def built(cache: Path) -> bool:
    # The folder only appears by a rename of a finished build, so its ref is enough to tell.
    return (repo_folder(cache) / "refs" / "main").is_file()


def environ(env_name: str = "main") -> dict:
    """The variables that make transformers find the checkpoint offline, built first if missing."""
    return {"HF_HUB_CACHE": str(ensure(env_name)), **settings.HF_OFFLINE}


def ensure(env_name: str = "main") -> Path:
    """:func:`hub_cache`, built in the environment ``env_name`` if it is not there yet (seconds, most of them
    drawing and writing GPT-2's 124 M weights)."""
    cache = hub_cache()
    if built(cache):
        return cache
    from . import envs

    env = envs.ensure(env_name, build=False)
    found = env.run_one(["-m", "nnsight_repro.hub_cache"], doing=f"fabricating {REPO_ID} in a hub cache",
                        timeout=1200)
    if Path(found["hub_cache"]) != cache or not built(cache):
        raise RuntimeError(f"The {env_name!r} environment says it built {found['hub_cache']}, but {cache} is not "
                           f"there: the child and this process disagree on the project cache. Fix: run both with "
                           f"the same {settings.variable('CACHE')}.")
    return cache


# The build (inside an environment) ---------------------------------------------------------------------------

def build() -> Path:
    """Builds :func:`hub_cache` if missing: into a staging folder beside it, renamed into place when whole, under
    a lock so that two builders wait for each other instead of doing it twice."""
    cache = hub_cache()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with fsutil.locked(cache.parent / f".{cache.name}.lock"):
        if built(cache):
            return cache
        with fsutil.staged_directory(cache) as staging:
            repo = repo_folder(staging)
            snapshot = repo / "snapshots" / commit()
            snapshot.mkdir(parents=True)
            write_model(snapshot)
            write_tokenizer(snapshot)
            fsutil.write_text(repo / "refs" / "main", commit())
    return cache


def write_model(folder: Path) -> None:
    """Seeded random weights of GPT-2's shape (safetensors), its published config, and the generation config
    transformers derives from it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config.from_dict(CONFIG)).eval()
    model.save_pretrained(folder)
    # save_pretrained writes the config with every default spelled out and this transformers' version; the
    # hub's file is the published one, so that is what a loader reads here too.
    fsutil.write_text(folder / "config.json", json.dumps(CONFIG, indent=2) + "\n")


def train_vocabulary():
    """``(vocab, merges)`` of a byte-level BPE learned from :data:`CORPUS`, padded as GPT-2's is laid out: learned
    tokens first, then :data:`FILLER` tokens, then :data:`ENDOFTEXT` as the last id, ``vocab_size - 1``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    size, special = CONFIG["vocab_size"], CONFIG["eos_token_id"]
    if not (special == CONFIG["bos_token_id"] == size - 1):
        raise ValueError(f"CONFIG: GPT-2's {ENDOFTEXT} is bos, eos and the last id; here bos "
                         f"{CONFIG['bos_token_id']}, eos {special}, vocab_size {size}. Fix CONFIG.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    learned = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(learned["vocab"].items(), key=lambda item: item[1]))
    if list(vocab.values()) != list(range(len(vocab))):
        raise ValueError("the trained vocabulary's ids are not 0..n-1; tokenizers changed how it numbers them")
    for index in range(len(vocab), special):
        vocab[FILLER.format(index)] = index
    vocab[ENDOFTEXT] = special
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in learned["merges"]]
    return vocab, merges


def write_tokenizer(folder: Path) -> None:
    """GPT-2's tokenizer class over :func:`train_vocabulary`, saved as the hub's files are (``tokenizer.json``,
    ``tokenizer_config.json``), so ``AutoTokenizer.from_pretrained(REPO_ID)`` finds it by the config's model type."""
    from transformers import GPT2Tokenizer

    vocab, merges = train_vocabulary()
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, unk_token=ENDOFTEXT, bos_token=ENDOFTEXT,
                              eos_token=ENDOFTEXT, model_max_length=CONFIG["n_positions"])
    found = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    if found != CONFIG["eos_token_id"] or len(tokenizer) != CONFIG["vocab_size"]:
        raise ValueError(f"the tokenizer has {ENDOFTEXT} at {found} and {len(tokenizer)} tokens; GPT-2's config "
                         f"wants {CONFIG['eos_token_id']} and {CONFIG['vocab_size']}")
    tokenizer.save_pretrained(folder)


def main() -> None:
    from . import channel

    cache = build()
    if channel.connected():
        channel.send({"hub_cache": str(cache)})
    else:  # run by hand: for a person to read
        print(cache)


if __name__ == "__main__":
    sys.exit(main())
