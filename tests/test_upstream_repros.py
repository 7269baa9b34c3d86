"""Minimal offline repros of upstream incompatibilities found while probing.

Each repro asserts what upstream does *today*, so it turns red the day
upstream changes it (then update the repro, and drop the fix we carry). Where
we carry a small fix (``patches/nnsight-v0.7.0-extras``,
``patches/nnsight-v0.8.1-extras``, ``patches/multimolecule-v0.2.2``), a second
test runs the same repro with the fix applied to a copy of the environment's
installed nnsight (or multimolecule) and asserts the bug is gone, so each repro
fails where the bug is and passes where fixed.

Every repro runs in a child process of the environment it is about (``main``
is nnsight 0.7.0 as released, ``upstream-0.8`` is 0.8.1), from a script file:
0.7.0's serializer reads lambda source through ``inspect``, which needs a
file. A different transformers comes from an overlay (``nnsight_repro.overlays``)
put first on ``PYTHONPATH``; nothing else in the environment changes.

The serializer repros write their record to a file the parent names (argv),
never to stdout, which a library may also write to.

multimolecule 0.2.2's ERNIE-RNA forward on transformers 5.24 runs for real
(the panel's tiny ERNIE-RNA, in ``main``, which has multimolecule), next to
the transformers 5.24 change it trips on, shown on a bare output class shaped
like ``ErnieRnaModelOutputWithPastAndCrossAttentions``; so do its UTR-LM
forward without an attention mask and every panel model loaded in bfloat16.
"""

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from decorated_cases import DEFINITIONS
from envoy_subclass_cases import DEFINITIONS as ENVOY_DEFINITIONS
from nnsight_repro import ROOT, channel, envs, models, overlays, series

EXTRAS_07 = "nnsight-v0.7.0-extras"
EXTRAS_08 = "nnsight-v0.8.1-extras"
MULTIMOLECULE_FIX = models.extended()["ernierna"].bfloat16_fix

#: The exact messages upstream gives today.
NO_TOKENIZER = ("Exception: Impossible to guess which tokenizer to use. Please provide a PreTrainedTokenizer "
                "class or a path/identifier to a pretrained tokenizer.")
NO_TOKENIZE_ERROR = "AttributeError: module 'tokenize' has no attribute 'TokenizeError'"

# nnsight 0.8.1 builds a TransformersModel from a path on meta (dispatch=False),
# the first thing a server does with a model key.
META_BUILD = """
import sys, warnings
warnings.simplefilter("ignore")
from importlib.metadata import version
import transformers
from nnsight.modeling.transformers import TransformersModel
record = {"nnsight": version("nnsight"), "transformers": transformers.__version__}
try:
    record["built"] = type(TransformersModel(sys.argv[1], task="fill-mask")._module).__name__
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# What ndif 0.1.2's evaluator calls (ndif/services/ray/deployments/controller/
# cluster/evaluator.py, lines 155 and 161 of the wheel).
NDIF_012_CALLS = """
from importlib.metadata import version
from nnsight.modeling.mixins.remotable import Remotable
KEY = ('nnsight.modeling.transformers.TransformersModel:'
       '{"repo_id": "org/tiny-bert", "revision": null, "task": "fill-mask"}')
record = {"nnsight": version("nnsight")}
for name, call in [
    ("describe_checkpoint", lambda: Remotable.describe_checkpoint(KEY, "float32", trust_remote_code=False)),
    ("max_tp_size", lambda: Remotable.max_tp_size(KEY, trust_remote_code=False)),
]:
    try:
        call()
        record[name] = "accepted"
    except Exception as exc:
        record[name] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# nnsight 0.7.0: a lambda that starts on a continuation line, reached by a
