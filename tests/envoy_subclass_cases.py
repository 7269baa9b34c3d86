"""An Envoy subclass a user defines in their own script, with a hooked attribute of its own.

``DEFINITIONS`` is script text: a test puts it into a file that runs as ``__main__``, so nnsight 0.7.0
sends ``BlockEnvoy`` by value, with its eproperty, whose hook is ``requires_output``'s wrapper — the
function the 0.7.0 serializer ships with its decorator lines (``patches/PR.md`` §3b). ``ProbedLM`` puts it
on every GPT-2 block through the ``envoys`` class attribute (0.7.0's ``LanguageModel`` hands an
``envoys=`` keyword on to ``from_pretrained``). Its model key is ``LanguageModel``'s: the key names the
class that defines ``_remoteable_model_key``, so a server builds the model it already has.

Shared by ``test_upstream_repros.py`` (``remote="local"``, offline) and
``test_remote_ndif_07_envoy_subclass.py`` (``remote=True`` against the stock 0.7 stack; :func:`run_live`,
called by ``ndif_fixture.py`` while that stack is up).
"""

from pathlib import Path

DEFINITIONS = '''
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from nnsight import LanguageModel
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.hooks import hooked_output

class BlockEnvoy(Envoy):
    @hooked_output(key="output")
    def hidden(self):
        """The block's output, under a name of the user's choosing."""

class ProbedLM(LanguageModel):
    envoys = {GPT2Block: BlockEnvoy}
'''

#: The live client: the stack's GPT-2 (the path the stack deployed, under the key every 0.7 client mints
#: for it) wrapped as ``ProbedLM``, the first block's ``hidden`` read locally and with ``remote=True``.
#: One record through nnsight_repro.channel; a remote failure is part of the record.
LIVE_CLIENT = '''
import warnings
warnings.simplefilter("ignore")
import torch
from nnsight_repro.channel import send
from nnsight_repro.ndif import remote_client
''' + DEFINITIONS + '''
torch.set_num_threads(1)
s = remote_client.subject("gpt2")  # the saved GPT-2, its hub id seeded as the stack's clients seed it
model = ProbedLM(str(s.path), tokenizer=s.tokenizer, dispatch=True)
block = type(model.transformer.h[0])
record = {"envoy_class": f"{block.__module__}.{block.__qualname__}", "key": model.to_model_key()}

def hidden(**kwargs):
    # A remote trace hands its saves back by assigning the caller's locals: a plain local here.
    with model.trace(s.ids[0], **kwargs):
        value = model.transformer.h[0].hidden[0].save()
    return value

local = hidden()
try:
    remote = remote_client.remotely(lambda: hidden(remote=True))
    same_shape = remote.shape == local.shape
    record.update(shape=list(remote.shape), dtype=str(remote.dtype),
                  max_abs_diff=float((remote.float() - local).abs().max()) if same_shape else None,
                  max_abs_local=float(local.abs().max()))
except Exception as exc:
    # The server's traceback comes first in the message and the error itself last: keep both ends.
    text = str(exc)
    record.update(error=type(exc).__name__,
                  message=text if len(text) <= 6000 else text[:3000] + " ... " + text[-3000:])
record["socket_race_retries"] = remote_client.RETRIES[:]
send(record)
'''

#: The fix: nnsight 0.7.0's installed package with this series applied (0003 is the serializer fix).
FIX = "nnsight-v0.7.0-extras"


def run_live(cfg, scratch: Path) -> dict:
    """``{"release": record, "fixed": record}``: :data:`LIVE_CLIENT` run from a real ``__main__`` file by the
    ``main`` environment (stock 0.7.0), without and with :data:`FIX`, inside the running stack's
    namespace. A client that dies is recorded as ``{"crashed": why}``, so only the tests of it fail. The
    records are also left in ``scratch/records.json``, for a reader of a run."""
    import json

    from nnsight_repro import ROOT, channel, envs, overlays
    from nnsight_repro.ndif import netns

    scratch = Path(scratch)
    script = scratch / "envoy_subclass_client.py"
    script.write_text(LIVE_CLIENT)
    env = envs.ensure("main", build=False)
    fixed = overlays.with_series(env, FIX, scratch / "fixed")
    records = {}
    for build, pythonpath in [("release", str(ROOT)), ("fixed", f"{fixed}:{ROOT}")]:
        try:
            records[build] = channel.run_one(
                netns.command(cfg.netns, [str(env.python), str(script)]),
                env=env.environ({"NDIF_HOST": cfg.api_url, "PYTHONPATH": pythonpath}), cwd=scratch,
                timeout=900, what=f"the {build} 0.7.0 client with an Envoy subclass, namespace {cfg.netns}")
        except channel.ChannelError as exc:
            records[build] = {"crashed": str(exc)}
    (scratch / "records.json").write_text(json.dumps(records, indent=1))
    return records
