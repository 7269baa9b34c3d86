"""uv, the installer every cached environment is built with: fetched once into the project cache, hash-checked.

The host side is stdlib only, so uv cannot be a dependency of the project: the
first build installs the pinned uv wheel from PyPI with this interpreter's pip
(``--require-hashes``, into ``<cache>/uv/<version>``) and every build after that
runs that binary. ``NNSIGHT_REPRO_UV`` names another uv binary instead (an
offline machine that has one).

All builds share one uv cache, ``<cache>/uv-cache``: a package downloaded or
built for one environment is linked, not fetched again, into the next. uv
does not read pip's configuration, so the find-links directories pip is
configured with (``PIP_FIND_LINKS``, pip.conf) are passed on explicitly: that
is where a machine keeps wheels PyPI does not have, like the CPU torch build.
pip's extra indexes are not: uv would prefer them over PyPI for every package
they list, and a partial mirror would then hide the pinned versions.

What this module does not do: decide what goes into an environment
(:mod:`nnsight_repro.envs` and :mod:`nnsight_repro.ndif.server_env` do).
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from . import fsutil, settings
from .settings import cache_dir

VERSION = "0.13.8"
#: The uv 0.13.8 wheels of the platforms the project has run on (PyPI's files; uv's own wheels are
#: platform wheels). A platform not listed gets a message naming the fix.
WHEEL_SHA256 = {
    "manylinux_2_17_x86_64": "e18a57b8b352eb7c8feb317b9f6f533c8f0ad9673fd6cf34bbe3cf1a9f6a8984",
    "manylinux_2_17_aarch64": "0b3e8b1a4f5e405e31e2ff33de8af4744831e9f7338539671efbd8c3c94e791d",
    "macosx_11_0_arm64": "62b6943c7fd64fac6854f780bea6e0359e5a5bc3241f83ee357bb38276afac49",
}


class UvError(Exception):
    """uv cannot be had or cannot do what was asked; the message names the package and the fix."""


def cache() -> Path:
    """The one uv cache every environment build shares."""
    return cache_dir() / "uv-cache"


def binary() -> Path:
    """The uv binary: ``NNSIGHT_REPRO_UV``, else the pinned release, installed into the cache on first use."""
    configured = settings.setting("UV")
    if configured:
        path = Path(configured)
        if not os.access(path, os.X_OK):
            raise UvError(f"NNSIGHT_REPRO_UV={configured} is not an executable uv binary.")
        return path
    home = cache_dir() / "uv" / VERSION
    uv = home / "bin" / "uv"
    if uv.is_file():
        return uv
    with fsutil.locked(home.parent / f".{VERSION}.lock"):
        if uv.is_file():
            return uv
        _install(home)
    return uv


def _install(home: Path) -> None:
    """pip-installs the hash-pinned uv wheel into a staging directory, then renames it into place."""
    hashes = " ".join(f"--hash=sha256:{h}" for h in WHEEL_SHA256.values())
    with tempfile.TemporaryDirectory() as scratch, fsutil.staged_directory(home) as target:
        requirements = Path(scratch) / "uv.txt"
        requirements.write_text(f"uv=={VERSION} {hashes}\n")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
             "--no-deps", "--only-binary", ":all:", "--require-hashes", "--target", str(target),
             "-r", str(requirements)],
            capture_output=True, text=True,
        )
        if result.returncode or not (target / "bin" / "uv").is_file():
            lines = [line for line in (result.stderr or result.stdout).strip().splitlines()
                     if not line.startswith("WARNING")]
            last = lines[-1] if lines else "no uv binary in the installed wheel"
            hint = ("no pinned hash matches this platform's uv wheel: add it to uvtool.WHEEL_SHA256"
                    if "hash" in last.lower() else "check access to PyPI")
            raise UvError(f"Could not install uv {VERSION} from PyPI with pip (pip: {last}). Fix: {hint}, "
                          f"or point NNSIGHT_REPRO_UV at a uv {VERSION} binary.")


def pip_config(option: str, environment: str) -> List[str]:
    """The values pip is configured with here for ``option`` (``environment`` first, then pip.conf files)."""
    found: List[str] = []
    found += os.environ.get(environment, "").split()
    config_dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    files = [*(Path(d) / "pip" / "pip.conf" for d in config_dirs), Path("/etc/pip.conf"),
             Path.home() / ".pip" / "pip.conf",
             Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    for path in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        for section in ("global", "install", "download"):
            if parser.has_option(section, option):
                found += parser.get(section, option).split()
    return list(dict.fromkeys(found))


def pip_find_links() -> List[str]:
    """The find-links locations pip is configured with here (environment first, then pip.conf files)."""
    return [item for item in pip_config("find-links", "PIP_FIND_LINKS")
            if not item.startswith("/") or Path(item).exists()]


def pip_indexes() -> List[str]:
    """The package indexes pip would read here, its main index first (PyPI unless configured otherwise)."""
    main = pip_config("index-url", "PIP_INDEX_URL")[:1] or ["https://pypi.org/simple"]
    return list(dict.fromkeys([*main, *pip_config("extra-index-url", "PIP_EXTRA_INDEX_URL")]))


def find_wheel(name: str, version: str) -> Optional[Path]:
    """A local wheel of ``name==version`` for this interpreter in a find-links directory (CPU torch lives there)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    pattern = re.compile(rf"{re.escape(name)}-{re.escape(version)}(\+[^-]+)?-({tag}|py3)-[^-]+-[^-]+\.whl$")
    for location in pip_find_links():
        folder = Path(location.removeprefix("file://"))
        if folder.is_dir():
            for candidate in sorted(folder.iterdir()):
                if pattern.match(candidate.name) and (sys.platform != "linux" or "linux" in candidate.name):
                    return candidate
    return None


