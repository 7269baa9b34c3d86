"""Every adaptation that lets PyPI ``ndif`` 0.0.1 serve nnsight 0.7.0 clients here, in one place.

ndif 0.0.1 is the only release of the 0.7-era server on PyPI, but it speaks the nnsight 0.5 protocol;
this machine also has no GPU, no Hub and Python 3.11. Nothing here edits ndif's or nnsight's files. A
generated ``sitecustomize.py`` (first on every server process's path, see
:mod:`nnsight_repro.ndif.services`) calls :func:`install`, which only registers import hooks: each
adaptation is applied to an ndif or nnsight module right after that module is imported, in whichever
server process imports it (the API, its queue dispatcher, the controller, the model actors). The
controller is this module itself, through ndif's own ``NDIF_CONTROLLER_IMPORT_PATH`` (:func:`app`).

This is NOT the server production ran for nnsight 0.7.0 (that one was never published): it is PyPI
0.0.1 plus backports of what ndif's own unreleased 0.6 port changed, plus the fixes 0.7.0 needs on top.
It exists to run the negative control against a real server; it must never hide a failure of the patch
series itself, so nothing here touches envoys, model keys or how a request's classes are resolved.

The adaptations, each named where it is made (``[A1]`` ...):

- [A1] ``JobStatus.NNSIGHT_ERROR`` alias (every process): 0.0.1 reads it on every response.
- [A2] deserialize with 0.7.0's signature and zstd (model actor ``pre``).
- [A3] import whitelist additions while unpickling: ``nnsight.intervention.serialization``,
  ``transformers.*``, ``__future__``, and an extra's packages (``multimolecule.*``) (model actor ``pre``).
- [A4] builtins kept while unpickling (model actor ``pre``).
- [A5] nnsight's own unpickler instead of 0.0.1's 0.5-API one (``.root``), which also turns 0.0.1's
  protection of the model's modules off (model actor ``__init__``).
- [A6] execution through 0.7.0's ``tracer.execute`` instead of ``Globals.enter`` (model actor ``execute``).
- [A7] ``nnsight.intervention.tracing.globals`` whitelisted while executing (model actor ``__init__``).
- [A8] results zstd-compressed, without ndif's ``id`` field (model actor ``post``).
- [A9] a CPU model actor (no CUDA calls), swapped in through the controller module (:func:`app`).
- [A10] fake GPUs, at least four (not code: ``RAY_OVERRIDE_RESOURCES``, see :mod:`config`).
- [A11] ``ndif deploy`` asks the Hub for a model key (not code: the controller's own ``NDIF_DEPLOYMENTS``
  deploys GPT-2 at start under an explicit key, and every other key deploys on its first request).
- [A12] ``/status`` never wedged by a trigger sent before the queue dispatcher listens (dispatcher).
- [A13] an extra's packages (``--with multimolecule``) imported by the controller and the model actor before
  they build a model from its key (:func:`nnsight_repro.ndif.server_packages.import_for_models`; not by the
  other server processes, which build none).
- [A14] Ray 2.50's ``ray start`` waits for its dashboard as long as a loaded two-core machine needs (the
  ``ray`` CLI and every ``ray.init`` that starts a Ray).
- Not code either: redis-py 7.1 (8.x's 5 s socket timeout breaks the dispatcher's blocking reads),
  the undeclared imports (Prometheus/Loki/Influx clients, psutil, accelerate) in
  ``pins/ndif-server-0.7.txt``; moto as the S3 store (0.0.1 sends every result through it); ndif's
  start scripts run directly, without its CLI (whose Ctrl-C handler runs ``ray stop``, which stops
  every Ray process on the host); all of it in a private network namespace (gunicorn's 0.0.0.0 bind
  is hard-coded).

Import-time cost is the standard library only: every Python process of the server imports this
module (through ``sitecustomize``), Ray's CLI and dashboard processes included.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import time
from typing import Callable, Dict

#: module name -> what to do to it right after it is imported.
_AFTER_IMPORT: Dict[str, Callable] = {}


def _after_import(module_name: str):
    def register(fn):
        _AFTER_IMPORT[module_name] = fn
        return fn
    return register


class _ThenAdapt(importlib.abc.Loader):
    """Wraps the real loader: executes the module, then applies its adaptation."""

    def __init__(self, loader, adapt):
        self._loader, self._adapt = loader, adapt

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._adapt(module)

    def __getattr__(self, name):  # get_source, is_package, ... for inspect and tracebacks
        return getattr(self._loader, name)


class _AdaptingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        adapt = _AFTER_IMPORT.get(fullname)
        if adapt is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenAdapt(spec.loader, adapt)
                return spec
        return None


def install() -> None:
    """Register the import hooks (idempotent). Called by the generated ``sitecustomize``."""
    if not any(isinstance(finder, _AdaptingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AdaptingFinder())


# [A1] JobStatus.NNSIGHT_ERROR ------------------------------------------------------------------------
# nnsight <= 0.5.15 had JobStatus.NNSIGHT_ERROR; 0.6.0 removed it. 0.0.1's create_response (API and
# model actor) compares every non-ERROR status with it, so every request died in the API with
# "AttributeError: NNSIGHT_ERROR". The 0.6 port deleted that comparison; an alias of ERROR makes it
# unreachable (it sits in an `elif` after `== ERROR`) without touching ndif's code.

@_after_import("nnsight.schema.response")
def _alias_nnsight_error(module) -> None:
    status = module.ResponseModel.JobStatus
    if "NNSIGHT_ERROR" not in status.__dict__:
        type.__setattr__(status, "NNSIGHT_ERROR", status.ERROR)


# [A12] /status wedged by an early trigger ------------------------------------------------------------
# 0.0.1's /status sets the Redis key `status:requested` (NX, no expiry) and adds a trigger to a stream
# that the dispatcher reads from "$". A trigger sent before the dispatcher listens (it first waits
# for its Ray connection) is lost, the key is never deleted, and every later /status waits for
# an answer that never comes. The dispatcher forgets such a request as it starts (its trigger was sent
# before it listened), so the next /status triggers again; a companion task gives the key a short
# expiry, for a trigger lost in the moment between that and the dispatcher's first read.

STATUS_REQUEST_EXPIRY_S = 3


# [A14] Ray's dashboard under load ----------------------------------------------------------------------
# Ray 2.50's start_api_server polls for the dashboard's URL 200 times, 0.1 s apart: a fixed 20 s. On two
# busy cores the dashboard takes longer (measured in CI under two busy loops: 26 s from its start to its
# HTTP server), `ray start --head` then fails ("Failed to start the dashboard"), ndif 0.0.1's start.sh
# runs the controller anyway, and the controller's ray.init() starts a Ray of its own: the stack never
# comes up. (Ray 2.60, the 0.8 server's, is not adapted.) While that function runs, a poll that finds no
# URL waits DASHBOARD_POLL_EXTRA_S more, so the 200 polls span about two minutes; the loop still checks
# the dashboard's process between polls, so a dashboard that died is reported as quickly as before.

DASHBOARD_POLL_EXTRA_S = 0.5


@_after_import("ray._private.services")
def patient_dashboard_start(module) -> None:
    """[A14] Ray's ``start_api_server`` given a dashboard that is slower than its fixed polls (public: the
    tests apply it to a fake Ray)."""
    original = module.start_api_server

    def start_api_server(*args, **kwargs):
        # Imported here: this hook runs while `ray` itself is still being imported.
        from ray._private import ray_constants
        from ray.experimental import internal_kv

        get = internal_kv._internal_kv_get

        def patient_get(key, *get_args, **get_kwargs):
            value = get(key, *get_args, **get_kwargs)
            if value is None and key == ray_constants.DASHBOARD_ADDRESS:
                time.sleep(DASHBOARD_POLL_EXTRA_S)
            return value

        internal_kv._internal_kv_get = patient_get
        try:
            return original(*args, **kwargs)
        finally:
            internal_kv._internal_kv_get = get

    start_api_server.__wrapped__ = original
    module.start_api_server = start_api_server


@_after_import("src.queue.dispatcher")
def _unwedge_status(module) -> None:
    import asyncio

    dispatcher = module.Dispatcher
    original = dispatcher.dispatch_worker

    async def expire_status_requests(redis_client):
        while True:
            try:
                if await redis_client.ttl("status:requested") == -1:  # exists, without expiry
                    await redis_client.expire("status:requested", STATUS_REQUEST_EXPIRY_S)
            except Exception:  # Redis restarting: try again next round
                pass
            await asyncio.sleep(1.0)

    async def dispatch_worker(self):
        await self.redis_client.delete("status:requested")
        asyncio.create_task(expire_status_requests(self.redis_client))
        return await original(self)

    dispatcher.dispatch_worker = dispatch_worker


# The model actor: [A2]-[A9] ---------------------------------------------------------------------------

#: [A3] Modules a 0.7.0 request references while it is unpickled, beyond 0.0.1's list:
#: nnsight >= 0.6 rebuilds pickled functions with `nnsight.intervention.serialization.make_function`
#: ("Module nnsight.intervention.serialization is not whitelisted"); a request carries the model's
#: config class (`transformers.models.<arch>.configuration_<arch>`); the rebuilt functions' source
#: starts with `from __future__ import annotations`. Without `__future__` an encoder request fails on
#: the whitelist ("Module __future__ is not whitelisted") before reaching nnsight's own error.
DESERIALIZATION_ADDITIONS = [("nnsight.intervention.serialization", True), ("transformers", False),
                             ("__future__", True)]

#: [A7] 0.7.0's `_setup_interleaver()` runs `from .globals import _ensure_mounted` on every execute,
#: inside the execution sandbox: "Module nnsight.intervention.tracing.globals is not whitelisted".
EXECUTION_ADDITIONS = [("nnsight.intervention.tracing.globals", True)]


def _extra_modules():
    """[A3] An extra's packages (``--with multimolecule``), with their submodules: a request for one of its
    models carries the model's config class from that package."""
    from nnsight_repro.ndif import server_packages

    return [(module, False) for module in server_packages.imported()]


