#!/usr/bin/env bash
# install.sh: install, upgrade, check, roll back or remove the appliance on an 8x B300 box.
#
#   sudo ./installer/install.sh                      install, or upgrade to this version
#   sudo ./installer/install.sh --offline WHEELHOUSE  the same with no network at all
#   sudo ./installer/install.sh --check              preflight only
#   sudo ./installer/install.sh --dry-run            print every change, make none
#   sudo ./installer/install.sh --uninstall [--purge]
#   ./installer/install.sh --help                    every option
#
# Run it from an unpacked bundle or a source checkout: the directory above this one holds the
# package (appliance/, migrations/, web/, pyproject.toml) and the units (systemd/). It never
# installs or changes NVIDIA drivers, and never starts, stops or restarts the engine unit. It
# never starts the router unit either (the daemon starts it on a cell's head); it restarts a
# running router only when the router's unit or environment changed (a router restart is
# cheap).
# Reference: installer/README.md, docs/install.md.
#
# All code is inside functions and the last line calls main: a truncated copy (an
# interrupted download) defines some functions and runs none of them.

set -Eeuo pipefail

defaults() {
  ROOT=""
  ACTION=install            # install | check | uninstall | rollback
  DRY_RUN=0 NO_START=0 YES=0 PURGE=0 STOP_ENGINE=0 FORCE_RESTART=0
  ALLOW_GPUS=0 ALLOW_OS=0 NO_ENGINE=0
  OFFLINE=""                # the wheelhouse, when --offline
  PY="${APPLIANCE_INSTALL_PYTHON:-}"
  OS_RELEASE="${APPLIANCE_INSTALL_OS_RELEASE:-/etc/os-release}"
  MIN_DRIVER=580.65.06      # CUDA 13 needs 580.65.06 or newer
  MIN_MODELS_FREE=1.7T      # Kimi K3 is 1.56 TB
  EXPECT_GPUS=8
  EXPECT_MODEL=B300
  # Bump when the way a release or engine environment is built changes: it is part of the
  # content hash, so the next run rebuilds instead of reusing an old-style build.
  LAYOUT=1

  OPT=/opt/appliance
  UNIT_DIR=/usr/local/lib/systemd/system
  DROPIN_DIR=/etc/systemd/system
  DAEMON=appliance.service
  GATEWAY=appliance-gateway.service
  GATEWAY_SOCKET=appliance-gateway.socket
  ENGINE=appliance-engine.service
  ROUTER=appliance-router.service   # a cell head's sglang-router; the daemon starts it
  SYSUSERS=/usr/lib/sysusers.d/appliance.conf
  TMPFILES=/usr/lib/tmpfiles.d/appliance.conf
  POLKIT=/usr/share/polkit-1/rules.d/50-appliance-engine.rules
  ETC=/etc/appliance
  CONFIG=/etc/appliance/appliance.toml
  USER_NAME=appliance

  # The config's values the installer needs (configfile.py values), until the file is read:
  # appliance/config.py's defaults.
  CFG_paths_state_dir=/var/lib/appliance
  CFG_paths_models_dir=/var/lib/appliance/models
  CFG_paths_log_dir=/var/log/appliance
  CFG_server_host=127.0.0.1
  CFG_server_port=8080
  CFG_server_tls_cert=""
  CFG_database_url=""
  CFG_gateway_host=0.0.0.0
  CFG_gateway_port=8000
  CFG_cell_role=unified

  CHANGES=()
  NOTES=()
  STARTED=()
  RESTARTED=()
  FAILS=0
  STEP="starting"
  UNITS_CHANGED=0 DAEMON_UNIT_CHANGED=0 GATEWAY_UNIT_CHANGED=0 ENGINE_UNIT_CHANGED=0
  SOCKET_UNIT_CHANGED=0 LISTEN_CHANGED=0 GATEWAY_STOPPED=0 ROUTER_UNIT_CHANGED=0 ROUTER_MOVED=0
  FRESH=0 PENDING="" SWITCH=0 DAEMON_STOPPED=0
}

