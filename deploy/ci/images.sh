#!/usr/bin/env bash
# Build every Dockerfile target and start each image's own smoke test, with no Docker engine and no
# registry pull: debootstrap makes a Debian bookworm base with Python 3.11 (a venv on PATH), buildah
# builds the targets on it (--build-arg BASE=...) and `buildah run --isolation chroot` runs commands
# in them, on this machine's network (a broker on 127.0.0.1 is reachable from inside).
#
#   bash deploy/ci/images.sh                 # base (cached in $FH_IMAGES_WORK), all targets, all smokes
#   bash deploy/ci/images.sh probe server    # only these targets
#   bash deploy/ci/images.sh --help
#   bash deploy/ci/images.sh --inputs        # print the digest of what the images are built from
#
# After a run of all targets it writes deploy/ci/images.verified: the digest of its inputs (the
# Dockerfile, pyproject.toml and this script) and the timings. .ci/run runs this script when the
# digest of the checkout differs from the one recorded there, that is, when an image's inputs changed.
#
# Smokes: probe: `probe --source sim` publishes telemetry to an embedded broker on the host (read back
# from the host), and `probe --source dcgm` ends with its one-line error about the DCGM bindings, exit 2;
# server: `serve --no-detect` answers /healthz, `detect --until-caught-up` reads the probe's records into
# a store, `act --dry-run` starts and exits when idle; sweep: `selftest --device cpu` passes (its
# known-answer GEMM and memory tests on the CPU; the image's CuPy and CUDA wheels import).
# Needs root, buildah, debootstrap (deploy/ci/system-packages.sh installs them with FH_IMAGES=1) and
# this repository's Python environment for the host-side broker. Prints one JSON line of timings.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
inputs_digest() { git ls-files -s Dockerfile pyproject.toml deploy/ci/images.sh | git hash-object --stdin; }
if [[ "${1:-}" == "--inputs" ]]; then inputs_digest; exit 0; fi
TARGETS=("$@")
(( ${#TARGETS[@]} )) || TARGETS=(probe server sweep)
for t in "${TARGETS[@]}"; do
  [[ "$t" =~ ^(probe|server|sweep)$ ]] || { echo "images.sh: unknown target $t (probe, server, sweep)" >&2; exit 2; }
done
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "images.sh: $tool not found (apt-get install $tool)" >&2; exit 2; }
done

WORK=${FH_IMAGES_WORK:-/var/tmp/fleethealth-images}
BASE=localhost/fleethealth-base:bookworm
PY=${PYTHON:-python}
mkdir -p "$WORK"
declare -A SECONDS_TAKEN
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }
fail() { echo "images.sh: FAILED: $*" >&2; exit 1; }

# ---------------------------------------------------------------- the base image
t0=$(now)
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  rootfs="$WORK/rootfs"
  if [[ ! -x "$rootfs/usr/bin/python3" ]]; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
      http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || fail "debootstrap (see $WORK/debootstrap.log)"
  fi
  ctr=$(buildah from --isolation chroot scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$rootfs/." "$mnt/"
  chroot "$mnt" python3 -m venv /opt/venv
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 "$ctr"
  buildah commit -q "$ctr" "$BASE" >/dev/null
  buildah rm "$ctr" >/dev/null
fi
SECONDS_TAKEN[base]=$(since "$t0")

# pip inside a build uses this machine's configuration, certificates and wheel folders
MOUNTS=()
for path in /etc/ssl/certs/ca-certificates.crt /etc/xdg/pip /opt/wheels /opt/pypi /opt/pypi-more; do
  [[ -e "$path" ]] && MOUNTS+=(-v "$path:$path:ro")
done

build() {
  local target=$1 t
  t=$(now)
  buildah bud --isolation chroot -q --layers --build-arg "BASE=$BASE" --target "$target" "${MOUNTS[@]}" \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt -t "localhost/fleethealth-$target:ci" . \
    >"$WORK/build-$target.log" 2>&1 || { tail -30 "$WORK/build-$target.log" >&2; fail "build of target $target"; }
  SECONDS_TAKEN[build_$target]=$(since "$t")
}

# run TARGET ARGS...: the image's entrypoint (fleethealth) with ARGS, in a fresh container
run() {
  local target=$1 ctr rc=0
  shift
  ctr=$(buildah from -q "localhost/fleethealth-$target:ci")
  buildah run --isolation chroot --user 10001 "$ctr" -- fleethealth "$@" || rc=$?
  buildah rm "$ctr" >/dev/null
  return $rc
}

BROKER_PID=""
cleanup() { [[ -n "$BROKER_PID" ]] && kill "$BROKER_PID" 2>/dev/null; true; }
trap cleanup EXIT
broker() {
  [[ -n "$BROKER_PID" ]] && return
  "$PY" -m fleethealth broker >"$WORK/broker.$$.out" 2>"$WORK/broker.$$.err" &
  BROKER_PID=$!
  for _ in $(seq 300); do
    DSN=$(grep -ho 'kafka://[0-9.:]*' "$WORK/broker.$$.out" 2>/dev/null | head -1 || true)
    [[ -n "$DSN" ]] && return
    sleep 0.2
  done
  fail "the embedded broker did not start ($(cat "$WORK/broker.$$.err"))"
}

smoke_probe() {
  local t out rc=0
  t=$(now)
  broker
  run probe probe --source sim --kafka "$DSN" --node n0001 --interval 0.5 --duration 4 --no-socket \
    --metrics-port 0 --spool-dir /tmp/spool --ensure-topics >"$WORK/probe-sim.log" 2>&1 \
    || { cat "$WORK/probe-sim.log" >&2; fail "probe --source sim in the probe image"; }
  "$PY" - "$DSN" <<'EOF' || fail "no telemetry from the probe image on the broker"
import sys
from fleethealth.bus import Consumer
from fleethealth.schema import Telemetry, Topic
with Consumer(sys.argv[1], [Topic.TELEMETRY.value], group=None) as c:
    got = [r.msg for _ in range(20) for r in c.poll(timeout_s=0.5) if isinstance(r.msg, Telemetry)]
    nodes = {m.node for m in got}
    if "n0001" not in nodes:
        sys.exit(f"telemetry nodes seen: {sorted(nodes)}")
    print(f"probe image: {len(got)} telemetry samples from n0001 on the broker")
EOF
  out=$(run probe probe --source dcgm --kafka "$DSN" --node n0001 --duration 2 --no-socket --metrics-port 0 \
        --spool-dir /tmp/spool 2>&1) || rc=$?
  [[ $rc == 2 && "$out" == *"DCGM"* && "$out" != *"Traceback"* ]] \
    || { echo "$out" >&2; fail "probe --source dcgm should end with one clear line and exit 2 (got $rc)"; }
  echo "probe image: --source dcgm without bindings: $(echo "$out" | grep -m1 "error:")"
  SECONDS_TAKEN[smoke_probe]=$(since "$t")
}

smoke_server() {
  local t ctr port up="" serve_pid
  t=$(now)
  broker
  # one container for the three: the store migrated as a step of its own, as an upgrade does
  # (serve, detect and act refuse a store with pending migrations; serve --no-detect never migrates)
  ctr=$(buildah from -q localhost/fleethealth-server:ci)
  in_server() { buildah run --isolation chroot --user 10001 "$ctr" -- "$@"; }
  in_server fleethealth migrate up --store chdb:///tmp/store >"$WORK/migrate.log" 2>&1 \
    || { cat "$WORK/migrate.log" >&2; fail "migrate up in the server image"; }
  # the simulator stamps its samples in simulated time: the event-time bounds against the broker's
  # clock would dead-letter them, so this replay turns them off (as the demo does)
  in_server fleethealth detect --kafka "$DSN" --store chdb:///tmp/store --metrics-port 0 --until-caught-up \
    --set detect.runner.max_behind_s=none --set detect.runner.max_ahead_s=none \
    >"$WORK/detect.log" 2>&1 || { cat "$WORK/detect.log" >&2; fail "detect --until-caught-up in the server image"; }
  grep -Eq "caught up \([1-9]" "$WORK/detect.log" || fail "detect did not read the probe image's records"
  in_server fleethealth act --scheduler slurm --dry-run --kafka "$DSN" --data /tmp/act --idle-exit 2 --metrics-port 0 \
    >"$WORK/act.log" 2>&1 || { cat "$WORK/act.log" >&2; fail "act --dry-run in the server image"; }
  # serve --no-detect on the store migrate made: up, /healthz answers, then stopped
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  (in_server timeout 60 fleethealth serve --no-detect --kafka "$DSN" --store chdb:///tmp/store --port "$port" \
     >"$WORK/serve.log" 2>&1 || true) &
  serve_pid=$!
  for _ in $(seq 150); do
    if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/healthz', timeout=2)" \
         "$port" 2>/dev/null; then up=1; break; fi
    sleep 0.3
  done
  pkill -f "fleethealth serve --no-detect --kafka $DSN" 2>/dev/null || true
  wait "$serve_pid" || true
  buildah rm "$ctr" >/dev/null
  [[ -n "$up" ]] || { cat "$WORK/serve.log" >&2; fail "serve --no-detect never answered /healthz"; }
  echo "server image: detect read the probe's records, act and serve --no-detect started and answered"
  SECONDS_TAKEN[smoke_server]=$(since "$t")
}

smoke_sweep() {
  local t
  t=$(now)
  # every known-answer test but the collective one, which needs torch (not in the sweep image: on GPUs
  # the collective test runs on CuPy's NCCL)
  run sweep selftest --device cpu --only gemm_exact_fp32,gemm_exact_fp16,gemm_exact_bf16,gemm_abft_fp32,gemm_abft_bf16,gemm_repeat_fp32,memory \
    >"$WORK/selftest.log" 2>&1 \
    || { cat "$WORK/selftest.log" >&2; fail "selftest --device cpu in the sweep image"; }
  # CuPy and the NVRTC it compiles the kernels with are in the image (no GPU is needed to load them)
  local ctr
  ctr=$(buildah from -q localhost/fleethealth-sweep:ci)
  buildah run --isolation chroot --user 10001 "$ctr" -- python -c \
    "import cupy; from cuda.pathfinder import load_nvidia_dynamic_lib as load; print('cupy', cupy.__version__, 'nvrtc', load('nvrtc').abs_path)" \
    >"$WORK/cupy.log" 2>&1 || { buildah rm "$ctr" >/dev/null; cat "$WORK/cupy.log" >&2; fail "CuPy or NVRTC missing in the sweep image"; }
  buildah rm "$ctr" >/dev/null
  echo "sweep image: selftest --device cpu passed; $(tail -1 "$WORK/cupy.log")"
  SECONDS_TAKEN[smoke_sweep]=$(since "$t")
}

for target in "${TARGETS[@]}"; do
  build "$target"
done
[[ " ${TARGETS[*]} " == *" probe "* ]] && smoke_probe
[[ " ${TARGETS[*]} " == *" server "* ]] && { [[ " ${TARGETS[*]} " == *" probe "* ]] || broker; smoke_server; }
[[ " ${TARGETS[*]} " == *" sweep "* ]] && smoke_sweep

SECONDS_TAKEN[total]=$(since "$t0")
summary=$("$PY" - "$(declare -p SECONDS_TAKEN)" <<'EOF'
import json, re, sys
pairs = dict(re.findall(r'\[(\w+)\]="([0-9.]+)"', sys.argv[1]))
print(json.dumps({"images": "ok", "seconds": {k: float(v) for k, v in sorted(pairs.items())}}))
EOF
)
echo "$summary"
if (( ${#TARGETS[@]} == 3 )); then
  printf '%s\n%s\n' "$(inputs_digest)" "$summary" > deploy/ci/images.verified
fi