def _whitelist(base, additions):
    from src.ray.nn.security.protected_environment import WhitelistedModule

    return [*base, *(WhitelistedModule(name=name, strict=strict) for name, strict in additions)]


def _record_built(model_key: str, model) -> None:
    """One JSON line per model this actor built (:mod:`nnsight_repro.ndif.built_log`)."""
    from nnsight_repro.ndif import built_log

    built_log.record(model_key, model)


_classes = {}
_lock = threading.Lock()


def cpu_model_actor():
    """[A9] The model actor class, built on first use: it subclasses ndif's, which only the Ray half
    of the server can import (the API half has another ``src``)."""
    with _lock:
        if "actor" not in _classes:
            _classes["actor"] = _define_cpu_model_actor()
        return _classes["actor"]


def _define_cpu_model_actor():
    # Imported here, not at the top: only the Ray half of the server has this `src` (and Ray).
    import ray
    from nnsight.intervention import serialization

    from src.ray.deployments.modeling.base import BaseModelDeployment
    from src.ray.nn.security import protected_environment as sandbox
    from src.ray.nn.security.protected_objects import ProtectedCustomCloudUnpickler

    # [A5] 0.0.1's protect_model() (called in every actor's __init__) replaces nnsight's unpickler with
    # one written against the 0.5 unpickler API ("'ProtectedCustomCloudUnpickler' object has no
    # attribute 'root'"); it existed to hand requests protected copies of the model's modules. Its base
    # class is nnsight's own unpickler, which is put back. That turns the protection off, and it has to
    # be: 0.7.0 adds hooks through module._forward_hooks, of which a protected module hands out a
    # deep copy, so no hook fires ("Execution complete but '...output.i0' was not provided").
    nnsight_unpickler = ProtectedCustomCloudUnpickler.__bases__[0]

    # Each method that differs from ndif's is a function of this module (below), run in the actor's
    # process: the class only binds them, so each adaptation reads on its own.
    @ray.remote(num_cpus=1, num_gpus=0, max_restarts=-1)
    class CPUModelActor(BaseModelDeployment):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            serialization.CustomCloudUnpickler = nnsight_unpickler  # [A5]
            # [A7] ndif's execution sandbox (builtins restricted, as stock), with 0.7.0's extra import.
            self.execution_protector = sandbox.Protector(
                _whitelist(sandbox.WHITELISTED_MODULES, EXECUTION_ADDITIONS), builtins=True)

        def load_from_disk(self):
            return _load_on_the_cpu(self)

        # [A9] Parking a model (HOT -> WARM) moves weights between GPU and CPU with CUDA calls; on a CPU
        # there is nothing to move. The flag keeps ndif's meaning (a parked actor refuses requests).
        async def to_cache(self):
            await self.cancel()
            self.cached = True

        def from_cache(self, cuda_devices: str):
            self.cached = False

        def pre(self):
            return _deserialized_request(self)

        def execute(self, request):
            return _execute(self, request)

        def post(self, result):
            _upload_saves(self, result)

    return CPUModelActor