# remote="local" trace. inspect gives its source as "           lambda ...]".
CONTINUATION_LAMBDA = """
import warnings
warnings.simplefilter("ignore")
import torch
from nnsight import LanguageModel
from nnsight_repro import models
model = LanguageModel(models.build_model(models.get("gpt2")), tokenizer=models.build_tokenizer(False))
ids = models.token_ids(model.tokenizer, models.SENTENCE)
readers = [lambda block: block.output[0],
           lambda block: block.output[0] * 2]
with model.trace(ids):
    local = readers[1](model.transformer.h[0]).save()
record = {}
try:
    with model.trace(ids, remote="local"):
        simulated = readers[1](model.transformer.h[0]).save()
    record["equals_local"] = bool(torch.equal(local, simulated))
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# nnsight 0.7.0: session(remote="local"), with RemoteBackend's constructor
# replaced by one that records the key and refuses, so nothing reaches a network.
SESSION_REMOTE_LOCAL = """
import warnings
warnings.simplefilter("ignore")
import torch
from nnsight import LanguageModel
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.modeling import huggingface
from nnsight_repro import models
built = []
def refuse(self, key, *args, **kwargs):
    built.append(key)
    raise RuntimeError("RemoteBackend constructed")
RemoteBackend.__init__ = refuse
model = LanguageModel(models.build_model(models.get("gpt2")), tokenizer=models.build_tokenizer(False))
huggingface.ID_CACHE[model.repo_id] = "nnsight-repro/gpt2"  # minting a key must not ask the Hub
ids = models.token_ids(model.tokenizer, models.SENTENCE)
with model.trace(ids):
    local = model.transformer.h[0].output[0].save()
record = {}
try:
    with model.session(remote="local"):
        with model.trace(ids):
            simulated = model.transformer.h[0].output[0].save()
    record["equals_local"] = bool(torch.equal(local, simulated))
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
record["remote_backends"] = built
from nnsight_repro.channel import send
send(record)
"""

# transformers 5.24 renames a `past_key_values=` argument to `cache` in the
# __init__ of every ModelOutput dataclass, also one that declares
# `past_key_values` itself, as multimolecule 0.2.2's ERNIE-RNA output does
# (and builds it with past_key_values=..., modeling_ernierna.py:722).
OUTPUT_WITH_PAST = """
from dataclasses import dataclass
import torch, transformers
from transformers.utils import ModelOutput
@dataclass
class EncoderOutputWithPast(ModelOutput):
    last_hidden_state: torch.FloatTensor = None
    past_key_values: tuple | None = None
record = {"transformers": transformers.__version__}
try:
    EncoderOutputWithPast(last_hidden_state=torch.zeros(1), past_key_values=None)
    record["built"] = True
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# multimolecule 0.2.2's ERNIE-RNA masked LM (the panel's tiny one), one forward.
ERNIE_RNA_FORWARD = """
import warnings
warnings.simplefilter("ignore")
from importlib.metadata import version
import torch, transformers
from nnsight_repro import models
entry = models.get("ernierna")
model, tokenizer = models.build_model(entry), models.tokenizer_for(entry)
record = {"transformers": transformers.__version__, "multimolecule": version("multimolecule")}
try:
    with torch.no_grad():
        record["logits"] = list(model(models.token_ids(tokenizer, entry.text)).logits.shape)
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# multimolecule 0.2.2's UTR-LM masked LM (the panel's tiny one), one forward with the tokenizer's
# input_ids and no attention mask (what 0.7's LanguageModel hands the model for an input_ids tensor), and
# one with the all-ones mask the tokenizer would have given; no nnsight.
UTR_LM_FORWARD = """
import warnings
warnings.simplefilter("ignore")
from importlib.metadata import version
import torch
from nnsight_repro import models
entry = models.get("utrlm")
model, tokenizer = models.build_model(entry), models.tokenizer_for(entry)
ids = models.token_ids(tokenizer, entry.text)
record = {"multimolecule": version("multimolecule"), "token_dropout": model.config.token_dropout}
for name, mask in (("without_mask", None), ("with_mask", torch.ones_like(ids))):
    try:
        with torch.no_grad():
            record[name] = list(model(ids, attention_mask=mask).logits.shape)
    except Exception as exc:
        record[name] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# Every panel model loaded from its saved directory in bfloat16, as NDIF loads a model by default
