"""A decorated helper inside ``trace(..., remote=True)``, against the live 0.8 stack (ndif 0.1.2).

nnsight 0.8.1 ships a helper the trace body calls by value, from its source, and read that source
through ``inspect``, which follows ``__wrapped__``: the server rebuilt a ``functools.wraps`` wrapper as
the function it wraps. ``remote="local"`` cannot show it (it runs the original frame), so this goes
through the real API, queue and model actor of ``ndif_stack`` (``tests/ndif_fixture.py``).

The client is nnsight 0.8.1 (``upstream-0.8``), run inside the stack's namespace from a real
``__main__`` file, as released and with ``patches/nnsight-v0.8.1-extras`` applied to a copy of its
nnsight (the fix is in ``dumps``). The server is always the released 0.8.1: a fixed client's payload
is what it must load. The client writes its record to a file this test names.
"""

import pytest

from nnsight_repro import ROOT, channel, envs, overlays
from nnsight_repro.ndif import netns

CLIENT = """
import functools, sys, warnings
warnings.simplefilter("ignore")
import torch
from nnsight_repro.channel import send
from nnsight_repro.ndif import remote_client

SCALE = 3

def doubled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 2
    return wrapper

@doubled
def first_layer(model):
    out = model.bert.encoder.layer[0].output
    return out[0] if isinstance(out, tuple) else out

@torch.no_grad()
def scaled(model):
    out = model.bert.encoder.layer[0].output
    return (out[0] if isinstance(out, tuple) else out) * SCALE

# One thread, as remote_client runs, and a tolerance: the server's kernels may differ in the last bits
# (measured up to 6e-8 on this layer); a dropped decorator changes the value by a factor of two.
torch.set_num_threads(1)

def close(a, b):
    return bool(a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5))

s = remote_client.subject("bert-mlm")
record = {"key": s.model.to_model_key()}
for name, helper in [("doubled", first_layer), ("no_grad", scaled)]:
    with s.model.trace(s.ids[0]):
        local = helper(s.model).save()
    try:
        with s.model.trace(s.ids[0], remote=True):
            remote = helper(s.model).save()
        record[name] = {"equals_local": close(remote, local),
                        "equals_undecorated": close(remote * 2, local) if name == "doubled" else None}
    except Exception as exc:
        text = str(exc)
        record[name] = {"error": type(exc).__name__, "message": text[-600:]}
send(record)
"""


@pytest.fixture(scope="module")
def clients(ndif_stack, tmp_path_factory):
    """{"release": record, "fixed": record}: the same client script, without and with the fix."""
    scratch = tmp_path_factory.mktemp("decorated-remote")
    script = scratch / "decorated_client.py"
    script.write_text(CLIENT)
    env = envs.ensure("upstream-0.8", build=False)
    fixed = overlays.with_series(env, "nnsight-v0.8.1-extras", scratch / "fixed")
    records = {}
    for build, pythonpath in [("release", str(ROOT)), ("fixed", f"{fixed}:{ROOT}")]:
        records[build] = channel.run_one(
            netns.command(ndif_stack.cfg.netns, [str(env.python), str(script)]),
            env=env.environ({"NDIF_HOST": ndif_stack.cfg.api_url, "PYTHONPATH": pythonpath}), cwd=scratch,
            timeout=900, what=f"the {build} 0.8.1 client in the stack's namespace")
    return records


def test_released_client_runs_a_wraps_decorated_helper_undecorated_on_the_server(clients):
    assert clients["release"]["doubled"] == {"equals_local": False, "equals_undecorated": True}, clients


def test_released_client_a_no_grad_helper_fails_on_the_server_without_its_globals(clients):
    record = clients["release"]["no_grad"]
    assert "NameError: name 'SCALE' is not defined" in record.get("message", ""), record


def test_fixed_client_a_wraps_decorated_helper_gives_the_local_answer_remotely(clients):
    assert clients["fixed"]["doubled"] == {"equals_local": True, "equals_undecorated": False}, clients


def test_fixed_client_a_no_grad_helper_gives_the_local_answer_remotely(clients):
    assert clients["fixed"]["no_grad"] == {"equals_local": True, "equals_undecorated": None}, clients
