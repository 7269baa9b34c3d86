"""What an NDIF host says about itself: its ``/status`` (what it has deployed) and ``/env`` (its Python
packages, nnsight among them), read once over HTTP.

The shapes are ndif's own (``ndif/services/api/app.py``; nnsight's ``ndif.status`` and ``get_remote_env``
read the same): ``/status`` is ``{"deployments": {name: {"model_key", "deployment_level",
"application_state", ...}}}`` (parsed by :func:`nnsight_repro.ndif.health.deployment_levels`, as the local
stacks are), ``/env`` is ``{"python_version", "packages": {import name: version}}``. ndif 0.0.1, which serves
nnsight 0.7 clients, predates ``/env`` and answers it 404: then the host is of the 0.7 line and its packages
are unknown.

Owns :class:`HostError` (exit 1): a host that does not answer, or answers but is not an NDIF API. Does not
decide what the answers mean for a model (:mod:`nnsight_repro.outcomes`). Stdlib only.
"""

from __future__ import annotations

import json
from typing import Optional

from ..lines import line_of
from ..ndif.probe import get
from ..ndif.health import deployment_levels

#: The line of a host without ``/env``: ndif 0.0.1, which serves nnsight 0.7.0 clients.
LINE_WITHOUT_ENV = "0.7"
TIMEOUT = 15.0


class HostError(Exception):
    """The host cannot be asked; the message names it, its URL and what to check."""


def _json(answer: dict):
    try:
        return json.loads(answer.get("body", ""))
    except ValueError:
        return None


def read(url: str, timeout: float = TIMEOUT) -> dict:
    """``{"url", "line", "nnsight", "packages": {name: version} | None, "python", "deployments": {key: level}}``."""
    if not url.startswith(("http://", "https://")):
        raise HostError(f"host {url!r} is not an http(s) URL. Fix: give the NDIF API's URL, as NDIF_HOST holds "
                        f"it (e.g. https://api.ndif.us)")
    base = url.rstrip("/")
    status = get(base + "/status", timeout)
    if "error" in status:
        raise HostError(f"host {url} does not answer ({status['error']}). Fix: check the URL and that the "
                        f"server is up (a local stack's API is reachable only inside its network namespace)")
    body = _json(status)
    if status["status"] != 200 or not isinstance(body, dict) or not isinstance(body.get("deployments"), dict):
        said = " ".join(status.get("body", "").split())[:120]
        raise HostError(f"host {url} is not an NDIF API: its /status answered HTTP {status['status']} "
                        f"({said!r}), not NDIF's {{\"deployments\": ...}}. Fix: give the NDIF API's URL")
    env = get(base + "/env", timeout)
    facts = {"url": base, "deployments": deployment_levels(body)}
    if env.get("status") == 404:
        return {**facts, "line": LINE_WITHOUT_ENV, "nnsight": None, "packages": None, "python": None}
    listed = _json(env)
    if env.get("status") != 200 or not isinstance(listed, dict) or not isinstance(listed.get("packages"), dict):
        why = env.get("error") or f"HTTP {env.get('status')}"
        raise HostError(f"host {url} answered /status but not /env ({why}); try again, or ask its operators")
    packages = {str(k): v for k, v in listed["packages"].items()}
    nnsight: Optional[str] = packages.get("nnsight")
    if not nnsight:
        raise HostError(f"host {url} is not an NDIF API: its /env lists no nnsight. Fix: give the NDIF API's URL")
    try:
        line = line_of(nnsight).name
    except ValueError:
        line = ".".join(nnsight.split(".")[:2])  # a line no client here speaks: every client is told so
    return {**facts, "line": line, "nnsight": nnsight, "packages": packages,
            "python": str(listed.get("python_version", "")).split()[0] or None}