def environ(base: Optional[dict] = None) -> dict:
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith("UV_")]:
        del env[key]  # a user's uv settings must not change what the project builds
    env.update({"UV_CACHE_DIR": str(cache()), "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1",
                "NO_COLOR": "1"})
    return env


def command(*args: str) -> List[str]:
    """A uv command line with the machine's find-links directories for the subcommands that install."""
    links: List[str] = []
    if args[:1] == ("build",) or args[:2] in (("pip", "install"), ("pip", "sync"), ("pip", "compile")):
        for location in pip_find_links():
            links += ["--find-links", location]
    if settings.setting("OFFLINE") and args[:1] in (("pip",), ("build",), ("venv",)):
        links.append("--offline")  # build from what the uv cache already holds; never touch the network
    return [str(binary()), *args, *links]


def explain(output: str) -> str:
    """One sentence for the uv failures a build meets, naming the package and the fix ('' if none applies)."""
    text = output.replace("\n", " ")
    m = (re.search(r"Because (?:there is no version of |there are no versions of )?([A-Za-z0-9_.\-]+)"
                   r"(?:==| was not found| \[)", text)
         # "Failed to install: nnsrprobe-1.0-py3-none-any.whl (nnsrprobe==1.0)", and the same for the other steps
         or re.search(r"Failed to (?:install|download|build|prepare)[^(`]*[(`]([A-Za-z0-9_.\-]+)==", text))
    package = m.group(1) if m else None
    if re.search(r"dns error|failed to lookup|Connection refused|error sending request|network|timed out",
                 text, re.I):
        m2 = re.search(r"(?:download|fetch|Failed to download|Failed to fetch)[^`]*`([^`]+)`", text)
        what = m2.group(1) if m2 else (package or "a package")
        return (f"uv could not reach the package index for {what}. Fix: restore access to PyPI, or put the wheel "
                f"into a find-links directory (PIP_FIND_LINKS).")
    if "No solution found" in text or "not found in the package registry" in text or "was not found" in text:
        return (f"a pinned requirement{f' ({package})' if package else ''} does not resolve. Fix: correct the pin "
                f"in nnsight_repro/pins/, or make that version available (PyPI or a find-links directory).")
    # A cache entry cut short (its unpacked wheel lost files, or its folder is gone) reads as an invalid wheel
    # or a missing file; the same words for a broken wheel in a find-links directory, hence the second fix.
    if re.search(r"Failed to read|invalid (?:cache|archive|zip)|No such file or directory|corrupt|"
                 r"failed to deserialize|Failed to extract|wheel is invalid", text, re.I):
        return (f"uv's cache at {cache()} looks damaged{f' (while handling {package})' if package else ''}. "
                f"Fix: `{binary()} cache clean{f' {package}' if package else ''}` with UV_CACHE_DIR={cache()}, "
                f"or delete that directory; if the build then fails the same way, the wheel it installs from is "
                f"itself broken: replace it.")
    return ""