def _load_on_the_cpu(actor):
    """[A9] The stock load calls torch.cuda.synchronize() before and after loading ("Torch not compiled
    with CUDA enabled"). Same load through the same nnsight call, without those."""
    from nnsight.modeling.mixins import RemoteableMixin

    from nnsight_repro.ndif import server_packages
    from src.ray.deployments.modeling.util import load_with_cache_deletion_retry

    server_packages.import_for_models(actor.model_key)  # [A13]
    started = time.time()
    model = load_with_cache_deletion_retry(lambda: RemoteableMixin.from_model_key(
        actor.model_key, device_map="auto", dispatch=actor.dispatch, torch_dtype=actor.dtype,
        **actor.extra_kwargs))
    actor.logger.info(f"Loaded {actor.model_key} on the CPU in {time.time() - started:.1f} s")
    _record_built(actor.model_key, model)
    return model


def _deserialized_request(actor):
    """The actor's ``pre``: its request, deserialized as nnsight 0.7.0 sends it.

    [A2] 0.0.1 calls RequestModel.deserialize(model, bytes, zlib) (0.5: zlib); 0.7.0 takes
    (bytes, persistent_objects, compress) and compresses with zstd (TypeError: "a bytes-like
    object is required, not 'LanguageModel'"). 0.0.1 reads the old `nnsight-zlib` header, absent
    from 0.7.0 requests, and so defaults it to true, which is what a 0.7.0 client's default
    `nnsight-compress: True` means.
    [A3] its deserialization whitelist plus 0.7.0's modules.
    [A4] 0.0.1 deserializes under Protector(..., builtins=True), which removes `compile` from the
    real builtins; 0.7.0's make_function calls compile() ("name 'compile' is not defined"). The
    0.6 port deserializes with builtins intact, as here.
    """
    import ray
    from nnsight.schema.request import RequestModel

    from src.ray.nn.security import protected_environment as sandbox
    from src.schema import BackendResponseModel

    raw = actor.request.request
    if isinstance(raw, ray.ObjectRef):
        raw = ray.get(raw)
    with sandbox.Protector(_whitelist(sandbox.WHITELISTED_MODULES_DESERIALIZATION,
                                      DESERIALIZATION_ADDITIONS + _extra_modules())):
        request = RequestModel.deserialize(raw, actor.model._remoteable_persistent_objects(),
                                           bool(actor.request.zlib))
    actor.respond(status=BackendResponseModel.JobStatus.RUNNING, description="Your job has started running.")
    return request


