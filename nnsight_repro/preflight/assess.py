"""From a checkpoint's module tree (per nnsight line) and a server's facts to one verdict per client.

Owns: which environment reads each line's tree (:data:`TREE_ENVS`, run in parallel), the key each client
sends for the checkpoint and the class a server builds from it, and the report (:func:`report`): per client
``runs`` / ``fails`` / ``unknown``, every failure with why and the one thing to change, the spelling of a
colliding submodule and of nnsight's value on that line, and whether the host has the key deployed.

Does not own the rule (:mod:`nnsight_repro.outcomes`), the tree (:mod:`.tree`, in the environments), the
host's answers (:mod:`.server`) or the clients (:data:`nnsight_repro.envs.SPECS`). Stdlib only.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from .. import envs, lines, outcomes
from ..checks import RELEASE_AUTOMODEL

#: The clients a verdict is given for: stock 0.7.0, fixed 0.7.0, 0.8.1 (the suite's environments).
CLIENTS = ["main", "patched", "upstream-0.8"]
#: Per line, the environment whose nnsight reads the tree: the line's release (both 0.7 clients share its
#: module tree and spelling; only the key differs, and that is decided here).
TREE_ENVS: Dict[str, str] = {}
for _name, _spec in envs.SPECS.items():
    if _spec.series is None:
        TREE_ENVS.setdefault(_spec.line, _name)

#: What to change when the tree itself could not be read, per :class:`.tree.TreeError` kind.
UNREADABLE = {
    "remote_code": "preflight runs no checkpoint code: ask the server's operators whether they build models with "
                   "trust_remote_code, or register the model with a package both sides install",
    "unknown_model_type": "install the package that registers this model_type in the project environments "
                          "(`python3 -m nnsight_repro envs python main`) and on the server",
    "build": "transformers cannot build this config: load it locally first (`AutoConfig.from_pretrained`, "
             "`from_config`) and fix what it says",
    "config": "transformers cannot read this config: load it locally first (`AutoConfig.from_pretrained`) and "
              "fix what it says",
}


def label(client: str) -> str:
    spec = envs.SPECS[client]
    if spec.series:
        return f"fixed nnsight {spec.nnsight} (+ patches/{spec.series})"
    return f"{'stock ' if outcomes.releases_bugs(client) else ''}nnsight {spec.nnsight}"


def inspect(jobs: List[dict]) -> Dict[str, dict]:
    """``{line: {job id: tree facts, "_environment": ...}}``: each line's environment reads every job, the
    lines' environments at once (each costs an interpreter with torch, transformers and nnsight)."""
    def one(line: str) -> dict:
        env = envs.ensure(TREE_ENVS[line])
        return env.run_one(["-m", "nnsight_repro.preflight.tree"], input=json.dumps(jobs), timeout=900,
                           doing="building checkpoints' module trees on the meta device")

    with ThreadPoolExecutor(len(TREE_ENVS)) as pool:
        found = {line: pool.submit(one, line) for line in TREE_ENVS}
        return {line: future.result() for line, future in found.items()}


def model_facts(tree: dict) -> outcomes.ModelFacts:
    bfloat16 = tree.get("bfloat16") or {}
    return outcomes.ModelFacts(
        wrapped_class=tree["wrapped"]["class"], automodel=tree["wrapped"]["automodel"], task=tree["task"],
        collides=any(c["kind"] == "served" for c in tree["collisions"]),
        has_causal_lm=tree["causal_lm"]["class"] is not None,
        causal_lm_keeps_paths=tree["causal_lm"]["missing_path"] is None,
        requires=(tree["package"]["name"],) if tree.get("package") else (),
        fails_in_bfloat16=bfloat16.get("message"), bfloat16_fix=bfloat16.get("fix"))


def key(client: str, repo_id: str, tree: dict) -> dict:
    """``{"wrapper", "fields"}``: the key ``client`` sends for this checkpoint. The stock 0.7.0 key carries
    no class field; the fixed one names the automodel unless it is the default; 0.8's always names the task."""
    spec = envs.SPECS[client]
    line = lines.LINES[spec.line]
    fields = {"repo_id": repo_id, "revision": None}
    value = tree["task"] if line.class_field == "task" else tree["wrapped"]["automodel"]
    if line.class_field == "task" or (not outcomes.releases_bugs(client) and value != RELEASE_AUTOMODEL):
        fields[line.class_field] = value
    return {"wrapper": line.wrapper, "fields": fields}


def server_builds(client: str, tree: dict) -> dict:
    """``{"from", "class"}``: what a server rebuilds from ``client``'s key (``class`` None: nothing)."""
    automodel = tree["wrapped"]["automodel"]
    if lines.LINES[envs.SPECS[client].line].class_field == "task":
        return {"from": f"task {tree['task']}" if tree["task"] else "no task", "class": tree["builds"]}
    if outcomes.releases_bugs(client) and automodel != RELEASE_AUTOMODEL:
        return {"from": RELEASE_AUTOMODEL, "class": tree["causal_lm"]["class"]}
    return {"from": automodel, "class": tree["wrapped"]["class"]}


def spelling(line_name: str, tree: dict) -> Dict[str, dict]:
    """Per colliding name, where nnsight's value and the submodule are on this line."""
    line = lines.LINES[line_name]
    return {c["name"]: {"nnsight": line.served_attr(c["name"]), "submodule": line.child_attr(c["name"])}
            for c in tree["collisions"] if c["kind"] == "served"}


