"""The server generations and the one declaration of pairings, offline: what each place derives from them,
and that nothing else branches on a generation's version string."""

import re

from nnsight_repro import ROOT
from nnsight_repro.ndif import config, generations, negative_control, panel
from nnsight_repro.ndif.feasibility.declarations import PROBED_PAIRINGS


def test_each_generation_names_its_clients_and_the_one_that_speaks_for_each_server_build():
    assert config.generation("0.8").clients == ("upstream-0.8",)
    assert config.generation("0.7").clients == ("main", "patched")
    assert {(line, server): config.default(line=line, server=server).client
            for line, g in generations.GENERATIONS.items() for server in g.servers} == {
        ("0.8", "stock"): "upstream-0.8", ("0.7", "stock"): "main", ("0.7", "patched"): "patched"}


def test_the_panel_the_negative_control_and_the_probe_script_derive_their_pairings_from_the_one_declaration():
    assert {line: [(p.client, p.panel_role) for p in pairings] for line, pairings in panel.PAIRINGS.items()} == {
        "0.8": [("upstream-0.8", "required")], "0.7": [("patched", "required"), ("main", "negative control")]}
    assert {server: list(clients) for server, clients in negative_control.PAIRINGS.items()} == {
        "stock": ["main", "patched"], "patched": ["main", "patched"]}
    assert {name: (p.client, p.line, p.server) for name, p in PROBED_PAIRINGS.items()} == {
        "main": ("main", "0.7", "stock"), "patched": ("patched", "0.7", "patched"),
        "patched-client-only": ("patched", "0.7", "stock"), "upstream-0.8": ("upstream-0.8", "0.8", "stock")}


def test_every_pairing_has_a_name_of_its_own_and_a_server_build_its_generation_runs():
    names = [p.name for p in generations.PAIRINGS]
    assert len(names) == len(set(names))
    assert all(p.server in p.generation.servers for p in generations.PAIRINGS)


def test_no_version_string_branch_outside_the_generations_and_the_lines_table():
    # What issue 39 moved into the generation classes stays there: a difference is a field or a method.
    branch = re.compile(r'line *(==|!=) *"0\.[78]"|"0\.[78]" *(==|!=)')
    allowed = {ROOT / "nnsight_repro" / "ndif" / "generations.py", ROOT / "nnsight_repro" / "lines.py"}
    found = [f"{path.relative_to(ROOT)}:{number}"
             for folder in ("nnsight_repro", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))
             if path not in allowed
             for number, text in enumerate(path.read_text().splitlines(), 1) if branch.search(text)]
    assert found == []


def test_every_generations_ray_processes_run_without_grpcs_fork_support_and_its_api_keeps_it(tmp_path):
    # With it on, about one in six Ray client servers died as they forked (generations.RAY_ENV); the live
    # stacks' Ray-client loops (tests/test_remote_ndif_07.py) see that only by chance.
    for line in generations.GENERATIONS:
        cfg = config.StackConfig(folder=tmp_path / line, line=line)
        assert cfg.environ(tmp_path / "bin", role="ray")["GRPC_ENABLE_FORK_SUPPORT"] == "false"
        assert "GRPC_ENABLE_FORK_SUPPORT" not in cfg.environ(tmp_path / "bin", role="api")