usage() {
  cat <<'EOF'
Usage: install.sh [MODE] [OPTIONS]

Modes (default: install, or upgrade when an older release is installed):
  --check                 run the preflight checks only; PASS/FAIL per check
  --dry-run               print every change an install (or --uninstall) would make; make none
  --uninstall             remove the software; keep config, database, models and logs
  --uninstall --purge     also remove config, database, models, logs and caches (asks first)
  --rollback              make the previous release current again and restart daemon + gateway

Options:
  --offline [WHEELHOUSE]  no network: pip uses only WHEELHOUSE (default: the bundle's wheelhouse/)
  --root DIR              install into a staging root (tests, image builds); every systemctl
                          call gets --root=DIR
  --no-start              lay everything down and enable the services, start nothing
  --yes, -y               answer yes (the --purge confirmation); never prompts without a terminal
  --python PATH           Python 3.11+ for the virtual environments (default: python3.12,
                          python3.11, python3; or $APPLIANCE_INSTALL_PYTHON)
  --allow-gpus            accept a GPU count/model other than expected (and no fabric manager)
  --gpus N                expected GPU count (default 8)
  --gpu-model TEXT        text every GPU name must contain (default B300)
  --min-driver VERSION    lowest accepted NVIDIA driver (default 580.65.06)
  --min-models-free SIZE  free space needed for the models (default 1.7T; 500G, bytes...)
  --allow-unsupported-os  continue on something other than Ubuntu 24.04 x86_64
  --no-engine             do not build the engine environment (it is managed separately)
  --force-restart         restart daemon and gateway even when nothing changed
  --stop-engine           with --uninstall: stop a running engine (otherwise refused)
  -h, --help              this text

Nothing here installs or changes NVIDIA drivers, CUDA or the fabric manager.
EOF
}

say() { printf 'appliance-install: %s\n' "$*"; }
warn() { printf 'appliance-install: warning: %s\n' "$*" >&2; }

die() {  # die MESSAGE [FIX] [STATUS]
  printf 'appliance-install: error: %s\n' "$1" >&2
  if [[ -n ${2:-} ]]; then printf '  fix: %s\n' "$2" >&2; fi
  DIED=1
  exit "${3:-1}"
}

on_error() {
  local status=$? line=$1
  if [[ ${DIED:-0} == 1 || $BASH_SUBSHELL -gt 0 ]]; then return; fi
  DIED=1
  printf 'appliance-install: error: failed (exit %s, line %s) while %s\n' "$status" "$line" \
    "$STEP" >&2
  printf '  fix: read the output above, fix the cause and run the same command again; ' >&2
  printf 'an unfinished release is never made current\n' >&2
}

step() { STEP=$1; say "$1"; }
changed() { CHANGES+=("$1"); }
note() { NOTES+=("$1"); }

# The path of a system location inside the target root.
r() { printf '%s%s' "$ROOT" "$1"; }

# act DESCRIPTION COMMAND...: run COMMAND, or under --dry-run only say what it would do.
act() {
  local what=$1
  shift
  if ((DRY_RUN)); then
    say "would $what"
    return 0
  fi
  "$@"
}

absolute() { realpath -m -- "$1"; }

need_value() {
  if [[ $# -lt 2 || -z $2 ]]; then die "$1 needs a value" "see install.sh --help" 64; fi
}

parse_args() {
  while (($#)); do
    case $1 in
      --check) ACTION=check ;;
      --dry-run) DRY_RUN=1 ;;
      --uninstall) ACTION=uninstall ;;
      --purge) PURGE=1 ;;
      --rollback) ACTION=rollback ;;
      --root) need_value "$@"; ROOT=$(absolute "$2"); shift ;;
      --root=*) ROOT=$(absolute "${1#*=}") ;;
      --offline)
        if [[ $# -ge 2 && -n $2 && $2 != -* ]]; then OFFLINE=$(absolute "$2"); shift
        else OFFLINE=bundle; fi ;;
      --offline=*) OFFLINE=$(absolute "${1#*=}") ;;
      --no-start) NO_START=1 ;;
      --yes | -y) YES=1 ;;
      --python) need_value "$@"; PY=$2; shift ;;
      --allow-gpus) ALLOW_GPUS=1 ;;
      --gpus) need_value "$@"; EXPECT_GPUS=$2; shift ;;
      --gpu-model) need_value "$@"; EXPECT_MODEL=$2; shift ;;
      --min-driver) need_value "$@"; MIN_DRIVER=$2; shift ;;
      --min-models-free) need_value "$@"; MIN_MODELS_FREE=$2; shift ;;
      --allow-unsupported-os) ALLOW_OS=1 ;;
      --no-engine) NO_ENGINE=1 ;;
      --force-restart) FORCE_RESTART=1 ;;
      --stop-engine) STOP_ENGINE=1 ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option: $1" "see install.sh --help" 64 ;;
    esac
    shift
  done
  if [[ $ROOT == / ]]; then ROOT=""; fi
  if ((PURGE)) && [[ $ACTION != uninstall ]]; then
    die "--purge only goes with --uninstall" "install.sh --uninstall --purge" 64
  fi
  if ((STOP_ENGINE)) && [[ $ACTION != uninstall ]]; then
    die "--stop-engine only goes with --uninstall: installs and upgrades never touch the engine" \
      "stop the engine from the console or with 'appliance engine stop'" 64
  fi
  if ! [[ $EXPECT_GPUS =~ ^[0-9]+$ ]]; then die "--gpus needs a number, not '$EXPECT_GPUS'" "" 64; fi
  if [[ -n $PY && $PY == */* ]]; then PY=$(absolute "$PY"); fi
}

# ------------------------------------------------------------------------ source tree

locate_source() {
  local script=${BASH_SOURCE[0]:-}
  if [[ -z $script || ! -f $script ]]; then
    die "install.sh must be run as a file inside an unpacked bundle or a checkout" \
      "download and unpack the bundle, then run ./appliance-<version>/installer/install.sh"
  fi
  SRC=$(cd "$(dirname "$script")/.." && pwd -P)
  local missing=() path
  for path in pyproject.toml appliance/__init__.py appliance/engine/flags.py migrations \
    web/templates web/static installer/configfile.py installer/engine-requirements.txt \
    installer/router-requirements.txt appliance/cell/router.py \
    systemd/appliance.service systemd/appliance-gateway.service \
    systemd/appliance-gateway.socket systemd/appliance-router.service \
    systemd/appliance-engine.service systemd/appliance-engine-rdma.conf \
    systemd/appliance.sysusers.conf \
    systemd/appliance.tmpfiles.conf systemd/50-appliance-engine.rules; do
    [[ -e $SRC/$path ]] || missing+=("$path")
  done
  if ((${#missing[@]})); then
    die "$SRC is not a complete appliance bundle: missing ${missing[*]}" \
      "unpack the whole bundle again (or run from a full checkout)"
  fi
  if [[ $OFFLINE == bundle ]]; then OFFLINE=$SRC/wheelhouse; fi
}

read_versions() {
  local init project
  init=$(sed -n 's/^__version__ = "\([^"]*\)"[[:space:]]*$/\1/p' "$SRC/appliance/__init__.py")
  project=$(sed -n '/^\[project\]/,/^\[/ s/^version = "\([^"]*\)"[[:space:]]*$/\1/p' \
    "$SRC/pyproject.toml")
  if [[ -z $init || $init != "$project" ]]; then
    die "the bundle's version is inconsistent: appliance/__init__.py says '${init}', pyproject.toml '${project}'" \
      "rebuild the bundle from a clean checkout"
  fi
  if ! [[ $init =~ ^[0-9A-Za-z][0-9A-Za-z.+_-]*$ ]]; then
    die "version '$init' is not usable as a directory name" "fix the version in pyproject.toml"
  fi
  VERSION=$init
  PIN=$(sed -n 's/^sglang==\([0-9A-Za-z.+_-]*\)[[:space:]]*$/\1/p' \
    "$SRC/installer/engine-requirements.txt" | head -n 1)
  local modelled
  modelled=$(sed -n 's/^SGLANG_VERSION = "\([^"]*\)"[[:space:]]*$/\1/p' \
    "$SRC/appliance/engine/flags.py")
  if [[ -z $PIN || $PIN != "$modelled" ]]; then
    die "installer/engine-requirements.txt pins sglang '${PIN}' but the daemon models '${modelled}'" \
      "pin sglang==${modelled} in installer/engine-requirements.txt"
  fi
  ROUTER_PIN=$(sed -n 's/^sglang-router==\([0-9A-Za-z.+_-]*\)[[:space:]]*$/\1/p' \
    "$SRC/installer/router-requirements.txt" | head -n 1)
  modelled=$(sed -n 's/^SGLANG_ROUTER_VERSION = "\([^"]*\)".*$/\1/p' \
    "$SRC/appliance/cell/router.py")
  if [[ -z $ROUTER_PIN || $ROUTER_PIN != "$modelled" ]]; then
    die "installer/router-requirements.txt pins sglang-router '${ROUTER_PIN}' but the daemon writes the command line of '${modelled}'" \
      "pin sglang-router==${modelled} in installer/router-requirements.txt"
  fi
}

# --------------------------------------------------------------------------- preflight

report() {  # report PASS|FAIL|WARN|SKIP NAME DETAIL [FIX]
  printf '  %-4s  %-14s %s\n' "$1" "$2" "$3"
  if [[ $1 == FAIL ]]; then
    FAILS=$((FAILS + 1))
    if [[ -n ${4:-} ]]; then printf '        fix: %s\n' "$4"; fi
  elif [[ $1 == WARN && -n ${4:-} ]]; then
    printf '        note: %s\n' "$4"
  fi
}

version_ge() {  # version_ge A B: A >= B
  [[ $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1) == "$2" ]]
}

os_field() {
  sed -n "s/^$1=//p" "$OS_RELEASE" | head -n 1 | tr -d "\"'"
}

check_root() {
  if [[ $EUID -eq 0 ]]; then report PASS root "running as root"
  else report FAIL root "running as uid $EUID" "run it with sudo"; fi
}

check_os() {
  local id="" version="" arch status=FAIL
  if [[ -r $OS_RELEASE ]]; then
    id=$(os_field ID)
    version=$(os_field VERSION_ID)
  fi
  arch=$(uname -m)
  if [[ $id == ubuntu && $version == 24.04 && $arch == x86_64 ]]; then
    report PASS os "Ubuntu 24.04 $arch"
    return
  fi
  if ((ALLOW_OS)); then status=WARN; fi
  report "$status" os "found ${id:-unknown} ${version:-?} $arch (from $OS_RELEASE); expected Ubuntu 24.04 x86_64" \
    "install on Ubuntu 24.04 LTS x86_64, or pass --allow-unsupported-os at your own risk"
}

check_systemd() {
  if [[ -n $ROOT ]]; then
    report SKIP systemd "staging into --root $ROOT: the host's service manager is not used"
    return
  fi
  local state=""
  state=$(systemctl is-system-running 2>/dev/null || true)
  case $state in
    running | degraded | starting | initializing)
      report PASS systemd "systemd is the service manager ($state)" ;;
    *)
      if ((NO_START)); then
        report WARN systemd "systemd is not running as PID 1 (${state:-no answer})" \
          "--no-start: files are laid down, nothing is started"
      else
        report FAIL systemd "systemd is not running as PID 1 (${state:-no answer})" \
          "install on a host booted with systemd, or pass --no-start to only lay files down"
      fi ;;
  esac
}

check_gpus() {
  DRIVER=""
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    report FAIL driver "nvidia-smi not found: no NVIDIA driver" \
      "install the NVIDIA datacenter driver >= $MIN_DRIVER and its fabric manager (this installer never installs drivers)"
    report FAIL gpus "cannot count GPUs without the driver" "see driver above"
    return
  fi
  local out
  if ! out=$(nvidia-smi --query-gpu=driver_version,name --format=csv,noheader 2>&1); then
    report FAIL driver "nvidia-smi failed: $(head -n 1 <<<"$out")" \
      "check that the driver is loaded (nvidia-smi; reboot after a driver install)"
    report FAIL gpus "cannot count GPUs" "see driver above"
    return
  fi
  local count=0 wrong=0 line name names=""
  while IFS= read -r line; do
    [[ -n ${line//[[:space:]]/} ]] || continue
    count=$((count + 1))
    if [[ -z $DRIVER ]]; then DRIVER=$(sed 's/,.*//; s/[[:space:]]//g' <<<"$line"); fi
    name=${line#*,}
    name=${name#"${name%%[![:space:]]*}"}
    if [[ $name != *"$EXPECT_MODEL"* ]]; then wrong=$((wrong + 1)); fi
    if [[ $names != *"$name"* ]]; then names+="${names:+, }$name"; fi
  done <<<"$out"
  if [[ -z $DRIVER ]]; then
    report FAIL driver "nvidia-smi listed no GPUs" "check the GPUs and the driver (nvidia-smi -L)"
  elif version_ge "$DRIVER" "$MIN_DRIVER"; then
    report PASS driver "NVIDIA driver $DRIVER (>= $MIN_DRIVER)"
  else
    report FAIL driver "NVIDIA driver $DRIVER is older than $MIN_DRIVER" \
      "upgrade the driver (and the fabric manager of the same version) yourself, then re-run; --min-driver overrides"
  fi
  local status=FAIL
  if ((ALLOW_GPUS)); then status=WARN; fi
  if ((count == EXPECT_GPUS && wrong == 0)); then
    report PASS gpus "$count x $names"
  else
    report "$status" gpus "found $count GPU(s) ($names), $wrong not matching '$EXPECT_MODEL'; expected $EXPECT_GPUS x $EXPECT_MODEL" \
      "check nvidia-smi -L (a lost GPU needs the vendor); for another box pass --allow-gpus or --gpus/--gpu-model"
  fi
}

fabricmanager_version() {
  if command -v nv-fabricmanager >/dev/null 2>&1; then
    { nv-fabricmanager --version 2>/dev/null || true; } | grep -Eo '[0-9]+(\.[0-9]+)+' | head -n 1 || true
  elif command -v dpkg-query >/dev/null 2>&1; then
    { dpkg-query -W -f='${Version}\n' 'nvidia-fabricmanager*' 2>/dev/null || true; } |
      grep -Eo '^[0-9]+(\.[0-9]+)+' | head -n 1 || true
  fi
}

check_fabricmanager() {
  local status=FAIL state version
  if ((ALLOW_GPUS)); then status=WARN; fi
  state=$(systemctl is-active nvidia-fabricmanager.service 2>/dev/null || true)
  version=$(fabricmanager_version)
  if [[ $state != active ]]; then
    report "$status" fabricmanager "nvidia-fabricmanager is ${state:-unknown}, not active" \
      "install nvidia-fabricmanager of the driver's version ($DRIVER) and run: systemctl enable --now nvidia-fabricmanager"
  elif [[ -z $version ]]; then
    report "$status" fabricmanager "active, but its version is unknown (no nv-fabricmanager, no package)" \
      "install the nvidia-fabricmanager package matching driver $DRIVER"
  elif [[ -n $DRIVER && $version != "$DRIVER" ]]; then
    report "$status" fabricmanager "fabric manager $version does not match driver $DRIVER" \
      "install the nvidia-fabricmanager package of exactly version $DRIVER, then restart it"
  else
    report PASS fabricmanager "active, version $version"
  fi
}

pick_python() {
  local candidate
  if [[ -z $PY ]]; then
    for candidate in python3.12 python3.13 python3.11 python3; do
      if command -v "$candidate" >/dev/null 2>&1; then PY=$(command -v "$candidate"); break; fi
    done
  elif [[ $PY != */* ]] && command -v "$PY" >/dev/null 2>&1; then
    PY=$(command -v "$PY")
  fi
}

check_python() {
  PY_OK=0 HAVE_ENSUREPIP=0 PIP_WHEEL=""
  pick_python
  if [[ -z $PY || ! -x $PY ]]; then
    report FAIL python "no Python found${PY:+ at $PY}" "apt install python3.12 python3.12-venv, or pass --python PATH"
    return
  fi
  local version
  if ! version=$(cd / && "$PY" -c 'import sys, venv
assert sys.version_info >= (3, 11), sys.version
print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    report FAIL python "$PY is not a usable Python 3.11 or newer with the venv module" \
      "apt install python3.12 python3.12-venv, or pass --python PATH"
    return
  fi
  PY_MINOR=$version
  if (cd / && "$PY" -c 'import ensurepip' >/dev/null 2>&1); then
    HAVE_ENSUREPIP=1
  elif [[ -n $OFFLINE ]]; then
    PIP_WHEEL=$(compgen -G "$OFFLINE/pip-*.whl" | sort -V | tail -n 1 || true)
  fi
  if ((HAVE_ENSUREPIP)) || [[ -n $PIP_WHEEL ]]; then
    PY_OK=1
    report PASS python "$PY (Python $version)"
  else
    report FAIL python "$PY has no ensurepip, so new environments get no pip" \
      "apt install python${version}-venv, or install --offline from a bundle (its wheelhouse carries pip)"
  fi
}

check_tools() {
  local tool missing=()
  for tool in systemctl systemd-sysusers systemd-tmpfiles setpriv flock sha256sum numfmt df du \
    tar realpath; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    report FAIL tools "missing: ${missing[*]}" "apt install systemd util-linux coreutils tar"
  else
    report PASS tools "systemd-sysusers, systemd-tmpfiles, setpriv, flock, coreutils"
  fi
}

check_polkit() {
  if [[ -x /usr/lib/polkit-1/polkitd || -x /usr/libexec/polkitd ]] || command -v pkcheck >/dev/null 2>&1; then
    report PASS polkit "polkitd is installed (the daemon starts the engine unit with its permission)"
  else
    report WARN polkit "polkitd not found: the daemon cannot start or stop the engine until it is" \
      "apt install polkitd (it reads $POLKIT)"
  fi
}

check_bundle() {
  if [[ -f $SRC/SHA256SUMS ]]; then
    local out
    if out=$(cd "$SRC" && sha256sum --check --strict --quiet SHA256SUMS 2>&1); then
      report PASS bundle "appliance $VERSION; every file matches SHA256SUMS"
    else
      report FAIL bundle "files differ from SHA256SUMS: $(head -n 3 <<<"$out" | tr '\n' ' ')" \
        "download and unpack the bundle again"
    fi
  else
    report PASS bundle "appliance $VERSION from $SRC (a checkout: no SHA256SUMS to verify)"
  fi
  if [[ -n $OFFLINE ]]; then
    if ! compgen -G "$OFFLINE/*.whl" >/dev/null; then
      report FAIL wheelhouse "no wheels in $OFFLINE" \
        "point --offline at the bundle's wheelhouse/ (installer/build-bundle.sh makes one)"
    elif [[ -f $OFFLINE/SHA256SUMS && $OFFLINE != "$SRC"/* ]] &&
      ! (cd "$OFFLINE" && sha256sum --check --strict --quiet SHA256SUMS >/dev/null 2>&1); then
      report FAIL wheelhouse "files in $OFFLINE differ from its SHA256SUMS" \
        "copy the wheelhouse again"
    else
      report PASS wheelhouse "$OFFLINE (offline: pip uses only this directory)"
    fi
  fi
}

nearest_existing() {
  local path=$1
  while [[ ! -e $path && $path != / ]]; do path=$(dirname "$path"); done
  printf '%s' "$path"
}

check_disk() {
  local models=${CFG_paths_models_dir} need avail used=0 probe dir
  dir=$(r "$models")
  if ! need=$(numfmt --from=auto "$MIN_MODELS_FREE" 2>/dev/null); then
    report FAIL disk "--min-models-free '$MIN_MODELS_FREE' is not a size" "use e.g. 1.7T, 500G or bytes"
    return
  fi
  probe=$(nearest_existing "$dir")
  avail=$(df -B1 --output=avail "$probe" | tail -n 1 | tr -d '[:space:]')
  if [[ -d $dir ]]; then used=$({ du -sB1 "$dir" 2>/dev/null || echo 0; } | cut -f 1); fi
  local shown_avail shown_need there=""
  shown_avail=$(numfmt --to=si "$avail")
  shown_need=$(numfmt --to=si "$need")
  if ((used > 0)); then there=" (+$(numfmt --to=si "$used") of models already there)"; fi
  if ((avail + used >= need)); then
    report PASS disk "$shown_avail free for $models$there, need $shown_need"
  else
    report FAIL disk "only $shown_avail free for $models (on the volume of $probe), need $shown_need" \
      "free space or mount a larger volume at $models (the weights alone are 1.56 TB); --min-models-free overrides"
  fi
}

# Values from the installed config (or the defaults), as CFG_<section>_<key>.
read_config_values() {
  local out line
  out=$(cd / && "$PY" "$SRC/installer/configfile.py" values "$SRC" "$(r "$CONFIG")") || return 1
  while IFS= read -r line; do
    printf -v "CFG_${line%%=*}" '%s' "${line#*=}"
  done <<<"$out"
}

preflight() {
  say "preflight (appliance $VERSION):"
  FAILS=0
  check_root
  check_os
  check_systemd
  check_gpus
  check_fabricmanager
  check_python
  if ((PY_OK)) && ! read_config_values; then
    report FAIL config "cannot read $(r "$CONFIG")" "fix its TOML syntax (docs/configuration.md)"
  fi
  check_disk
  check_tools
  check_polkit
  check_bundle
}

# ------------------------------------------------------------------ files and ownership

id_of() {  # id_of passwd|group NAME: the numeric id in the target root
  if [[ $2 == root ]]; then printf 0; return; fi
  awk -F: -v n="$2" '$1 == n { print $3; found = 1; exit } END { exit !found }' "$(r "/etc/$1")"
}

owner() {  # owner USER GROUP: uid:gid in the target root
  local uid gid
  uid=$(id_of passwd "$1") || die "user $1 does not exist in $(r /etc/passwd)" \
    "systemd-sysusers did not create it; check $(r "$SYSUSERS")"
  gid=$(id_of group "$2") || die "group $2 does not exist in $(r /etc/group)" \
    "systemd-sysusers did not create it; check $(r "$SYSUSERS")"
  printf '%s:%s' "$uid" "$gid"
}

write_atomic() {  # write_atomic SOURCE DEST MODE UID:GID
  local tmp
  mkdir -p "$(dirname "$2")"
  tmp=$(mktemp "$2.tmp.XXXXXX")
  cat -- "$1" >"$tmp"
  chmod "$3" "$tmp"
  chown "$4" "$tmp"
  sync "$tmp" 2>/dev/null || true
  mv -f -- "$tmp" "$2"
}

shipped_record() { r "$OPT/installer/shipped.sha256"; }

record_shipped() {  # remember what was shipped at DEST, to tell later whether someone edited it
  local dest=$1 sum record
  ((DRY_RUN)) && return 0
  sum=$(sha256sum <"$(r "$dest")" | cut -d ' ' -f 1)
  record=$(shipped_record)
  mkdir -p "$(dirname "$record")"
  touch "$record"
  { grep -v "  $dest\$" "$record" || true; printf '%s  %s\n' "$sum" "$dest"; } >"$record.tmp"
  mv -f "$record.tmp" "$record"
}

# install_file SOURCE DEST MODE USER GROUP: sets WROTE=1 when DEST was (or would be) written.
# (A status would do, but a function called as a condition runs without errexit.)
install_file() {
  local src=$1 dest=$2 mode=$3 target ids
  WROTE=0
  target=$(r "$dest")
  if [[ -f $target && ! -L $target ]] && cmp -s "$src" "$target"; then
    set_mode "$dest" "$mode" "$4" "$5"
    return 0
  fi
  local what="new"
  if [[ -e $target ]]; then
    what="changed"
    local was recorded
    was=$(sha256sum <"$target" | cut -d ' ' -f 1)
    recorded=$(grep "  $dest\$" "$(shipped_record)" 2>/dev/null | cut -d ' ' -f 1 || true)
    if [[ -n $recorded && $was != "$recorded" ]]; then
      local keep
      keep=$(r "$OPT/installer/replaced")/$(basename "$dest").$(date +%Y%m%dT%H%M%S)
      warn "$dest was edited by hand; the edit is kept in $keep. Put local changes in drop-ins ($DROPIN_DIR/<unit>.d/*.conf), which the installer never touches"
      act "keep the edited $dest as $keep" install -D -m 0600 "$target" "$keep"
    fi
  fi
  if ((DRY_RUN)); then
    say "would write $dest ($what)"
  else
    ids=$(owner "$4" "$5")
    write_atomic "$src" "$target" "$mode" "$ids"
    record_shipped "$dest"
  fi
  changed "$dest ($what)"
  WROTE=1
}

set_mode() {  # set_mode PATH MODE USER GROUP: fix an existing file's mode and owner
  local target ids
  target=$(r "$1")
  ids=$(owner "$3" "$4")
  if [[ $(stat -c '%a %u:%g' "$target") == "${2#0} $ids" ]]; then return 0; fi
  if ((DRY_RUN)); then
    say "would set $1 to $2 $3:$4"
  else
    chmod "$2" "$target"
    chown "$ids" "$target"
  fi
  changed "$1: mode and owner set to $2 $3:$4"
}

ensure_dir() {  # ensure_dir DIR MODE USER GROUP
  local target
  target=$(r "$1")
  if [[ -d $target ]]; then return 0; fi
  if ((DRY_RUN)); then say "would create $1/"; changed "$1/ (new)"; return 0; fi
  mkdir -p "$target"
  chmod "$2" "$target"
  chown "$(owner "$3" "$4")" "$target"
  changed "$1/ (new)"
}

# ---------------------------------------------------------------------------- systemd

systemctl_root() {
  if [[ -n $ROOT ]]; then systemctl --root="$ROOT" "$@"; else systemctl "$@"; fi
}

# svc VERB UNIT...: a systemctl call that changes something. Never the engine, except the
# uninstaller's explicit --stop-engine.
svc() {
  local verb=$1 unit
  shift
  for unit in "$@"; do
    if [[ $unit == "$ENGINE" && ! ($verb == stop && $ACTION == uninstall && $STOP_ENGINE == 1) ]]; then
      die "internal error: refusing 'systemctl $verb $ENGINE' (only the daemon starts and stops the engine)"
    fi
    if [[ $unit == "$ROUTER" && $verb != try-restart && $verb != stop ]]; then
      die "internal error: refusing 'systemctl $verb $ROUTER' (the daemon starts the router on a cell's head)"
    fi
  done
  if ((DRY_RUN)); then say "would run: systemctl $verb $*"; return 0; fi
  if systemctl_root "$verb" "$@"; then return 0; fi
  if [[ -n $ROOT ]]; then
    warn "systemctl --root=$ROOT $verb $* failed: a staging root has no service manager; skipped"
    return 0
  fi
  die "systemctl $verb $* failed" "see: systemctl status $*; journalctl -u ${1%.service} -n 50"
}

is_active() { systemctl_root is-active --quiet "$1" 2>/dev/null; }
is_enabled() { systemctl_root is-enabled --quiet "$1" 2>/dev/null; }

# -------------------------------------------------------------- releases and environments

tree_hash() {  # tree_hash DIR PATH...: one sha256 over the files, their names included
  (
    cd "$1"
    shift
    find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
      xargs -0 sha256sum
  ) | sha256sum | cut -d ' ' -f 1
}

complete_hash() { cat "$1/.complete" 2>/dev/null || true; }

# pick_build BASEDIR NAME HASH: the directory name for content HASH, reusing a finished one.
# NAME when it is free or holds the same content, else NAME+<hash prefix> (same version,
# different content: a build of its own, so nothing in use is ever rebuilt in place).
pick_build() {
  local base=$1 name=$2 hash=$3 alt
  alt="$name+${hash:0:8}"
  if [[ $(complete_hash "$base/$name") == "$hash" ]]; then printf '%s' "$name"
  elif [[ $(complete_hash "$base/$alt") == "$hash" ]]; then printf '%s' "$alt"
  elif [[ -e $base/$name/.complete ]]; then printf '%s' "$alt"
  else printf '%s' "$name"; fi
}

link_target() { readlink "$(r "$1")" 2>/dev/null || true; }

flip_link() {  # flip_link LINK TARGET: atomically point LINK at TARGET (relative)
  local link
  link=$(r "$1")
  if [[ $(readlink "$link" 2>/dev/null || true) == "$2" ]]; then return 0; fi
  if ((DRY_RUN)); then say "would point $1 at $2"; return 0; fi
  ln -sfn -- "$2" "$link.tmp.$$"
  mv -T -- "$link.tmp.$$" "$link"
}

pip_install() {  # pip_install VENV ARGS...
  local venv=$1
  shift
  local -a options=(--disable-pip-version-check --no-input --progress-bar off)
  if [[ -n $OFFLINE ]]; then
    options+=(--no-index --find-links "$OFFLINE")
    (cd / && PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null HF_HUB_OFFLINE=1 \
      "$venv/bin/python" -m pip install "${options[@]}" "$@")
  else
    (cd / && "$venv/bin/python" -m pip install "${options[@]}" "$@")
  fi
}

make_venv() {
  local dir=$1
  if ((HAVE_ENSUREPIP)); then
    (cd / && "$PY" -m venv "$dir")
  else
    (cd / && "$PY" -m venv --without-pip "$dir")
    (cd / && PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null "$dir/bin/python" "$PIP_WHEEL/pip" \
      install --disable-pip-version-check --no-input --quiet --no-index --find-links "$OFFLINE" pip)
  fi
}

finish_build() {  # the marker, written last: only a finished build has it
  sync -f "$1" 2>/dev/null || sync
  printf '%s\n' "$2" >"$1/.complete.tmp"
  mv -f "$1/.complete.tmp" "$1/.complete"
}

# build_env DIR REQUIREMENTS DISTRIBUTION PIN: a new virtual environment in DIR with the
# pinned requirements, checked to hold DISTRIBUTION at exactly PIN. The caller checks the rest
# and finishes the build.
build_env() {
  local dir=$1 requirements=$2 dist=$3 pin=$4 got
  rm -rf -- "$dir"
  mkdir -p "$dir"
  make_venv "$dir"
  cp "$requirements" "$dir/requirements.txt"
  pip_install "$dir" -r "$dir/requirements.txt"
  got=$(cd / && "$dir/bin/python" -c 'import importlib.metadata as m, sys
print(m.version(sys.argv[1]))' "$dist")
  if [[ $got != "$pin" ]]; then
    die "the environment $dir has $dist $got, not $pin" "check installer/$(basename "$requirements")"
  fi
}

freeze_and_finish() {  # freeze_and_finish DIR HASH: what pip installed, then the marker
  (cd / && "$1/bin/python" -m pip freeze --all >"$1/requirements.freeze" 2>/dev/null || true)
  finish_build "$1" "$2"
}

build_engine() {
  local dir=$1
  build_env "$dir" "$SRC/installer/engine-requirements.txt" sglang "$PIN"
  [[ -x $dir/bin/sglang ]] || die "the engine environment has no bin/sglang" "reinstall sglang"
  freeze_and_finish "$dir" "$ENV_HASH"
}

# The router's environment: the daemon's spec runs its python with -m sglang_router.launch_router
# (appliance/cell/router.py), so that module must import, its compiled part included.
build_router() {
  local dir=$1
  build_env "$dir" "$SRC/installer/router-requirements.txt" sglang-router "$ROUTER_PIN"
  if ! (cd / && "$dir/bin/python" -c 'import sglang_router.launch_router') >/dev/null; then
    die "the router environment $dir cannot import sglang_router.launch_router" \
      "read the error above: a wheel for another platform or Python (build the bundle on a machine like this one)"
  fi
  freeze_and_finish "$dir" "$ENV_HASH"
}

# ensure_env WHAT SUBDIR NAME REQUIREMENTS DETAIL BUILDER: sets ENV_KEY, the name under
# $OPT/SUBDIR of a finished environment for REQUIREMENTS (and this Python and layout), and
# builds it with BUILDER DIR unless one is there. ENV_HASH is its content hash.
ensure_env() {
  local what=$1 sub=$2 name=$3 requirements=$4 detail=$5 builder=$6 base
  ENV_HASH=$({ printf 'layout %s\npython %s\n' "$LAYOUT" "$PY_MINOR"
    cat "$requirements"; } | sha256sum | cut -d ' ' -f 1)
  base=$(r "$OPT/$sub")
  ENV_KEY=$(pick_build "$base" "$name" "$ENV_HASH")
  if [[ $(complete_hash "$base/$ENV_KEY") == "$ENV_HASH" ]]; then
    say "$what $OPT/$sub/$ENV_KEY is built; reusing it"
    return 0
  fi
  if [[ -e $base/$ENV_KEY ]]; then say "removing the unfinished build $OPT/$sub/$ENV_KEY"; fi
  act "build the $what $OPT/$sub/$ENV_KEY ($detail)" "$builder" "$base/$ENV_KEY"
  changed "$what $OPT/$sub/$ENV_KEY (new)"
}

ensure_engine() {
  ENGINE_KEY=""
  if ((NO_ENGINE)); then
    note "engine environment: not built (--no-engine); $OPT/engine must provide bin/sglang"
    return 0
  fi
  step "engine environment (sglang==$PIN)"
  ensure_env "engine environment" engines "sglang-$PIN" \
    "$SRC/installer/engine-requirements.txt" "sglang==$PIN; several GB" build_engine
  ENGINE_KEY=$ENV_KEY
}

# Every box gets the router (a small venv), so any box can become a cell's head.
ensure_router() {
  step "router environment (sglang-router==$ROUTER_PIN)"
  ensure_env "router environment" routers "sglang-router-$ROUTER_PIN" \
    "$SRC/installer/router-requirements.txt" "sglang-router==$ROUTER_PIN" build_router
  ROUTER_KEY=$ENV_KEY
}

write_launcher() {  # the console script: the release's own code through its own venv
  cat >"$1/venv/bin/appliance" <<EOF
#!$1/venv/bin/python
# The appliance command of release $2, written by the installer: the code is $1/appliance
# (found through site-packages/appliance-release.pth), beside migrations/ and web/.
import sys

from appliance.cli import main

if __name__ == "__main__":
    sys.exit(main())
EOF
  chmod 0755 "$1/venv/bin/appliance"
}

build_release() {
  local dir=$1 id=$2 site got
  rm -rf -- "$dir"
  mkdir -p "$dir"
  # the package and what it finds beside it (appliance/resources.py), and the installer and
  # units, so that /opt/appliance/current/installer/install.sh can roll back or uninstall
  tar -C "$SRC" --exclude=__pycache__ --exclude='*.pyc' -cf - appliance migrations web \
    pyproject.toml installer systemd | tar -C "$dir" --no-same-owner -xf -
  rm -f "$dir/SHA256SUMS"
  chmod -R u+rwX,go+rX,go-w "$dir"
  printf '%s\n' "$VERSION" >"$dir/VERSION"
  printf '%s\n' "${ENGINE_KEY:-}" >"$dir/ENGINE"
  printf '%s\n' "${ROUTER_KEY:-}" >"$dir/ROUTER"
  (cd / && "$PY" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$dir/pyproject.toml") >"$dir/requirements.txt"
  make_venv "$dir/venv"
  pip_install "$dir/venv" -r "$dir/requirements.txt"
  site=$(cd / && "$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf '%s\n' "$dir" >"$site/appliance-release.pth"
  write_launcher "$dir" "$id"
  (cd / && "$dir/venv/bin/python" -m compileall -q -j 0 "$dir/appliance" "$dir/migrations" >/dev/null)
  (cd / && "$dir/venv/bin/python" -m pip freeze --all >"$dir/requirements.freeze" 2>/dev/null || true)
  got=$(cd / && "$dir/venv/bin/python" -m appliance --version)
  if [[ $got != "appliance $VERSION" ]]; then
    die "the new release answers '$got' to --version, not 'appliance $VERSION'" \
      "check the pip output above"
  fi
  got=$(cd / && "$dir/venv/bin/python" -c 'from appliance import resources as r
r.migrations_dir(); r.templates_dir(); r.static_dir(); print(r.project_root())')
  if [[ $got != "$(realpath "$dir")" ]]; then
    die "the new release runs code from $got, not from $dir" \
      "another 'appliance' package shadows the release; check the Python given with --python"
  fi
  (cd "$dir" && find . -path ./venv -prune -o -type f -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum >"$dir.MANIFEST")
  mv -f "$dir.MANIFEST" "$dir/MANIFEST"
  finish_build "$dir" "$RELEASE_HASH"
}

ensure_release() {
  step "release $VERSION"
  RELEASE_HASH=$({ printf 'layout %s\npython %s\n' "$LAYOUT" "$PY_MINOR"
    tree_hash "$SRC" appliance migrations web pyproject.toml; } | sha256sum | cut -d ' ' -f 1)
  local releases
  releases=$(r "$OPT/releases")
  RELEASE_ID=$(pick_build "$releases" "$VERSION" "$RELEASE_HASH")
  if [[ $(complete_hash "$releases/$RELEASE_ID") == "$RELEASE_HASH" ]]; then
    say "release $RELEASE_ID is built; reusing it"
    return 0
  fi
  if [[ $RELEASE_ID != "$VERSION" ]]; then
    note "release $VERSION is already installed with different content; this one is $RELEASE_ID"
  fi
  if [[ -e $releases/$RELEASE_ID ]]; then say "removing the unfinished build $OPT/releases/$RELEASE_ID"; fi
  act "build release $RELEASE_ID in $OPT/releases/$RELEASE_ID" build_release "$releases/$RELEASE_ID" "$RELEASE_ID"
  changed "release $RELEASE_ID (new)"
}

# ------------------------------------------------------------------------------ steps

lock_install() {
  ((DRY_RUN)) && return 0
  mkdir -p "$(r "$OPT/installer")"
  exec {LOCK_FD}>>"$(r "$OPT/installer/lock")"  # >>: opening leaves the file as it was
  if ! flock -n "$LOCK_FD"; then
    die "another install.sh is running on this box" "wait for it to finish"
  fi
}

pending_file() { r "$OPT/installer/pending"; }

unmark_pending() {
  local file
  file=$(pending_file)
  [[ -f $file ]] || return 0
  { grep -vx "$1" "$file" || true; } >"$file.tmp"
  mv -f "$file.tmp" "$file"
}

mark_pending() {  # mark_pending WORD: work a re-run must finish if this run is cut short
  ((DRY_RUN)) && return 0
  if grep -qx "$1" "$(pending_file)" 2>/dev/null; then return 0; fi
  printf '%s\n' "$1" >>"$(pending_file)"
  sync "$(pending_file)" 2>/dev/null || true
}

system_files() {
  step "system users, directories, units and policy"
  local src=$SRC/systemd
  if [[ ! -e $(r "$UNIT_DIR/$DAEMON") ]]; then FRESH=1; fi
  if ((FRESH)); then mark_pending fresh; fi
  local -a in_root=()
  if [[ -n $ROOT ]]; then
    in_root=(--root="$ROOT")
    if [[ ! -d $ROOT/etc ]]; then act "create $ROOT/etc (a new staging root)" mkdir -p "$ROOT/etc"; fi
  fi
  install_file "$src/appliance.sysusers.conf" "$SYSUSERS" 0644 root root
  if ((WROTE || FRESH)); then
    act "create the system users (systemd-sysusers)" \
      systemd-sysusers "${in_root[@]}" "$(basename "$SYSUSERS")"
  fi
  install_file "$src/appliance.tmpfiles.conf" "$TMPFILES" 0644 root root
  if ((WROTE || FRESH)); then
    act "create the directories (systemd-tmpfiles --create)" \
      systemd-tmpfiles "${in_root[@]}" --create "$(basename "$TMPFILES")"
  fi
  local unit
  for unit in "$DAEMON" "$GATEWAY_SOCKET" "$GATEWAY" "$ENGINE" "$ROUTER"; do
    install_file "$src/$unit" "$UNIT_DIR/$unit" 0644 root root
    if ((WROTE)); then unit_written "$unit"; fi
  done
  # vendor drop-ins shipped in systemd/<unit>.d/ (operators' own live in /etc/systemd/system)
  local dropin
  for dropin in "$src"/*.service.d/*.conf; do
    [[ -e $dropin ]] || continue
    unit=$(basename "$(dirname "$dropin")")
    install_file "$dropin" "$UNIT_DIR/$unit/$(basename "$dropin")" 0644 root root
    if ((WROTE)); then unit_written "$unit"; fi
  done
  install_file "$src/50-appliance-engine.rules" "$POLKIT" 0644 root root
}

unit_written() {  # unit_written UNIT|UNIT.d: a unit file or one of its vendor drop-ins changed
  UNITS_CHANGED=1
  case $1 in
    "$GATEWAY_SOCKET") SOCKET_UNIT_CHANGED=1 ;;
    "$GATEWAY_SOCKET.d") LISTEN_CHANGED=1; mark_pending listen ;;
  esac
  case ${1%.d} in
    "$DAEMON") DAEMON_UNIT_CHANGED=1 ;;
    "$GATEWAY") GATEWAY_UNIT_CHANGED=1 ;;
    "$ENGINE") ENGINE_UNIT_CHANGED=1 ;;
    "$ROUTER") ROUTER_UNIT_CHANGED=1 ;;
  esac
}

# The gateway's listening socket (appliance-gateway.socket) must listen where the config says
# the gateway does (the gateway refuses any other, exit 78): listen.conf, the socket's vendor
# drop-in, is written from gateway.host:gateway.port at every run.
gateway_listen() {
  local host=$CFG_gateway_host port=$CFG_gateway_port address generated
  if [[ $host == *:* ]]; then
    address="[$host]:$port"
  elif [[ $host =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]]; then
    address="$host:$port"
  else
    die "gateway.host in $CONFIG is \"$host\", a name: the gateway's socket unit needs an address" \
      "set gateway.host to an IP address of this box (0.0.0.0: all IPv4 addresses; ::, all IPv6), then run the installer again"
  fi
  generated=$(mktemp)
  printf '%s\n' "# Written by the installer from gateway.host and gateway.port in $CONFIG at every run:" \
    "# change those and run the installer again (the gateway refuses a socket elsewhere)." \
    "[Socket]" "ListenStream=" "ListenStream=$address" >"$generated"
  install_file "$generated" "$UNIT_DIR/$GATEWAY_SOCKET.d/listen.conf" 0644 root root
  rm -f "$generated"
  if ((WROTE)); then unit_written "$GATEWAY_SOCKET.d"; fi
}

# The engine unit's RDMA devices (systemd/appliance-engine-rdma.conf, as the drop-in
# appliance-engine.service.d/rdma.conf) for a prefill or decode box, configured (cell.role) or
# chosen by its head (<state_dir>/cell/role); a unified box's drop-in is removed, so its engine
# keeps the NVIDIA devices only. The engine's next start picks it up (services() says so).
engine_rdma() {
  local role=$CFG_cell_role chosen="" dest="$UNIT_DIR/$ENGINE.d/rdma.conf" file
  file=$(r "$CFG_paths_state_dir/cell/role")
  if [[ -f $file ]]; then chosen=$(tr -d '[:space:]' <"$file" || true); fi
  case $chosen in unified | prefill | decode) role=$chosen ;; esac
  if [[ $role == prefill || $role == decode ]]; then
    install_file "$SRC/systemd/appliance-engine-rdma.conf" "$dest" 0644 root root
    if ((WROTE)); then unit_written "$ENGINE.d"; fi
  elif [[ -e $(r "$dest") ]]; then
    act "remove $dest (a unified box's engine needs no RDMA device)" rm -f -- "$(r "$dest")"
    changed "$dest (removed: cell role $role)"
    unit_written "$ENGINE.d"
  fi
}

configuration() {
  step "configuration"
  ensure_dir "$ETC" 0750 root "$USER_NAME"
  local generated sum record recorded config
  generated=$(mktemp)
  (cd / && "$PY" "$SRC/installer/configfile.py" default "$SRC") >"$generated"
  sum=$(sha256sum <"$generated" | cut -d ' ' -f 1)
  record=$(r "$OPT/installer/config-defaults.sha256")
  recorded=$(cat "$record" 2>/dev/null || true)
  config=$(r "$CONFIG")
  if [[ ! -e $config ]]; then
    if ((DRY_RUN)); then say "would write $CONFIG (new, 0640 root:$USER_NAME)"
    else write_atomic "$generated" "$config" 0640 "$(owner root "$USER_NAME")"; fi
    changed "$CONFIG (new)"
  elif [[ $sum != "$recorded" ]] && ! cmp -s "$generated" "$config"; then
    if ! cmp -s "$generated" "$config.new"; then
      if ((DRY_RUN)); then say "would write $CONFIG.new (this release's defaults)"
      else write_atomic "$generated" "$config.new" 0640 "$(owner root "$USER_NAME")"; fi
      changed "$CONFIG.new (this release's defaults; $CONFIG is yours and was kept)"
      note "new configuration defaults: compare with  diff $CONFIG $CONFIG.new"
    fi
  fi
  if ((!DRY_RUN)) && [[ $sum != "$recorded" ]]; then
    mkdir -p "$(dirname "$record")"
    printf '%s\n' "$sum" >"$record"
  fi
  rm -f "$generated"
  if [[ -e $config ]]; then set_mode "$CONFIG" 0640 root "$USER_NAME"; fi
}

# private_modes: the daemon writes its secrets 0600 in a 0700 dir; keep it that way. These
# paths lie in the state directory, which the service user owns: root never follows a link
# there (a planted secrets/server.key -> /etc/shadow would have root chmod that file). Links
# are refused with a warning, and the modes are set as the service user itself (its own
# files; setpriv, as for the migration), so even a link swapped in between the check and the
# chmod gets no more than that user's own power.
private_modes() {
  local state file uid gid
  state=$(r "${CFG_paths_state_dir}")
  uid=$(id_of passwd "$USER_NAME") || return 0  # no service user yet: nothing of its own
  gid=$(id_of group "$USER_NAME") || return 0
  as_service_user() { (cd / && setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"); }
  if [[ -L $state/secrets ]]; then
    warn "${CFG_paths_state_dir}/secrets is a symbolic link; left alone (the installer never follows links in the service user's directories): remove it and restart the daemon"
    return 0
  fi
  if [[ -d $state/secrets && $(stat -c %a "$state/secrets") != 700 ]]; then
    act "set ${CFG_paths_state_dir}/secrets to 0700" as_service_user chmod 0700 "$state/secrets"
    changed "${CFG_paths_state_dir}/secrets: mode set to 0700"
  fi
  for file in "$state"/secrets/* "$state/bootstrap-admin.txt"; do
    if [[ -L $file ]]; then
      warn "${file#"$ROOT"} is a symbolic link; left alone (the installer never follows links in the service user's directories)"
      continue
    fi
    [[ -f $file ]] || continue
    if [[ $(stat -c %a "$file") != 600 ]]; then
      act "set ${file#"$ROOT"} to 0600" as_service_user chmod 0600 "$file"
      changed "${file#"$ROOT"}: mode set to 0600"
    fi
  done
}

# The database migration, as the daemon's user, with the new release's own CLI (it copies an
# SQLite database to <state_dir>/backups first and puts it back if a step fails).
migrate() {
  local dir=$1 uid gid out status=0
  # called as a condition, so without errexit: every step says how it fails
  uid=$(id_of passwd "$USER_NAME") || { echo "  no user $USER_NAME"; return 1; }
  gid=$(id_of group "$USER_NAME") || { echo "  no group $USER_NAME"; return 1; }
  local -a env=(PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME=/nonexistent)
  if [[ -n $ROOT ]]; then  # the config's paths are the box's; a staging root prefixes them
    env+=("APPLIANCE_PATHS_STATE_DIR=$(r "$CFG_paths_state_dir")"
      "APPLIANCE_PATHS_LOG_DIR=$(r "$CFG_paths_log_dir")"
      "APPLIANCE_PATHS_MODELS_DIR=$(r "$CFG_paths_models_dir")")
  fi
  out=$(cd / && setpriv --reuid="$uid" --regid="$gid" --clear-groups -- \
    env -i "${env[@]}" "$dir/venv/bin/python" -m appliance migrate --config "$(r "$CONFIG")" 2>&1) ||
    status=$?
  if [[ -n $out ]]; then printf '%s\n' "$out" | sed 's/^/  /'; fi
  if ((status == 0)) && grep -q 'database migrated from' <<<"$out"; then
    printf '%s\n' "$out" >"$dir/MIGRATION" || status=$?
  fi
  return "$status"
}

# point_env LINK SUBDIR KEY: point $OPT/LINK at SUBDIR/KEY (an environment). Sets POINTED=1
# when it moved, and POINTED_FROM to what it named before (empty on a first install).
point_env() {
  POINTED=0
  POINTED_FROM=$(link_target "$OPT/$1")
  if [[ -z $3 || $POINTED_FROM == "$2/$3" ]]; then return 0; fi
  flip_link "$OPT/$1" "$2/$3"
  changed "$OPT/$1 -> $2/$3${POINTED_FROM:+ (was $POINTED_FROM)}"
  POINTED=1
}

switch_release() {
  local new=releases/$RELEASE_ID old
  old=$(link_target "$OPT/current")
  SWITCH=0
  if [[ $old == "$new" && -z $PENDING ]]; then return 0; fi
  SWITCH=1
  step "database migration and switch to release $RELEASE_ID"
  if ((NO_START)) && is_active "$DAEMON"; then
    die "--no-start, but $DAEMON is running and the upgrade must stop it to migrate the database" \
      "run without --no-start (the daemon and gateway are restarted; the engine keeps running)"
  fi
  mark_pending switch
  if is_active "$DAEMON"; then
    mark_pending daemon-stopped  # a run cut short after this point must start it again
    svc stop "$DAEMON"
    DAEMON_STOPPED=1
  fi
  local migrated=0
  if ((DRY_RUN)); then
    say "would migrate the database with release $RELEASE_ID (appliance migrate, as $USER_NAME)"
    migrated=1
  else
    migrate "$(r "$OPT/$new")" && migrated=1
  fi
  if ((!migrated)); then
    if ((DAEMON_STOPPED)); then svc start "$DAEMON"; fi
    unmark_pending switch
    unmark_pending daemon-stopped
    die "the database migration failed; ${old:+$OPT/current still points at $old and }nothing was switched" \
      "read the migration's message above (an SQLite database was restored from the copy taken first), fix the cause and run the installer again"
  fi
  point_env engine engines "${ENGINE_KEY:-}"
  if ((POINTED)) && [[ -n $POINTED_FROM ]]; then
    note "a running engine keeps the environment it started with; engines/$ENGINE_KEY is used from its next start"
  fi
  point_env router routers "${ROUTER_KEY:-}"
  ROUTER_MOVED=$POINTED
  if [[ -n $old && $old != "$new" ]]; then
    flip_link "$OPT/previous" "$old"
    PREVIOUS_ID=${old#releases/}
  fi
  flip_link "$OPT/current" "$new"
  if [[ $old != "$new" ]]; then changed "$OPT/current -> $new${old:+ (was $old)}"; fi
}

services() {
  step "services"
  if ((UNITS_CHANGED)); then svc daemon-reload; fi
  if ((ENGINE_UNIT_CHANGED)); then
    note "$ENGINE changed: it takes effect at the engine's next start (the daemon decides when; the installer never restarts it)"
  fi
  local unit enable=()
  for unit in "$DAEMON" "$GATEWAY"; do
    if ((FRESH)) && ! is_enabled "$unit"; then enable+=("$unit"); fi
  done
  # the socket also on a box upgraded from a release before it (its gateway is enabled)
  if ! is_enabled "$GATEWAY_SOCKET" && { ((FRESH)) || is_enabled "$GATEWAY"; }; then
    enable+=("$GATEWAY_SOCKET")
  fi
  if ((${#enable[@]})); then svc enable "${enable[@]}"; changed "enabled ${enable[*]}"; fi
  if ((NO_START)); then
    note "--no-start: nothing was started or restarted; start with: systemctl start $DAEMON $GATEWAY_SOCKET $GATEWAY"
    if ((ROUTER_UNIT_CHANGED || ROUTER_MOVED)) && is_active "$ROUTER"; then
      note "the router's unit or environment changed: it takes effect at the router's next start (now: systemctl restart $ROUTER, which fails only the requests in flight through it)"
    fi
    return 0
  fi
  router_up
  local restart_daemon=$((SWITCH || DAEMON_UNIT_CHANGED || FORCE_RESTART))
  local restart_gateway=$((SWITCH || GATEWAY_UNIT_CHANGED || FORCE_RESTART))
  service_up "$DAEMON" "$restart_daemon" "$DAEMON_STOPPED"
  socket_up
  service_up "$GATEWAY" "$restart_gateway" "$GATEWAY_STOPPED"
}

# socket_up: the gateway's listener, before the gateway. An upgrade restarts the service only:
# the socket listens on across it, which is what makes the restart refuse nobody. The socket
# itself is (re)started only where it must be, with the gateway stopped first (systemd refuses
# to start a socket whose service runs, and an old gateway holds the port): on a fresh box, on
# a box upgraded from a release before the socket (its gateway bound the port itself), and for
# a new gateway.host:gateway.port (LISTEN_CHANGED; kept pending until a run finishes).
socket_up() {
  if is_active "$GATEWAY_SOCKET"; then
    if ((SOCKET_UNIT_CHANGED && !LISTEN_CHANGED)); then
      note "$GATEWAY_SOCKET changed: it takes effect at the socket's next start (boot; the installer restarts the listener only for a new address). Now, at the cost of refusing clients for a moment: systemctl stop $GATEWAY $GATEWAY_SOCKET && systemctl start $GATEWAY_SOCKET $GATEWAY"
    fi
    ((LISTEN_CHANGED)) || return 0
    if is_active "$GATEWAY"; then svc stop "$GATEWAY"; GATEWAY_STOPPED=1; fi
    svc restart "$GATEWAY_SOCKET"
    RESTARTED+=("$GATEWAY_SOCKET")
    note "the gateway now listens on $CFG_gateway_host:$CFG_gateway_port (its socket was restarted for the new address)"
  elif ((FRESH)) || is_active "$GATEWAY"; then
    if is_active "$GATEWAY"; then svc stop "$GATEWAY"; GATEWAY_STOPPED=1; fi
    svc start "$GATEWAY_SOCKET"
    STARTED+=("$GATEWAY_SOCKET")
  else
    note "$GATEWAY_SOCKET is not running and was left so (start it with: systemctl start $GATEWAY_SOCKET $GATEWAY)"
  fi
}

# router_up: a running router (a cell's head) is restarted when its unit or its environment
# changed, so it never runs from an environment a later run prunes; a restart is cheap and
# fails only the requests in flight through it. A stopped router stays stopped: the daemon
# starts it on a head. try-restart does nothing to a unit that is not running, even if it
# stopped after the check.
router_up() {
  if ((ROUTER_UNIT_CHANGED || ROUTER_MOVED)) && is_active "$ROUTER"; then
    svc try-restart "$ROUTER"
    RESTARTED+=("$ROUTER")
  fi
}

service_up() {  # service_up UNIT CHANGED STOPPED_BY_US
  local unit=$1
  if (($3)); then svc start "$unit"; STARTED+=("$unit"); return 0; fi
  if is_active "$unit"; then
    if (($2)); then svc restart "$unit"; RESTARTED+=("$unit"); fi
  elif ((FRESH)); then
    svc start "$unit"
    STARTED+=("$unit")
  else
    note "$unit is not running and was left so (start it with: systemctl start $unit)"
  fi
}

prune() {
  local current previous dir name kept=()
  current=$(link_target "$OPT/current")
  previous=$(link_target "$OPT/previous")
  for dir in "$(r "$OPT/releases")"/*; do
    [[ -d $dir ]] || continue
    name=releases/$(basename "$dir")
    if [[ $name == "$current" || $name == "$previous" ]]; then
      kept+=("$dir")
      continue
    fi
    act "remove the old release $OPT/$name" rm -rf -- "$dir"
    changed "removed the old release $OPT/$name"
  done
  prune_envs engine engines ENGINE "${kept[@]}"
  prune_envs router routers ROUTER "${kept[@]}"
}

# prune_envs LINK SUBDIR RECORD RELEASE...: remove the environments under $OPT/SUBDIR that
# neither $OPT/LINK nor a kept release (its RECORD file) names and no running process uses:
# its command line names it (the engine), or it has a file of it mapped (the router, which
# retitles itself `sglang::router`).
prune_envs() {
  local link=$1 sub=$2 record=$3 dir name keep=()
  shift 3
  for dir in "$@"; do keep+=("$(cat "$dir/$record" 2>/dev/null || true)"); done
  keep+=("$(basename "$(link_target "$OPT/$link")")")
  for dir in "$(r "$OPT/$sub")"/*; do
    [[ -d $dir ]] || continue
    name=$(basename "$dir")
    if printf '%s\n' "${keep[@]}" | grep -qxF -- "$name"; then continue; fi
    if grep -lsaF -- "$dir/" /proc/[0-9]*/cmdline /proc/[0-9]*/maps >/dev/null 2>&1; then
      note "kept $OPT/$sub/$name: a running process uses it"
      continue
    fi
    act "remove the unused $link environment $OPT/$sub/$name" rm -rf -- "$dir"
    changed "removed the unused $link environment $OPT/$sub/$name"
  done
}

dropin_notes() {  # dropin_notes WHAT: the operator's drop-ins, never touched, named
  local unit file
  for unit in "$DAEMON" "$GATEWAY_SOCKET" "$GATEWAY" "$ENGINE" "$ROUTER"; do
    for file in "$(r "$DROPIN_DIR/$unit.d")"/*.conf; do
      [[ -f $file ]] || continue
      note "your drop-in ${file#"$ROOT"} $1"
    done
  done
}

console_url() {
  local host=${CFG_server_host} scheme=http
  if [[ -n ${CFG_server_tls_cert} ]]; then scheme=https; fi
  case $host in
    127.0.0.1 | localhost | ::1)
      printf '%s://%s:%s (this box only; from your workstation: ssh -L %s:127.0.0.1:%s %s, or set server.host and server.allowed_hosts in %s)' \
        "$scheme" "$host" "${CFG_server_port}" "${CFG_server_port}" \
        "${CFG_server_port}" "$(hostname -f 2>/dev/null || hostname)" "$CONFIG" ;;
    0.0.0.0 | ::) printf '%s://%s:%s' "$scheme" "$(hostname -f 2>/dev/null || hostname)" "${CFG_server_port}" ;;
    *) printf '%s://%s:%s' "$scheme" "$host" "${CFG_server_port}" ;;
  esac
}

summary() {
  local item
  echo
  say "summary$( ((DRY_RUN)) && printf ' (dry run: nothing was changed)')"
  printf '  version:    appliance %s (%s/current -> %s)\n' "$VERSION" "$OPT" \
    "$(link_target "$OPT/current" || true)"
  if ((${#CHANGES[@]} == 0 && ${#RESTARTED[@]} == 0 && ${#STARTED[@]} == 0)); then
    printf '  nothing changed; no service restarted\n'
  else
    printf '  changed:\n'
    for item in "${CHANGES[@]}"; do printf '    - %s\n' "$item"; done
    if ((${#CHANGES[@]} == 0)); then printf '    - nothing\n'; fi
    printf '  started:    %s\n' "${STARTED[*]:-none}"
    printf '  restarted:  %s\n' "${RESTARTED[*]:-none}"
  fi
  printf '  engine:     %s was not started, stopped or restarted (the daemon decides)\n' "$ENGINE"
  if [[ -n ${PREVIOUS_ID:-} ]]; then
    printf '  rollback:   install.sh --rollback (previous release: %s)\n' "$PREVIOUS_ID"
  fi
  printf '  console:    %s\n' "$(console_url)"
  if ((FRESH && FIRST_DATABASE)); then
    printf '  first login: user admin; the daemon writes its one-time password to %s/bootstrap-admin.txt (readable by root and %s only) when it first starts\n' \
      "${CFG_paths_state_dir}" "$USER_NAME"
  fi
  for item in "${NOTES[@]}"; do printf '  note: %s\n' "$item"; done
}

do_install() {
  preflight
  if ((FAILS)); then
    die "preflight failed ($FAILS problem(s) above); nothing was changed" \
      "fix each FAIL above and run the installer again (install.sh --check re-runs only the checks)"
  fi
  lock_install
  PENDING=$(cat "$(pending_file)" 2>/dev/null || true)
  if [[ -n $PENDING ]]; then
    say "an earlier run did not finish ($(tr '\n' ' ' <<<"$PENDING")); finishing it"
    if grep -qx fresh <<<"$PENDING"; then FRESH=1; fi
    if grep -qx daemon-stopped <<<"$PENDING"; then DAEMON_STOPPED=1; fi
    if grep -qx listen <<<"$PENDING"; then LISTEN_CHANGED=1; fi
  fi
  system_files
  configuration
  read_config_values
  gateway_listen
  engine_rdma
  FIRST_DATABASE=1  # (a PostgreSQL database: cannot tell; the daemon knows)
  if [[ -z $CFG_database_url && -e $(r "$CFG_paths_state_dir/appliance.db") ]] &&
    ! grep -qx fresh <<<"$PENDING"; then
    FIRST_DATABASE=0
    if ((FRESH)); then note "the existing database in $CFG_paths_state_dir was kept: log in with its admin accounts"; fi
  fi
  private_modes
  ensure_engine
  ensure_router
  ensure_release
  switch_release
  services
  if ((!DRY_RUN)); then rm -f "$(pending_file)"; fi
  prune
  dropin_notes "is in effect (the installer never touches it)"
  summary
}

# ----------------------------------------------------------------- rollback, uninstall

do_rollback() {
  check_root
  if ((FAILS)); then die "run it as root" "sudo install.sh --rollback"; fi
  lock_install
  local current previous dir
  current=$(link_target "$OPT/current")
  previous=$(link_target "$OPT/previous")
  dir=$(r "$OPT/$previous")
  if [[ -z $previous || ! -f $dir/.complete ]]; then
    die "there is no previous release to roll back to" "install the version you want instead"
  fi
  step "rolling back from ${current#releases/} to ${previous#releases/}"
  if [[ -f $(r "$OPT/$current")/MIGRATION ]]; then
    warn "release ${current#releases/} migrated the database ($(head -n 1 "$(r "$OPT/$current")/MIGRATION")); the previous release refuses a newer schema. $(grep 'copied to' "$(r "$OPT/$current")/MIGRATION" | sed 's/^appliance: //') If the daemon does not start: systemctl stop $DAEMON $GATEWAY, copy that backup over the database, start them again"
  fi
  local engine router
  engine=$(cat "$dir/ENGINE" 2>/dev/null || true)
  if [[ -n $engine && -f $(r "$OPT/engines/$engine")/.complete ]]; then
    flip_link "$OPT/engine" "engines/$engine"
  fi
  router=$(cat "$dir/ROUTER" 2>/dev/null || true)
  if [[ -n $router && -f $(r "$OPT/routers/$router")/.complete ]]; then
    point_env router routers "$router"
    ROUTER_MOVED=$POINTED
  fi
  flip_link "$OPT/previous" "$current"
  flip_link "$OPT/current" "$previous"
  changed "$OPT/current -> $previous (was $current)"
  VERSION=$(cat "$dir/VERSION")
  PREVIOUS_ID=${current#releases/}
  SWITCH=1
  local unit
  for unit in "$DAEMON" "$GATEWAY"; do
    if is_active "$unit"; then svc restart "$unit"; RESTARTED+=("$unit"); fi
  done
  router_up
  read_config_values 2>/dev/null || true
  summary
}

confirm_purge() {
  local answer
  if ((YES)); then return 0; fi
  if ((DRY_RUN)); then return 0; fi
  if [[ ! -t 0 ]]; then
    die "--purge deletes the database, the models and the configuration, and there is no terminal to confirm it" \
      "add --yes to confirm"
  fi
  printf 'This deletes the configuration, the database, the downloaded models and the logs:\n'
  printf '  %s\n' "$@"
  read -r -p "Type 'purge' to confirm: " answer
  [[ $answer == purge ]] || die "not confirmed; nothing was removed" ""
}

safe_to_purge() {  # never a top-level or system directory, whatever the config says
  local path
  path=$(realpath -m -- "$1")
  case $path in
    / | /etc | /var | /var/lib | /var/log | /var/cache | /srv | /opt | /usr | /home | /root | /tmp | /mnt | /media | /data | /raid)
      return 1 ;;
  esac
  [[ $path == /*/* ]]
}

remove_path() {  # remove_path PATH (unrooted)
  local target
  target=$(r "$1")
  [[ -e $target || -L $target ]] || return 0
  act "remove $1" rm -rf -- "$target"
  changed "removed $1"
}

do_uninstall() {
  FAILS=0
  check_root
  if ((FAILS)); then die "run it as root" "sudo install.sh --uninstall"; fi
  if ! read_config_values 2>/dev/null; then
    warn "cannot read $CONFIG with ${PY:-a Python 3.11+}; assuming the default directories"
  fi
  local state=${CFG_paths_state_dir} models=${CFG_paths_models_dir}
  local logs=${CFG_paths_log_dir}
  local data=("$ETC" "$state" "$models" "$logs" /var/log/appliance-engine /var/cache/appliance
    /var/cache/appliance-engine)
  if ((PURGE)); then
    local path
    for path in "${data[@]}"; do
      safe_to_purge "$path" || die "refusing to purge $path: it is not a directory of the appliance's own" \
        "set paths.* in $CONFIG to the appliance's directories, or remove $path yourself"
    done
    confirm_purge "${data[@]}"
  fi
  step "uninstall"
  if is_active "$ENGINE"; then
    if ((STOP_ENGINE)); then
      svc stop "$ENGINE"
    else
      die "the engine ($ENGINE) is running; uninstalling would orphan it" \
        "stop it first (console, or: appliance engine stop), or pass --stop-engine"
    fi
  fi
  local unit
  # the socket before its service: a connection in between would start the gateway again
  for unit in "$DAEMON" "$GATEWAY_SOCKET" "$GATEWAY"; do
    if is_active "$unit"; then svc stop "$unit"; changed "stopped $unit"; fi
    if is_enabled "$unit"; then svc disable "$unit"; changed "disabled $unit"; fi
  done
  # after the daemon, which would start it again; it runs from $OPT/router, removed below
  if is_active "$ROUTER"; then svc stop "$ROUTER"; changed "stopped $ROUTER"; fi
  for unit in "$DAEMON" "$GATEWAY_SOCKET" "$GATEWAY" "$ENGINE" "$ROUTER"; do
    remove_path "$UNIT_DIR/$unit"
    remove_path "$UNIT_DIR/$unit.d"
  done
  remove_path "$POLKIT"
  remove_path "$SYSUSERS"
  remove_path "$TMPFILES"
  remove_path "$OPT"
  if ((${#CHANGES[@]})); then svc daemon-reload; fi
  if ((PURGE)); then
    local path
    for path in "${data[@]}"; do remove_path "$path"; done
    note "the system users ($USER_NAME, appliance-engine) are kept, as Debian does for system users: files elsewhere may still carry their ids (userdel removes them)"
  else
    note "kept: $CONFIG, $state (database, secrets, backups), $models (weights), $logs; --uninstall --purge removes them"
  fi
  dropin_notes "was left in place (remove it yourself if it is no longer wanted)"
  echo
  say "summary$( ((DRY_RUN)) && printf ' (dry run: nothing was changed)')"
  local item
  if ((${#CHANGES[@]} == 0)); then printf '  nothing to remove: the appliance is not installed\n'; fi
  for item in "${CHANGES[@]}"; do printf '  - %s\n' "$item"; done
  for item in "${NOTES[@]}"; do printf '  note: %s\n' "$item"; done
}

main() {
  defaults
  parse_args "$@"
  trap 'on_error $LINENO' ERR
  shopt -s inherit_errexit
  umask 022
  locate_source
  read_versions
  cd /
  if [[ $ACTION != install && $ACTION != check ]]; then pick_python; fi
  case $ACTION in
    check)
      preflight
      if ((FAILS)); then
        say "$FAILS check(s) failed"
        exit 1
      fi
      say "all checks passed" ;;
    install) do_install ;;
    rollback) do_rollback ;;
    uninstall) do_uninstall ;;
  esac
}

main "$@"