# (from_pretrained(dtype=torch.bfloat16)), and one forward; ERNIE-RNA also loaded in float32 and then
# cast with .to(torch.bfloat16), and the dtype of its sinusoidal position table after a bfloat16 load.
BF16_FORWARD = """
import warnings
warnings.simplefilter("ignore")
from importlib.metadata import version
import torch, transformers
from nnsight_repro import models
record = {"multimolecule": version("multimolecule"), "forward": {}}

def forward(model, entry):
    tokenizer = models.tokenizer_for(entry)
    ids = models.token_ids(tokenizer, entry.text)
    mask = torch.ones_like(ids) if entry.tokenizer is not None else None
    with torch.no_grad():
        return str(getattr(model(ids, attention_mask=mask), entry.output_field).dtype)

for name, entry in models.extended().items():
    models.import_requirements(entry)
    auto = getattr(transformers, entry.automodel)
    try:
        model = auto.from_pretrained(str(models.saved_model(name)), dtype=torch.bfloat16).eval()
        if name == "ernierna":
            record["ernierna_position_table"] = str(model.model.embeddings.position_embeddings.weight.dtype)
        record["forward"][name] = forward(model, entry)
    except Exception as exc:
        record["forward"][name] = f"{type(exc).__name__}: {exc}"
entry = models.get("ernierna")
cast = transformers.AutoModelForMaskedLM.from_pretrained(str(models.saved_model("ernierna"))).to(torch.bfloat16)
try:
    record["ernierna_cast"] = forward(cast.eval(), entry)
except Exception as exc:
    record["ernierna_cast"] = f"{type(exc).__name__}: {exc}"
from nnsight_repro.channel import send
send(record)
"""

# multimolecule's ERNIE-RNA (the panel's tiny one) loaded in bfloat16, and loaded in float32 and then cast
# with .to(torch.bfloat16): the same weights, one forward each; which SinusoidalEmbedding was imported.
ERNIE_RNA_BF16_VS_CAST = """
import warnings
warnings.simplefilter("ignore")
import torch, transformers
from multimolecule.modules.embeddings import sinusoidal
from nnsight_repro import models
entry = models.get("ernierna")
path = str(models.saved_model("ernierna"))
ids = models.token_ids(models.tokenizer_for(entry), entry.text)
loaded = transformers.AutoModelForMaskedLM.from_pretrained(path, dtype=torch.bfloat16).eval()
cast = transformers.AutoModelForMaskedLM.from_pretrained(path).to(torch.bfloat16).eval()
weights, cast_weights = loaded.state_dict(), cast.state_dict()
record = {"sinusoidal": sinusoidal.__file__,
          "same_weights": weights.keys() == cast_weights.keys()
                          and all(torch.equal(weights[k], cast_weights[k]) for k in weights)}
try:
    with torch.no_grad():
        a = loaded(ids, attention_mask=torch.ones_like(ids)).logits
        b = cast(ids, attention_mask=torch.ones_like(ids)).logits
    record.update(dtypes=[str(a.dtype), str(b.dtype)], equal=bool(torch.equal(a, b)))
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
# The table a bfloat16 load gets (materialized by the forward above), against the float32 table rounded once.
table = loaded.model.embeddings.position_embeddings.weight
exact = sinusoidal.SinusoidalEmbedding.get_embedding(*table.shape, padding_idx=loaded.config.pad_token_id,
                                                     dtype=torch.float32)
record["table_is_float32_rounded_once"] = bool(torch.equal(table, exact.to(table.dtype)))
from nnsight_repro.channel import send
send(record)
"""


# Both lines: decorated functions defined in a real __main__ file, each sent
# through nnsight's serializer and called. On 0.7.0 also Envoy.output, whose
# eproperty hook is requires_output's functools.wraps wrapper around the stub.
DECORATED_ROUND_TRIP = """
from nnsight_repro.channel import send
import json, sys, warnings
warnings.simplefilter("ignore")
from nnsight.intervention import serialization
""" + DEFINITIONS + """
cases = {name: CASES[name] for name in ("stacked", "wrapped_lambda", "no_grad", "decorated_closure")}
record = {}
for name, (fn, args) in cases.items():
    try:
        record[name] = repr(serialization.loads(serialization.dumps(fn))(*args))
    except Exception as exc:
        record[name] = f"{type(exc).__name__}: {exc}"
    record[name + "_original"] = repr(fn(*args))
try:
    from nnsight.intervention.envoy import Envoy
    hook = serialization.loads(serialization.dumps(Envoy.output))._hook
    # requires_output's hook registers the forward hook; the stub it wraps does not.
    record["envoy_output"] = "hook" if "output_hook" in hook.__code__.co_names else "stub"
except Exception as exc:
    record["envoy_output"] = f"{type(exc).__name__}: {exc}"
send(record)
"""