def deployed(key_: dict, deployments: Dict[str, dict]) -> Optional[dict]:
    """The host's deployment of this key (its level and state), or None. Keys are compared field by field
    (ndif 0.0.1 stores ``"revision": "main"`` as null)."""
    wanted = dict(key_["fields"])
    for model_key, level in deployments.items():
        path, _, raw = model_key.partition(":")
        try:
            fields = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(fields, dict) or path.rsplit(".", 1)[-1] != key_["wrapper"]:
            continue
        if fields.get("revision") == "main":
            fields["revision"] = None
        if all(fields.get(k) == v for k, v in wanted.items()) and set(fields) <= set(wanted) | {"revision"}:
            return level
    return None


def _failure(found: dict, tree: dict, server: outcomes.ServerFacts) -> dict:
    bug = found["bug"]
    message = found["message"]
    if bug == "key" and message == outcomes.UNKNOWN_MODULE:
        message += tree["causal_lm"]["missing_path"]  # the first module the request names that is not there
    package = (tree.get("package") or {}).get("name") or (tree.get("bfloat16") or {}).get("package")
    return {"bug": bug, "message": message, "why": outcomes.BUGS[bug],
            "change": outcomes.FIXES[bug].format(package=package, server_line=server.line,
                                                 bfloat16_fix=(tree.get("bfloat16") or {}).get("fix"))}


def verdict(client: str, repo_id: str, trees: Dict[str, dict], server: outcomes.ServerFacts,
            deployments: Optional[Dict[str, dict]] = None) -> dict:
    """One client's verdict on ``server`` for the checkpoint whose per-line trees are ``trees``."""
    line = envs.SPECS[client].line
    tree = trees[line]
    out = {"client": client, "label": label(client), "line": line}
    if "error" in tree:
        return {**out, "verdict": "unknown", "failures": [{"bug": tree["error"], "message": tree["message"],
                                                           "why": tree["message"],
                                                           "change": UNREADABLE.get(tree["error"], "")}]}
    failures = [_failure(f, tree, server) for f in outcomes.failures(model_facts(tree), client, server)]
    built = server_builds(client, tree)
    out.update(verdict="fails" if failures else "runs", failures=failures,
               key=key(client, repo_id, tree), server_builds=built, spelling=spelling(line, tree))
    if built["class"] and built["class"] != tree["wrapped"]["class"]:
        # Not a failure by itself (the request loads when the module paths match), but not the user's model.
        out["caveat"] = (f"the server builds {built['class']}, not {tree['wrapped']['class']}: another class "
                         f"(its head, its attention), so its values need not be yours")
    if deployments is not None:
        out["deployed"] = deployed(out["key"], deployments)
    return out


def notes(checkpoint, trees: Dict[str, dict], host: Optional[dict], dtype: str) -> List[str]:
    """What the verdicts assume, in words."""
    tree = next((t for t in trees.values() if "error" not in t), {})
    package = (tree.get("package") or {}).get("name")
    said = []
    if host is None:
        said.append(f"no host asked (--host, NDIF_HOST): each client is judged against a server of its own line "
                    f"that loads models in {dtype}" + (f" and has {package} installed" if package else ""))
    else:
        if host["packages"] is None:
            said.append(f"{host['url']} has no /env (ndif 0.0.1, the 0.7 line): its nnsight and packages are "
                        f"unknown" + (f"; {package} is assumed installed" if package else ""))
        said.append(f"the server loads models in {dtype} (--dtype; /env does not say)")
    if tree.get("remote_code"):
        said.append(f"the checkpoint also carries its own code ({', '.join(tree['remote_code'])}): this is what a "
                    f"server that does not trust remote code builds")
    if Path(checkpoint.repo_id).expanduser().exists():
        said.append(f"the key names a local path ({checkpoint.repo_id}): a server loads it only from the same path "
                    f"(a local stack can); for NDIF, push the checkpoint to the hub and wrap it by its id")
    return said


def host_summary(host: dict, package: Optional[str]) -> dict:
    """The host's facts a report shows: its line and the versions of the packages that matter here."""
    shown = ["nnsight", "transformers", "torch", *([package] if package else [])]
    packages = None if host["packages"] is None else {n: host["packages"].get(n) for n in shown}
    return {"url": host["url"], "line": host["line"], "nnsight": host["nnsight"], "python": host["python"],
            "packages": packages, "deployments": len(host["deployments"])}


def report(checkpoint, trees: Dict[str, dict], host: Optional[dict], dtype: str,
           environments: Optional[Dict[str, dict]] = None) -> dict:
    """The whole answer for one checkpoint (``--json`` prints it as it is)."""
    tree = next((t for t in trees.values() if "error" not in t), None)
    verdicts = []
    for client in CLIENTS:
        if host is None:
            server = outcomes.ServerFacts(line=envs.SPECS[client].line, dtype=dtype)
        else:
            server = outcomes.ServerFacts(line=host["line"], dtype=dtype,
                                          packages=None if host["packages"] is None else frozenset(host["packages"]))
        verdicts.append(verdict(client, checkpoint.repo_id, trees, server,
                                None if host is None else host["deployments"]))
    package = ((tree or {}).get("package") or {}).get("name")
    return {"model": checkpoint.given, "config": str(checkpoint.folder / "config.json"),
            "model_type": checkpoint.model_type, "tree": tree, "environments": environments,
            "server": None if host is None else host_summary(host, package), "dtype": dtype,
            "notes": notes(checkpoint, trees, host, dtype), "clients": verdicts}
