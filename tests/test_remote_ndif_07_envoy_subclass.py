"""A user's Envoy subclass with a hooked attribute of its own, read in ``trace(..., remote=True)`` on the
live 0.7 stack with a stock server: the serializer fix of ``patches/nnsight-v0.7.0-extras`` 0003 end to end.

The class (``tests/envoy_subclass_cases.py``) is defined in a real ``__main__`` file and set on every GPT-2
block, so nnsight 0.7.0 sends it by value with its eproperty, whose hook is ``requires_output``'s wrapper;
``test_upstream_repros.py`` shows the same with ``remote="local"`` (0.7.0: the NameError; fixed: equal to
the local trace). Here the request goes through ndif 0.0.1's API, queue and model actor, with stock nnsight
0.7.0 on the server (``test_remote_ndif_07.py::test_stock_server_runs_its_own_stock_nnsight`` checks which
nnsight it imports). Only the client changes: ``main`` as released, and ``main`` with the extras series
applied to a copy of its installed nnsight, run inside the stack's namespace during the session's one cold
stock stack (fixture ``ndif07_stock`` in ``tests/ndif_fixture.py``; the stack is down before these
assertions run). Each client sends its record through ``nnsight_repro.channel``.

What a live server adds to ``remote="local"``: its import whitelist while unpickling. The fix removes the
NameError, and the request then stops at ndif 0.0.1's whitelist, which lacks ``nnsight.intervention.hooks``
(the last test; ``patches/PR.md`` section 3b). A stack that cannot come up fails these tests; none skips.
"""

HOOKED_OUTPUT = "NameError: name 'hooked_output' is not defined"
WHITELIST = "ImportError: Module nnsight.intervention.hooks is not whitelisted"


def record(stock_server, build):
    found = stock_server["envoy_subclass"][build]
    assert "crashed" not in found, found["crashed"]
    return found


def test_both_clients_send_their_main_envoy_class_to_the_gpt2_the_stack_deployed(ndif07_stock):
    # The key names LanguageModel (the class defining _remoteable_model_key), not the __main__ subclass, so
    # either outcome below is the envoy class's doing, on the model the stack built at start.
    deployed = ndif07_stock["status"]["state"]["models"]["gpt2"]
    for build in ("release", "fixed"):
        found = record(ndif07_stock, build)
        assert (found["envoy_class"], found["key"]) == ("__main__.BlockEnvoy", deployed), found


def test_stock_client_envoy_subclass_from_main_fails_on_a_stock_server_with_hooked_output_name_error(ndif07_stock):
    found = record(ndif07_stock, "release")
    assert "error" in found, found
    message = found["message"]
    # The server's traceback: the request does not load in the model actor (0.7.0's loads rebuilding the
    # hook's closure from its decorator lines), and the cause is the NameError, as the server states it.
    assert "RemoteException: Traceback" in message, message
    server = message[message.index("RemoteException"):]
    assert "nnsight/schema/request.py" in server and "in deserialize" in server and "in make_function" in server, server
    assert server.strip().splitlines()[-3:] == [HOOKED_OUTPUT, "", "name 'hooked_output' is not defined"], server


def test_fixed_client_envoy_subclass_from_main_gets_past_the_name_error_to_ndif_001s_import_whitelist(ndif07_stock):
    # Measured 2026-12-01: the fixed payload no longer re-runs the hook's decorator lines, so the NameError is
    # gone, but the by-value hook belongs to nnsight.intervention.hooks, which ndif 0.0.1's deserialization
    # whitelist (src/ray/nn/security/protected_environment.py; our A3 adds three modules, not this one) does
    # not list: the server refuses the request while unpickling it. The local trace's value (within the 0.7
    # generation's atol) would need that module whitelisted on the server too (patches/PR.md section 3b).
    found = record(ndif07_stock, "fixed")
    message = found.get("message", "")
    assert "RemoteException: Traceback" in message and "hooked_output" not in message, found
    server = message[message.index("RemoteException"):]
    assert "nnsight/schema/request.py" in server and "protected_environment.py" in server, server
    assert server.strip().splitlines()[-3:] == [WHITELIST, "", WHITELIST.split(": ", 1)[1]], server