def _execute(actor, request):
    """[A6] 0.0.1's RemoteExecutionBackend calls Globals.enter()/Globals.stack, gone in 0.7.0
    ("type object 'Globals' has no attribute 'enter'"; the 0.6 port still calls them). 0.7.0's
    tracer runs the request and returns exactly the saved values itself."""
    from nnsight.intervention.tracing.util import wrap_exception

    from src.ray.nn.ops import StdoutRedirect

    actor.execution_ident = threading.current_thread().ident
    started = time.time()
    with StdoutRedirect(actor.log):
        with actor.execution_protector:
            try:
                saves = request.tracer.execute(request.interventions)
            except Exception as exc:
                raise wrap_exception(exc, request.tracer.info) from None
    return saves, 0, time.time() - started


def _upload_saves(actor, result) -> None:
    """[A8] 0.0.1 uploads torch.save(BackendResultModel(id=..., **saves).model_dump()) as is; a 0.7.0
    client zstd-decompresses what it downloads ("zstd decompress error: Unknown frame descriptor")
    and would push ndif's `id` into the caller's variables. The saves alone, compressed, through
    ndif's own upload and presigned URL. (0.0.1's metrics, Influx-only, are left out.)"""
    import io

    import torch
    import zstandard

    from src.schema import BackendResponseModel, BackendResultModel

    saves = result[0]
    buffer = io.BytesIO()
    torch.save(dict(saves), buffer)
    payload = buffer.getvalue()
    if actor.request.zlib:
        payload = zstandard.ZstdCompressor(level=6).compress(payload)
    stored = BackendResultModel(id=actor.request.id)
    stored._save(io.BytesIO(payload), "application/octet-stream")
    actor.respond(status=BackendResponseModel.JobStatus.COMPLETED, description="Your job has been completed.",
                  data=(stored.url(), len(payload)))


def app(**kwargs) -> None:
    """[A9] The controller (``NDIF_CONTROLLER_IMPORT_PATH`` names this module; ndif's ray/start.sh calls
    ``app()``). 0.0.1 has no setting for the model actor class: its deployments create
    ``src.ray.deployments.controller.cluster.deployment.ModelActor``, the stock actor that calls CUDA.
    This is ndif's own ``app()`` with a controller class that rebinds that name to the CPU actor in its
    own process (where deployments are created) before starting."""
    import ray
    from src.ray.deployments.controller import controller as ndif_controller

    @ray.remote(num_cpus=1, num_gpus=0, max_restarts=-1, resources={"head": 1})
    class ControllerActor(ndif_controller._ControllerActor):
        def __init__(self, *args, **kwargs):
            from src.ray.deployments.controller.cluster import deployment

            from nnsight_repro.ndif import server_packages

            # [A13] Its evaluator builds every model it deploys on the meta device from the key, to size it.
            server_packages.import_for_models()
            deployment.ModelActor = cpu_model_actor()
            super().__init__(*args, **kwargs)

    ndif_controller.ControllerActor = ControllerActor
    ndif_controller.app(**kwargs)

