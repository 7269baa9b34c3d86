"""Every adaptation that lets PyPI ``ndif`` 0.1.2 serve here, in one place.

This machine has no GPU, no Hub and Python 3.11; ndif 0.1.2 pairs with nnsight 0.8.x but was released
against an nnsight newer than any on PyPI. Nothing here edits ndif's or nnsight's files: each adaptation
goes through an extension point ndif offers, and each names the incompatibility it bridges.

Selected by the stack's environment (:mod:`nnsight_repro.ndif.config`):

- ``RAY_OVERRIDE_RESOURCES`` (not code): ndif's controller only manages Ray nodes that advertise a
  ``GPU`` resource and ``cuda_memory_bytes``; ndif's ``resources.py`` reports ``cuda_memory_bytes: 0``
  on CPU torch, so the node would be skipped and no model ever placed. We advertise fake GPUs.
- ``NDIF_DEFAULT_MODEL_ACTOR_CLASS`` -> :class:`CPUModelActor`.
- ``NDIF_CONTROLLER_IMPORT_PATH`` -> :class:`ControllerActor`.
- An extra's packages (``--with multimolecule``): imported by the controller and the model actor before
  they build a model from its key (:func:`nnsight_repro.ndif.server_packages.import_for_models`).
- Offline Hub (not code): models are deployed from local paths with an explicit ``model_key``
  (see :mod:`nnsight_repro.ndif.deploy`), because ``ndif deploy`` would otherwise canonicalize the id
  through ``HfApi().model_info()``.
- No RustFS (not code): ndif's default object store is a binary fetched from GitHub, unreachable here;
  ``moto[server]`` from PyPI serves the same S3 API.

This module runs only inside the server environment (the controller and model actors import it in their
Ray workers); nothing else in the project imports it.
"""

from __future__ import annotations

import logging
import time

import ray

from ndif.services.ray.deployments.controller.controller import _ControllerActor
from ndif.services.ray.deployments.modeling.base import BaseModelDeployment
from nnsight.modeling.huggingface import HuggingFaceModel
from nnsight.modeling.mixins.remotable import Remotable

from . import built_log, server_packages

logger = logging.getLogger("nnsight_repro.ndif")


# Incompatibility 1: no GPU --------------------------------------------------------------------------
# ndif's stock ModelActor pins a CUDA device before loading (set_default_gpu -> torch.cuda.set_device,
# on CPU torch: "module 'torch._C' has no attribute '_cuda_setDevice'"), synchronizes CUDA after
# loading and after every request, and verifies the weights landed on the assigned GPUs. This actor
# loads the same model through the same nnsight call on the CPU and skips only those CUDA steps;
# running a request (BaseModelDeployment.run) is ndif's own code, untouched.

@ray.remote(num_cpus=1, max_restarts=-1)
class CPUModelActor(BaseModelDeployment):
    #: Parking HOT->WARM moves weights between GPU and CPU memory (with CUDA calls); on a CPU there is
    #: nothing to park, so the controller evicts instead.
    CACHEABLE = False

    def load_from_disk(self) -> HuggingFaceModel:
        server_packages.import_for_models(self.model_key)
        started = time.time()
        model = HuggingFaceModel.from_model_key(
            self.model_key, dispatch=True, dtype=self.dtype_name, device="cpu", **self.kwargs)
        model._module.requires_grad_(False)
        logger.info(f"Loaded {self.model_key} on the CPU in {time.time() - started:.1f} s")
        built_log.record(self.model_key, model)
        return model

    def cleanup(self) -> None:
        # The stock cleanup, less torch.cuda.synchronize()/empty_cache().
        import gc

        self.kill_switch.clear()
        self.kill_reason = None
        self.execution_ident = None
        self.model.interleaver.cancel()
        gc.collect()


# Incompatibility 2: ndif 0.1.2 calls an nnsight API that nnsight 0.8.1 does not have -----------------
# The controller's evaluator sizes a model with
#   Remotable.describe_checkpoint(model_key, dtype, trust_remote_code=...)
#   Remotable.max_tp_size(model_key, trust_remote_code=...)
# nnsight 0.8.1 (the newest on PyPI) takes no ``trust_remote_code``, so every deploy fails with
# "describe_checkpoint() got an unexpected keyword argument 'trust_remote_code'" (and /status loses its
# model details). The controller subclass below wraps both classmethods, in the controller's own
# process, to accept the argument and drop it. Our models are local and never run repo code, so
# nothing is lost by dropping it.

def _accepting_trust_remote_code(method):
    if getattr(method, "_drops_trust_remote_code", False):
        return method

    def wrapper(model_key, *args, trust_remote_code=False, **kwargs):
        return method(model_key, *args, **kwargs)

    wrapper._drops_trust_remote_code = True
    return staticmethod(wrapper)


def bridge_trust_remote_code() -> None:
    Remotable.describe_checkpoint = _accepting_trust_remote_code(Remotable.describe_checkpoint)
    Remotable.max_tp_size = _accepting_trust_remote_code(Remotable.max_tp_size)


@ray.remote(num_cpus=1, num_gpus=0, max_restarts=-1, resources={"head": 1})
class ControllerActor(_ControllerActor):
    """ndif's controller (same Ray options as its own ``ControllerActor``), with the nnsight bridge applied."""

    def __init__(self, *args, **kwargs):
        bridge_trust_remote_code()
        # Its evaluator builds every model it deploys on the meta device from the key, to size it.
        server_packages.import_for_models()
        super().__init__(*args, **kwargs)