# nnsight 0.7.0: an Envoy subclass defined in a user's __main__, with its own
# hooked attribute (tests/envoy_subclass_cases.py), in a remote="local" trace.
# It goes by value with its eproperty, whose hook is requires_output's wrapper.
# The same class with remote=True on the live stack: test_remote_ndif_07_envoy_subclass.py.
ENVOY_SUBCLASS_070 = """
from nnsight_repro.channel import send
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from nnsight_repro import models
""" + ENVOY_DEFINITIONS + """
model = ProbedLM(str(models.saved_model("gpt2")), tokenizer=models.build_tokenizer(False), dispatch=True)
ids = models.token_ids(model.tokenizer, models.SENTENCE)
record = {"envoy_class": type(model.transformer.h[0]).__name__}
with model.trace(ids):
    local = model.transformer.h[0].hidden[0].save()
try:
    with model.trace(ids, remote="local"):
        simulated = model.transformer.h[0].hidden[0].save()
    record["equals_local"] = bool(torch.equal(local, simulated))
except Exception as exc:
    record["error"] = f"{type(exc).__name__}: {exc}"
send(record)
"""


@dataclass(frozen=True)
class Repro:
    env: str
    script: str
    overlay: str | None = None  # a pinned package put first on PYTHONPATH
    fix: str | None = None  # a fix series applied to a copy of the installed nnsight
    fix_of: str = "nnsight"  # the installed package ``fix`` applies to
    args: tuple = ()


def bert_dir() -> str:
    # Built by this (patched) interpreter; transformers is 5.22.2 in every env, so it loads anywhere.
    return str(models.saved_model("bert-mlm"))


REPROS = {
    "meta_081_tf523": Repro("upstream-0.8", META_BUILD, overlay="transformers==5.23.0", args=("BERT",)),
    "meta_081_tf5222": Repro("upstream-0.8", META_BUILD, args=("BERT",)),
    "meta_081_tf523_fixed": Repro("upstream-0.8", META_BUILD, overlay="transformers==5.23.0", fix=EXTRAS_08,
                                  args=("BERT",)),
    "ndif_012_calls": Repro("upstream-0.8", NDIF_012_CALLS),
    "lambda_070": Repro("main", CONTINUATION_LAMBDA),
    "lambda_070_fixed": Repro("main", CONTINUATION_LAMBDA, fix=EXTRAS_07),
    "session_070": Repro("main", SESSION_REMOTE_LOCAL),
    "session_070_fixed": Repro("main", SESSION_REMOTE_LOCAL, fix=EXTRAS_07),
    "output_with_past_tf524": Repro("upstream-0.8", OUTPUT_WITH_PAST, overlay="transformers==5.24.0"),
    "ernierna_tf524": Repro("main", ERNIE_RNA_FORWARD, overlay="transformers==5.24.0"),
    "ernierna_tf5222": Repro("main", ERNIE_RNA_FORWARD),
    "utrlm_mask": Repro("main", UTR_LM_FORWARD),
    "bf16": Repro("main", BF16_FORWARD),
    "bf16_fixed": Repro("main", BF16_FORWARD, fix=MULTIMOLECULE_FIX, fix_of="multimolecule"),
    "ernierna_bf16_vs_cast_fixed": Repro("main", ERNIE_RNA_BF16_VS_CAST, fix=MULTIMOLECULE_FIX,
                                         fix_of="multimolecule"),
    "decorated_081": Repro("upstream-0.8", DECORATED_ROUND_TRIP),
    "decorated_081_fixed": Repro("upstream-0.8", DECORATED_ROUND_TRIP, fix=EXTRAS_08),
    "decorated_070": Repro("main", DECORATED_ROUND_TRIP),
    "decorated_070_fixed": Repro("main", DECORATED_ROUND_TRIP, fix=EXTRAS_07),
    "envoy_subclass_070": Repro("main", ENVOY_SUBCLASS_070),
    "envoy_subclass_070_fixed": Repro("main", ENVOY_SUBCLASS_070, fix=EXTRAS_07),
}


