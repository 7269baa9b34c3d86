"""``nnsight-repro`` / ``python3 -m nnsight_repro``: thin commands over the project's modules.

Stdlib only at import: on a fresh machine this is what builds everything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import ROOT, channel, envs, series
from .envs import sdists

TEST_ENVS = ["main", "patched", "upstream-0.8"]
#: Never checked, but needed: Modal's client (tests/test_modal_verify_patch.py) and matplotlib (verify plots).
TOOL_ENVS = ["tools"]


def setup(with_servers: bool = True) -> dict:
    """Every environment the suite uses, missing ones built: the test environments, tools, and the server
    environment of each generation's stack (with the packages the suite's stacks install)."""
    jobs = {name: (lambda n=name: envs.ensure(n)) for name in [*TEST_ENVS, *TOOL_ENVS]}
    if with_servers:
        from .ndif import server_env, server_packages

        for name, line in server_env.suite_environments().items():
            jobs[name] = lambda line=line: server_env.ensure(line=line, extras=server_packages.SUITE)
    return envs.build_all(jobs)


def cmd_test(args) -> int:
    """Build what the suite needs, then run pytest inside the patched environment."""
    built = setup()
    env = built["patched"]
    # The slowest tests are listed after every full run: where the suite's time goes is always on record.
    pytest_args = args.pytest_args or ["tests", "--durations=25"]
    os.chdir(ROOT)
    os.execve(str(env.python), [str(env.python), "-m", "pytest", *pytest_args], env.environ())


def cmd_verify(args) -> int:
    from . import verify

    return verify.main(args)


def cmd_zoo(args) -> int:
    from .zoo import scan

    return scan.main(args)


def cmd_envs(args) -> int:
    from .ndif import server_env

    servers = {server_env.server_spec(line).name: line for line in server_env.SERVERS}
    if args.action == "status":
        for row in envs.status():
            print(f"{row['name']:16} {row['state']:10} nnsight {row['nnsight']:6} "
                  f"series={row['series'] or '-':16} {row['path']}")
        for line in server_env.SERVERS:
            row = server_env.status(line)
            print(f"{row['name']:16} {row['state']:10} ndif {row['ndif']:9} {'':23} {row['path']}")
        return 0
    names = args.names or [*envs.SPECS, *envs.TOOLS]
    build = args.action == "build"
    jobs = {name: (lambda n=name: server_env.ensure(build=build, line=servers[n])) if name in servers
            else (lambda n=name: envs.ensure(n, build=build)) for name in names}
    for env in envs.build_all(jobs).values():
        print(env.python if args.action == "python" else env.path)
    return 0


def cmd_series(args) -> int:
    name = args.series
    b = series.base(name)
    if args.repo:
        head = series.check_repo(name, Path(args.repo))
        print(f"ok: {len(series.patches(name))} patches of {name} `git am` cleanly onto {b.describe()} -> {head}")
    else:
        tree = Path(args.tree) if args.tree else _sdist_tree(name)
        series.am_onto_tree(name, tree)
        print(f"ok: {tree} is {b.describe()} for every file the series touches, "
              f"and {len(series.patches(name))} patches `git am` cleanly onto it")
    return 0


def _sdist_tree(name: str) -> Path:
    """The released sdist of the series' base, extracted into the cache."""
    b = series.base(name)
    version = b.tag.lstrip("v")
    spec = next((s for s in envs.SPECS.values() if s.nnsight == version), None)
    if spec is None or b.repo != "ndif-team/nnsight":
        raise series.SeriesError(f"No released sdist of {b.describe()} is pinned here: pass --repo (a checkout "
                                 f"of {b.commit[:10]}) or --tree.")
    return sdists.tree(spec.nnsight, spec.sdist_sha256)


def cmd_modal(args) -> int:
    """Modal's own command line from the ``tools`` environment (built if missing), from the repository root."""
    env = envs.ensure("tools")
    modal = env.path / "venv" / "bin" / "modal"
    os.chdir(ROOT)
    os.execve(str(modal), [str(modal), *args.modal_args], env.environ())


def cmd_wheel(args) -> int:
    from . import wheel

    return wheel.main(args.wheel_args)


def cmd_preflight(args) -> int:
    from .preflight import cli as preflight_cli

    return preflight_cli.command(args)


def cmd_ndif(args) -> int:
    from .ndif import cli as ndif_cli

    return ndif_cli.main(args.ndif_args)


#: What a usage error and every error this module catches exit with (``main``); each command adds its own.
USAGE_AND_SETUP = ("  2  usage error, or an environment, patch series or child process failed (the message names "
                   "it)\n")


def exits(*lines: str) -> str:
    """An epilog listing a command's exit statuses, each line ``"<code>  <meaning>"``."""
    return "exit status:\n" + "".join(f"  {line}\n" for line in lines) + USAGE_AND_SETUP


