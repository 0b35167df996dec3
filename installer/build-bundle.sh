#!/usr/bin/env bash
# build-bundle.sh: make the tarball an air-gapped box installs from.
#
#   installer/build-bundle.sh [--out DIR] [--python PY] [--no-engine] [--no-tar]
#
# The bundle is appliance-<version>/ holding the package (appliance/, migrations/, web/,
# pyproject.toml), the units (systemd/), the installer, docs, a wheelhouse/ with every wheel
# the virtual environments need (the daemon's dependencies, pip, the pinned sglang-router a
# cell's head runs, and unless --no-engine the pinned sglang with torch and the rest, and the KV
# transfer library a prefill or decode engine loads (mooncake-transfer-engine-cuda13): many GB)
# and SHA256SUMS over every file, which install.sh verifies before it changes anything. Then
# appliance-<version>-linux-x86_64.tar and its .sha256 beside it, unless --no-tar.
#
# pip fetches wheels for the Python that runs it: build on a machine like the target
# (Ubuntu 24.04 x86_64, Python 3.12), e.g. in an ubuntu:24.04 container.
#
# All code is inside functions; the last line calls main.

set -Eeuo pipefail

usage() {
  sed -n '2,/^$/ s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

die() {
  printf 'build-bundle: error: %s\n' "$1" >&2
  exit 1
}

main() {
  local out="" py=python3 engine=1 make_tar=1
  while (($#)); do
    case $1 in
      --out) [[ $# -ge 2 ]] || die "--out needs a directory"; out=$2; shift ;;
      --python) [[ $# -ge 2 ]] || die "--python needs a path"; py=$2; shift ;;
      --no-engine) engine=0 ;;
      --no-tar) make_tar=0 ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option: $1 (see --help)" ;;
    esac
    shift
  done
  local src version project
  src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
  version=$(sed -n 's/^__version__ = "\([^"]*\)"[[:space:]]*$/\1/p' "$src/appliance/__init__.py")
  project=$(sed -n '/^\[project\]/,/^\[/ s/^version = "\([^"]*\)"[[:space:]]*$/\1/p' \
    "$src/pyproject.toml")
  [[ -n $version && $version == "$project" ]] ||
    die "appliance/__init__.py says '$version' but pyproject.toml says '$project'"
  out=$(realpath -m -- "${out:-$src/dist}")
  local name=appliance-$version
  local stage=$out/$name
  rm -rf -- "$stage"
  mkdir -p "$stage/wheelhouse"

  printf 'build-bundle: %s from %s\n' "$name" "$src"
  local parts=(appliance migrations web systemd installer pyproject.toml)
  local extra
  for extra in README.md docs; do [[ -e $src/$extra ]] && parts+=("$extra"); done
  tar -C "$src" --exclude=__pycache__ --exclude='*.pyc' -cf - "${parts[@]}" |
    tar -C "$stage" --no-same-owner -xf -

  local requirements
  requirements=$(mktemp)
  "$py" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$src/pyproject.toml" >"$requirements"
  printf 'pip\n' >>"$requirements"
  printf 'build-bundle: wheels for the daemon (%s)\n' "$("$py" --version)"
  "$py" -m pip wheel --disable-pip-version-check --no-input --progress-bar off \
    --wheel-dir "$stage/wheelhouse" -r "$requirements"
  rm -f "$requirements"
  printf 'build-bundle: wheels for the router (installer/router-requirements.txt)\n'
  "$py" -m pip wheel --disable-pip-version-check --no-input --progress-bar off \
    --wheel-dir "$stage/wheelhouse" -r "$src/installer/router-requirements.txt"
  if ((engine)); then
    printf 'build-bundle: wheels for the engine (installer/engine-requirements.txt; many GB)\n'
    "$py" -m pip wheel --disable-pip-version-check --no-input --progress-bar off \
      --wheel-dir "$stage/wheelhouse" -r "$src/installer/engine-requirements.txt"
  fi

  (cd "$stage" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) >"$out/$name.sums"
  mv -f "$out/$name.sums" "$stage/SHA256SUMS"
  printf 'build-bundle: %s (%s files listed in SHA256SUMS)\n' "$stage" \
    "$(wc -l <"$stage/SHA256SUMS")"
  if ((make_tar)); then
    local tarball=$out/$name-linux-x86_64.tar
    tar -C "$out" -cf "$tarball" "$name"
    (cd "$out" && sha256sum "$(basename "$tarball")" >"$(basename "$tarball").sha256")
    printf 'build-bundle: %s\n' "$tarball"
    printf 'install on the box: tar -xf %s && sudo ./%s/installer/install.sh --offline\n' \
      "$(basename "$tarball")" "$name"
  fi
}

main "$@"