def run(name: str, repro: Repro, scratch: Path, bert: str) -> dict:
    env = envs.ensure(repro.env, build=False)
    path = [str(ROOT)]
    if repro.overlay:
        path.insert(0, str(overlays.ensure(repro.overlay, env.python)))
    if repro.fix:
        fixed = scratch / f"{name}-fixed"
        path.insert(0, str(overlays.with_series(env, repro.fix, fixed) if repro.fix_of == "nnsight"
                           else overlays.with_package_series(env, repro.fix_of, repro.fix, fixed)))
    script = scratch / f"{name}.py"
    script.write_text(repro.script)
    args = [bert if a == "BERT" else a for a in repro.args]
    try:
        return env.run_one([str(script), *args], doing=f"the {name} repro", cwd=scratch, timeout=600,
                           extra_env={"PYTHONPATH": ":".join(path)})
    except channel.ChannelError as exc:
        return {"crashed": exc.returncode, "error": str(exc)}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """Every repro's record, run three at a time (each is mostly interpreter start-up and imports)."""
    scratch = tmp_path_factory.mktemp("repros")
    bert = bert_dir()
    # Build each overlay once, before the runs that share it race to.
    for repro in REPROS.values():
        if repro.overlay:
            overlays.ensure(repro.overlay, envs.ensure(repro.env, build=False).python)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, name, repro, scratch, bert) for name, repro in REPROS.items()}
        records = {name: future.result() for name, future in futures.items()}
    return records.__getitem__


# (i) nnsight 0.8.1 with transformers >= 5.23 ------------------------------------

def test_081_on_transformers_523_cannot_build_a_model_from_a_path_on_meta(outcome):
    record = outcome("meta_081_tf523")
    assert (record.get("nnsight"), record.get("transformers")) == ("0.8.1", "5.23.0"), record
    assert record.get("error") == NO_TOKENIZER, record


def test_081_on_transformers_5222_builds_a_model_from_a_path_on_meta(outcome):
    record = outcome("meta_081_tf5222")
    assert record.get("transformers") == "5.22.2" and record.get("built") == "BertForMaskedLM", record


def test_081_with_our_fix_builds_a_model_from_a_path_on_transformers_523(outcome):
    record = outcome("meta_081_tf523_fixed")
    assert record.get("transformers") == "5.23.0" and record.get("built") == "BertForMaskedLM", record


# (ii) ndif 0.1.2 against nnsight 0.8.1 -------------------------------------------

def test_081_describe_checkpoint_rejects_the_trust_remote_code_ndif_012_passes(outcome):
    record = outcome("ndif_012_calls")
    assert record.get("describe_checkpoint") == (
        "TypeError: Remotable.describe_checkpoint() got an unexpected keyword argument 'trust_remote_code'"), record


def test_081_max_tp_size_rejects_the_trust_remote_code_ndif_012_passes(outcome):
    record = outcome("ndif_012_calls")
    assert record.get("max_tp_size") == (
        "TypeError: Remotable.max_tp_size() got an unexpected keyword argument 'trust_remote_code'"), record


# (iii) nnsight 0.7.0: tokenize.TokenizeError ---------------------------------------

def test_070_remote_local_trace_fails_on_a_lambda_from_a_continuation_line(outcome):
    assert outcome("lambda_070").get("error") == NO_TOKENIZE_ERROR, outcome("lambda_070")


def test_070_with_our_fix_runs_a_lambda_from_a_continuation_line_remotely(outcome):
    assert outcome("lambda_070_fixed") == {"equals_local": True}