def command(sub, name: str, help: str, epilog: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows ``help`` and its exit statuses as written."""
    return sub.add_parser(name, help=help, description=help, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nnsight-repro", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=exits("0  done; each command's --help lists its own exit statuses"))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    add_runs(sub)
    add_tools(sub)
    return p


def add_runs(sub) -> None:
    """The commands that run checks and write results: test, verify, zoo."""
    t = command(sub, "test", "build the environments and run the test suite (in the patched env)",
                "exit status: pytest's (0 all passed, 1 some failed, 2 interrupted or a usage error, 5 no tests "
                "collected);\n  2 also when an environment cannot be built\n")
    t.add_argument("pytest_args", nargs="*", help="passed to pytest (default: tests); options too, e.g. -x")
    t.set_defaults(run=cmd_test)

    v = command(sub, "verify", "run the check routine in each environment and write results/verify/",
                exits("0  every environment's check routine ran (a failing check is a result, not an error)",
                      "1  the check routine itself failed in an environment (its checks are recorded as failed)"))
    v.add_argument("--envs", default=",".join(TEST_ENVS),
                   help=f"comma-separated environments to check (default: {','.join(TEST_ENVS)})")
    v.add_argument("--models", default=None, help="comma-separated panel models (default: all)")
    v.add_argument("--checks", default=None, help="comma-separated checks (default: all)")
    v.add_argument("--out", default=str(ROOT / "results" / "verify"), help="output directory")
    v.set_defaults(run=cmd_verify)

    z = command(sub, "zoo", "scan every transformers/multimolecule architecture in each environment",
                exits("0  the report was written (an architecture that fails is a finding in it)"))
    z.add_argument("--subset", choices=["ci", "full"], default="full",
                   help="full: every architecture (default); ci: the dozen classes the suite scans "
                        "(nnsight_repro/zoo/scan.py CI_UNITS)")
    z.add_argument("--envs", default=",".join(TEST_ENVS),
                   help=f"comma-separated environments to scan in (default: {','.join(TEST_ENVS)})")
    z.add_argument("--out", default=str(ROOT / "results" / "zoo"), help="output directory")
    z.add_argument("--timeout", type=float, default=120, help="seconds per class before its worker is killed")
    z.add_argument("--parallel", type=int, default=2, help="environments scanned at once")
    z.add_argument("--only", default=None, help="comma-separated model_types or unit ids (debugging)")
    z.add_argument("--rerender", action="store_true", help="rewrite --out's zoo.json/zoo.md from its own records")
    z.set_defaults(run=cmd_zoo, command_line=None)


def add_tools(sub) -> None:
    """The commands around the runs: the environments, NDIF stacks, the wheel, Modal, the series, preflight
    (``ndif``, ``wheel`` and ``modal`` hand their arguments to a parser of their own)."""
    e = command(sub, "envs", "build, locate or inspect the cached environments", exits("0  done"))
    e.add_argument("action", choices=["build", "status", "path", "python"],
                   help="build: build what is missing or stale; status: each one's state and versions; path: "
                        "print each one's folder; python: print each one's interpreter (path and python refuse "
                        "a missing or stale one, naming the command that builds it)")
    e.add_argument("names", nargs="*", help=f"environments (default: all of {', '.join([*envs.SPECS, *envs.TOOLS])}; "
                   f"also ndif-server, ndif-server-0.7)")
    e.set_defaults(run=cmd_envs)

    n = sub.add_parser("ndif", add_help=False,
                       help="a local NDIF server (ndif 0.1.2 for nnsight 0.8 clients; --line 0.7: "
                            "ndif 0.0.1 for nnsight 0.7.0): up | down | status | negative-control | panel "
                            "(`ndif --help`, `ndif up --help`, ...)")
    n.add_argument("ndif_args", nargs=argparse.REMAINDER,
                   help="up [--line 0.7 [--server stock|patched]] [--models a,b] | down [--line 0.7] | "
                        "status [--line 0.7] [--json] | negative-control [--out DIR] | panel [--line 0.7] ...")
    n.set_defaults(run=cmd_ndif)

    w = sub.add_parser("wheel", add_help=False, help="build nnsight 0.7.0 + the series (and its extras) as a wheel "
                       "to pip-install into your own environment; it compiles nnsight's C extension for the "
                       "interpreter it is for: wheel [--out DIR] [--no-extras] [--python PATH] (`wheel --help`)")
    w.add_argument("wheel_args", nargs=argparse.REMAINDER, help="passed to `wheel` (see `wheel --help`)")
    w.set_defaults(run=cmd_wheel)

    m = sub.add_parser("modal", add_help=False, help="Modal's client from the tools environment, e.g. "
                       "`modal run modal_verify_patch.py` (or `pip install -e '.[modal]'` and plain `modal`); "
                       "its --help and exit statuses are Modal's")
    m.add_argument("modal_args", nargs=argparse.REMAINDER, help="passed to Modal's `modal` command")
    m.set_defaults(run=cmd_modal)

    s = command(sub, "series", "check that a patch series applies to its base",
                exits("0  every patch applies with `git am` onto the series' base"))
    s.add_argument("action", choices=["check"], help="check: apply the series to its base (the only action)")
    s.add_argument("--series", default="nnsight-v0.7.0",
                   help="the series, a folder under patches/ (default: nnsight-v0.7.0)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--repo", help="a git checkout of the series' upstream at its base commit")
    where.add_argument("--tree", help="a source tree (e.g. an extracted sdist); default: the released sdist")
    s.set_defaults(run=cmd_series)

    from .preflight import cli as preflight_cli

    f = sub.add_parser("preflight", help="will a checkpoint run remotely, per client (stock 0.7.0, fixed 0.7.0, "
                                         "0.8.1), and what to change if not",
                       description=preflight_cli.parser().description, epilog=preflight_cli.EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    preflight_cli.add_arguments(f)
    f.set_defaults(run=cmd_preflight)


def main(argv=None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        if args.command == "ndif":  # its own parser reads them, `--help` included
            args.ndif_args = [*extra, *args.ndif_args]
        elif args.command == "modal":
            args.modal_args = [*extra, *args.modal_args]
        elif args.command == "wheel":
            args.wheel_args = [*extra, *args.wheel_args]
        elif args.command == "test":
            args.pytest_args = [*args.pytest_args, *extra]
        else:
            p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args) or 0
    except (envs.EnvError, series.SeriesError, channel.ChannelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
