#!/usr/bin/env bash
# Build (or reuse) the real-engine tier's environment: SGLang 0.5.23 on CPU torch.
#
#   tests/realengine/build-env.sh          prints the env's path on its last line
#   tests/realengine/build-env.sh --where  prints the path only; exit 0 if that env is
#                                          complete, 3 if it is absent or half-built
#
# Where: $APPLIANCE_SGLANG_ENV, else ~/.cache/appliance/sglang-cpu-<hash>, where <hash> is
# of requirements.txt, this script and the stand-ins: outside the clone, so CI's fresh clone
# and later sessions reuse it, and a changed pin builds a new env beside the old one.
# Idempotent: a complete env (its stamp file written as the last step) is reused at once; a
# half-built one (no stamp: an interrupted or failed build) is removed and built again.
# Two builds of the same env at once (two make runs) wait on one lock instead of racing.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
# The CPU build of torch that this machine image carries (pip takes it from local disk).
torch_pin="torch==2.13.0"

fingerprint=$(cd "$here" && cat requirements.txt build-env.sh \
  $(find standins -name '*.py' | LC_ALL=C sort) | sha256sum | cut -c1-12)
env_dir=${APPLIANCE_SGLANG_ENV:-$HOME/.cache/appliance/sglang-cpu-$fingerprint}
stamp="$env_dir/.appliance-env-complete"
log="$env_dir.build.log"

say() { echo "build-env: $*" >&2; }
step="starting"
fail() {
  say "FAILED while $step (exit $1)."
  say "the last lines of $log:"
  tail -n 25 "$log" >&2 2>/dev/null || true
  say "next: fix the cause above and run tests/realengine/build-env.sh again" \
      "(the half-built env at $env_dir is rebuilt from scratch)."
  exit 1
}

if [ "${1:-}" = "--where" ]; then
  echo "$env_dir"
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] && exit 0
  exit 3
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then
  say "reusing $env_dir"
  echo "$env_dir"
  exit 0
fi

mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
if ! flock -n 9; then
  say "another build of $env_dir is running; waiting for it"
  flock 9
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then
  say "reusing $env_dir (built by the run we waited for)"
  echo "$env_dir"
  exit 0
fi

trap 'fail $?' ERR
started=$(date +%s)
: >"$log"
say "building $env_dir (log: $log)"

step="removing a half-built env"
rm -rf "$env_dir"

step="creating the virtual environment with $python"
"$python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' >>"$log" 2>&1 \
  || { say "SGLang 0.5.23's CPU wheels and the local torch wheel are for Python 3.11;" \
           "set PYTHON=python3.11"; false; }
"$python" -m venv "$env_dir" >>"$log" 2>&1
pip=("$env_dir/bin/python" -m pip --disable-pip-version-check --no-input)

step="installing $torch_pin (the CPU build)"
"${pip[@]}" install --quiet "$torch_pin" >>"$log" 2>&1
"$env_dir/bin/python" -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ else
  "torch " + torch.__version__ + " is not the CPU build")' >>"$log" 2>&1

step="installing sglang 0.5.23 and its pinned dependencies (requirements.txt, --no-deps)"
"${pip[@]}" install --quiet --no-deps -r "$here/requirements.txt" >>"$log" 2>&1

step="installing the test instruments (sgl_kernel and torchvision stand-ins)"
site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$env_dir/appliance-standins"
cp -r "$here/standins/sgl_kernel" "$here/standins/torchvision" "$env_dir/appliance-standins/"
find "$env_dir/appliance-standins" -name __pycache__ -prune -exec rm -rf {} +
echo "$env_dir/appliance-standins" >"$site/appliance-standins.pth"

step="importing SGLang's server in CPU mode (the smoke check)"
SGLANG_USE_CPU_ENGINE=1 "$env_dir/bin/python" -W ignore -c '
import sglang, sglang.launch_server, sglang.srt.managers.scheduler
assert sglang.__version__ == "0.5.23", sglang.__version__
' >>"$log" 2>&1

trap - ERR
echo "$fingerprint" >"$stamp"
say "ready: $env_dir ($(du -sh "$env_dir" | cut -f1), built in $(( $(date +%s) - started )) s)"
echo "$env_dir"