# (iv) nnsight 0.7.0: session(remote="local") ---------------------------------------

def test_070_session_remote_local_builds_a_real_remote_backend(outcome):
    record = outcome("session_070")
    assert record.get("error") == "RuntimeError: RemoteBackend constructed", record
    assert record.get("remote_backends") == [
        'nnsight.modeling.language.LanguageModel:{"repo_id": "nnsight-repro/gpt2", "revision": null}'], record


def test_070_with_our_fix_session_remote_local_is_simulated(outcome):
    assert outcome("session_070_fixed") == {"equals_local": True, "remote_backends": []}


# (v) transformers 5.24 and output classes that declare past_key_values --------------

def test_transformers_524_rejects_past_key_values_on_an_output_class_that_declares_it(outcome):
    record = outcome("output_with_past_tf524")
    assert record.get("transformers") == "5.24.0", record
    assert record.get("error", "").endswith("__init__() got an unexpected keyword argument 'cache'"), record


def test_transformers_5222_accepts_past_key_values_on_an_output_class_that_declares_it():
    # The control, in this interpreter (transformers 5.22.2): the same class builds.
    import torch
    import transformers
    from transformers.utils import ModelOutput

    @dataclass
    class EncoderOutputWithPast(ModelOutput):
        last_hidden_state: torch.FloatTensor = None
        past_key_values: tuple | None = None

    assert transformers.__version__ == "5.22.2"
    assert EncoderOutputWithPast(last_hidden_state=torch.zeros(1), past_key_values=None).past_key_values is None


def test_multimolecule_022_ernie_rna_forward_breaks_on_transformers_524(outcome):
    record = outcome("ernierna_tf524")
    assert record.get("transformers") == "5.24.0" and record.get("multimolecule") == "0.2.2", record
    assert record.get("error") == ("TypeError: ErnieRnaModelOutputWithPastAndCrossAttentions.__init__() got an "
                                   "unexpected keyword argument 'cache'"), record


def test_multimolecule_022_ernie_rna_forward_runs_on_transformers_5222(outcome):
    record = outcome("ernierna_tf5222")
    assert record.get("transformers") == "5.22.2" and "error" not in record, record
    assert record["logits"][0] == 1 and record["logits"][1] > 40, record  # 40 nt + special tokens


# multimolecule 0.2.2's UTR-LM without an attention mask: its embeddings' token dropout divides by
# attention_mask.sum(-1) with no fallback (transformers' ESM, which it follows, uses the sequence length),
# and UtrLmModel hands the embeddings the caller's mask, not the one it derives from the pad token. So a
# 0.7 client's trace of an input_ids tensor fails locally (checks.Subject.inputs passes the mask).

def test_multimolecule_022_utr_lm_forward_without_an_attention_mask_fails(outcome):
    record = outcome("utrlm_mask")
    assert record.get("multimolecule") == "0.2.2" and record.get("token_dropout") is True, record
    assert record.get("without_mask") == "AttributeError: 'NoneType' object has no attribute 'sum'", record


def test_multimolecule_022_utr_lm_forward_with_an_attention_mask_runs(outcome):
    record = outcome("utrlm_mask")
    assert record.get("with_mask", [None])[0] == 1 and record["with_mask"][1] > 40, record  # 40 nt + specials


# multimolecule 0.2.2's ERNIE-RNA in bfloat16: its SinusoidalEmbedding builds its table as a non-persistent
# buffer with an explicit float32 default, whatever dtype the model is loaded in (a load builds modules in
# the requested dtype and fills only the checkpoint's tensors); bfloat16 word embeddings plus that float32
# table make a float32 sum, which the bfloat16 LayerNorm after it refuses on the CPU. NDIF loads models in
# bfloat16 by default, so the 0.7 stack (ndif 0.0.1) shows it live: PanelModel.fails_in_bfloat16 declares it.

def test_multimolecule_022_ernie_rna_fails_when_loaded_in_bfloat16(outcome):
    record = outcome("bf16")
    assert record.get("multimolecule") == "0.2.2", record
    assert record["forward"]["ernierna"] == models.BF16_MIXED_DTYPE, record


def test_multimolecule_022_ernie_rna_keeps_its_position_table_float32_when_loaded_in_bfloat16(outcome):
    assert outcome("bf16").get("ernierna_position_table") == "torch.float32"


def test_multimolecule_022_ernie_rna_runs_when_cast_to_bfloat16_after_loading(outcome):
    # .to() casts buffers too, and the table is rebuilt in its buffer's dtype: only the load path fails.
    assert outcome("bf16").get("ernierna_cast") == "torch.bfloat16"


def test_the_panel_models_that_fail_in_bfloat16_are_exactly_those_declared(outcome):
    found = outcome("bf16")["forward"]
    assert set(found) == set(models.extended()), found
    assert {name: error for name, error in found.items() if not error.startswith("torch.")} == \
        {name: entry.fails_in_bfloat16 for name, entry in models.extended().items() if entry.fails_in_bfloat16}
    assert all(found[name] == "torch.bfloat16" for name, entry in models.extended().items()
               if not entry.fails_in_bfloat16), found


# The same with our fix (patches/multimolecule-v0.2.2: the table takes the default dtype in effect when the
# module is built) applied to a copy of the installed multimolecule 0.2.2.

def test_multimolecule_022_with_our_fix_ernie_rna_runs_when_loaded_in_bfloat16(outcome):
    assert outcome("bf16_fixed")["forward"]["ernierna"] == "torch.bfloat16", outcome("bf16_fixed")


def test_multimolecule_022_with_our_fix_ernie_rna_builds_its_position_table_in_bfloat16(outcome):
    assert outcome("bf16_fixed").get("ernierna_position_table") == "torch.bfloat16"


def test_multimolecule_022_with_our_fix_ernie_rna_still_runs_when_cast_to_bfloat16_after_loading(outcome):
    assert outcome("bf16_fixed").get("ernierna_cast") == "torch.bfloat16"


def test_multimolecule_022_with_our_fix_ernie_rna_loaded_in_bfloat16_equals_the_float32_load_cast(outcome):
    record = outcome("ernierna_bf16_vs_cast_fixed")
    assert "-fixed/multimolecule/" in record.get("sinusoidal", ""), record  # the patched copy, not the env's
    assert record.get("same_weights") is True, record
    assert record.get("dtypes") == ["torch.bfloat16", "torch.bfloat16"] and record.get("equal") is True, record


def test_multimolecule_022_with_our_fix_ernie_rna_bfloat16_table_is_the_float32_table_rounded_once(outcome):
    # Computed in bfloat16 instead, positions above 256 collide and entries err by up to 2.0 (patches/PR.md §4).
    assert outcome("ernierna_bf16_vs_cast_fixed").get("table_is_float32_rounded_once") is True


def test_multimolecule_022_with_our_fix_every_other_panel_model_still_runs_in_bfloat16(outcome):
    found = outcome("bf16_fixed")["forward"]
    assert set(found) == set(models.extended()), found
    assert {name: dtype for name, dtype in found.items() if name != "ernierna"} == \
        {name: "torch.bfloat16" for name in models.extended() if name != "ernierna"}, found


# (vi) the serializer rebuilds a functools.wraps wrapper from the wrapped function ---

def test_081_stacked_wraps_decorators_come_back_as_the_undecorated_function(outcome):
    record = outcome("decorated_081")
    assert (record.get("stacked_original"), record.get("stacked")) == ("'A(B(1))'", "1"), record


def test_081_wraps_around_a_lambda_comes_back_as_the_lambda(outcome):
    record = outcome("decorated_081")
    assert (record.get("wrapped_lambda_original"), record.get("wrapped_lambda")) == ("'L(2)'", "2"), record


def test_081_no_grad_function_loses_its_module_globals(outcome):
    # Its globals are looked up in torch/utils/_contextlib.py, the wrapper's module.
    assert outcome("decorated_081").get("no_grad") == "NameError: name 'SCALE' is not defined"


def test_081_with_our_fix_every_decorated_function_returns_what_the_original_returns(outcome):
    record = outcome("decorated_081_fixed")
    names = ["stacked", "wrapped_lambda", "no_grad", "decorated_closure"]
    assert [record.get(n) for n in names] == [record.get(n + "_original") for n in names], record
    assert "crashed" not in record, record


def test_070_envoy_output_does_not_load(outcome):
    assert outcome("decorated_070").get("envoy_output") == "NameError: name 'hooked_output' is not defined"


def test_070_a_wraps_decorated_function_does_not_load(outcome):
    # The closure factory re-runs the wrapped function's decorator lines.
    assert outcome("decorated_070").get("stacked") == "NameError: name 'tag' is not defined"


def test_070_a_decorated_closure_without_wraps_does_not_load(outcome):
    assert outcome("decorated_070").get("decorated_closure") == "NameError: name 'register' is not defined"


def test_070_with_our_fix_envoy_output_loads_as_its_hook(outcome):
    assert outcome("decorated_070_fixed").get("envoy_output") == "hook", outcome("decorated_070_fixed")


def test_070_with_our_fix_every_decorated_function_returns_what_the_original_returns(outcome):
    record = outcome("decorated_070_fixed")
    names = ["stacked", "wrapped_lambda", "no_grad", "decorated_closure"]
    assert [record.get(n) for n in names] == [record.get(n + "_original") for n in names], record
    assert "crashed" not in record, record


def test_070_remote_local_fails_on_an_envoy_subclass_from_main_with_its_own_hooked_attribute(outcome):
    record = outcome("envoy_subclass_070")
    assert record == {"envoy_class": "BlockEnvoy", "error": "NameError: name 'hooked_output' is not defined"}, record


def test_070_with_our_fix_an_envoy_subclass_from_main_runs_with_remote_local(outcome):
    record = outcome("envoy_subclass_070_fixed")
    assert record == {"envoy_class": "BlockEnvoy", "equals_local": True}, record


# The fix series -------------------------------------------------------------------

@pytest.mark.parametrize("name, env", [(EXTRAS_07, "main"), (EXTRAS_08, "upstream-0.8")])
def test_fix_series_git_ams_cleanly_onto_the_released_source(name, env):
    series.am_onto_tree(name, envs.ensure(env, build=False).source)


def test_multimolecule_fix_series_base_check_passes_on_the_released_022_files():
    # Its base is a git commit whose sinusoidal.py the 0.2.2 wheel ships byte for byte (patches/.../series).
    site = overlays.site_packages(envs.ensure("main", build=False), "multimolecule")
    series.check_tree(MULTIMOLECULE_FIX, site, only="multimolecule")


def test_multimolecule_fix_series_applies_to_a_copy_of_the_released_022_package(tmp_path):
    fixed = overlays.with_package_series(envs.ensure("main", build=False), "multimolecule", MULTIMOLECULE_FIX,
                                         tmp_path / "fixed")
    assert "dtype: torch.dtype | None = None" in (fixed / "multimolecule/modules/embeddings/sinusoidal.py").read_text()
    assert sorted(p.name for p in fixed.iterdir()) == ["multimolecule"]  # the series' tests/ part is left out


def test_multimolecule_fix_series_refuses_a_copy_it_was_already_applied_to(tmp_path):
    env = envs.ensure("main", build=False)
    fixed = overlays.with_package_series(env, "multimolecule", MULTIMOLECULE_FIX, tmp_path / "fixed")
    with pytest.raises(series.SeriesError, match="sinusoidal.py is blob"):
        series.apply(MULTIMOLECULE_FIX, fixed, only="multimolecule")


def test_070_fixes_apply_on_top_of_the_main_series(tmp_path):
    tree = tmp_path / "nnsight"
    shutil.copytree(envs.ensure("main", build=False).source, tree, ignore=shutil.ignore_patterns("build"))
    series.apply("nnsight-v0.7.0", tree)
    # series.apply checks each file against the release, and both series add to CI's list in .github/
    # (in places far enough apart that git applies either on top of the other); src and tests are checked.
    for folder in ("src", "tests"):
        series.apply(EXTRAS_07, tree, only=folder)
