#!/usr/bin/env bash
# Slurm HealthCheckProgram: the fleethealth *quick* self-test on this node, within a hard time budget,
# draining the node (reason "fleethealth: ...") only when the test computes a wrong answer, is slow,
# or hangs. The full suite belongs to the sweep (fleethealth sweep), never here.
#
#   installed:   install -D -m 0755 deploy/slurm/healthcheck.sh /opt/fleethealth/healthcheck.sh
#   slurm.conf:  HealthCheckProgram=/opt/fleethealth/healthcheck.sh
#                HealthCheckInterval=3600
#                HealthCheckNodeState=IDLE          # test idle nodes only; never steal a running job's GPUs
#
# How slurmd runs it (slurm.conf(5), slurmd source, 22.05): on every node at once, as SlurmdUser, with an
# EMPTY environment except SLURMD_NODENAME, and it kills the program after 60 s. So:
# - settings come from a file, /etc/fleethealth/healthcheck.conf (or the first argument), KEY=VALUE lines:
#     ENABLED         yes | no: no = this node opted out, exit 0 at once (default: yes)
#     FLEETHEALTH     command that starts fleethealth, split on spaces   (default: fleethealth)
#     BUDGET_S        hard limit for the self-test, seconds, at most 50  (default: 40)
#     DEVICE          cpu | cuda:N | all                                 (default: all)
#     SELFTEST_ARGS   extra selftest arguments, split on spaces          (default: none)
#     KAFKA           bus DSN; results are published there               (default: none)
#     DRAIN_ON_HANG   yes | no: drain when the test overruns its budget  (default: yes)
#     SLURM_CONF      exported for scontrol/sinfo                        (default: Slurm's own default)
#     SCONTROL, SINFO, LOGGER   the tools                                (default: found on PATH)
#     PATH            search path (default: /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
#   Unknown keys are logged and ignored; the file is parsed, never sourced.
# - the node is $SLURMD_NODENAME (NODE= in the file, then `hostname -s`, only for runs by hand);
# - it FAILS OPEN: when fleethealth is missing, cannot run its tests, or crashes without a verdict, it
#   logs loudly (logger -p daemon.err, tag fleethealth-healthcheck) and exits 0 without draining: one
#   packaging mistake must not drain the whole cluster.
# - ownership as LBNL NHC keeps it: a node drained or down with a reason that does not start with
#   "fleethealth:" belongs to someone else and is left alone; a passing run never resumes a node
#   (fleethealth resumes only after a passing full suite, through the sweep).
# Exit status: 0 healthy or failed open, 1 drained (or the drain failed).
set -uo pipefail

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
conf="${1:-/etc/fleethealth/healthcheck.conf}"
ENABLED=yes FLEETHEALTH=fleethealth BUDGET_S=40 DEVICE=all SELFTEST_ARGS="" KAFKA="" DRAIN_ON_HANG=yes NODE=""
SCONTROL=scontrol SINFO=sinfo LOGGER=logger
unknown=()
if [[ -r "$conf" ]]; then
  while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line#"${line%%[![:space:]]*}"}"
    [[ -z "$line" || "$line" == \#* ]] && continue
    key="${line%%=*}" value="${line#*=}"
    value="${value%"${value##*[![:space:]]}"}"
    if [[ "$value" =~ ^\"(.*)\"$ || "$value" =~ ^\'(.*)\'$ ]]; then value="${BASH_REMATCH[1]}"; fi
    case "$key" in
      ENABLED|FLEETHEALTH|BUDGET_S|DEVICE|SELFTEST_ARGS|KAFKA|DRAIN_ON_HANG|NODE|SCONTROL|SINFO|LOGGER|PATH) printf -v "$key" '%s' "$value" ;;
      SLURM_CONF) export SLURM_CONF="$value" ;;
      *) unknown+=("$key") ;;
    esac
  done < "$conf"
fi

log() {  # log PRIORITY MESSAGE: to syslog (daemon facility) and stderr (slurmd's log)
  "$LOGGER" -t fleethealth-healthcheck -p "daemon.$1" -- "$2" 2>/dev/null || true
  printf 'fleethealth-healthcheck: %s\n' "$2" >&2
}
fail_open() { log err "FAILING OPEN, node not drained: $1"; exit 0; }

[[ "$ENABLED" == "no" ]] && exit 0  # opted out in $conf
node="${SLURMD_NODENAME:-${NODE:-$(hostname -s)}}"
if [[ ! "$node" =~ ^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$ ]]; then
  fail_open "odd node name '$node'"
fi
[[ ${#unknown[@]} -eq 0 ]] || log warning "$conf: unknown settings ignored: ${unknown[*]}"
[[ -r "$conf" ]] || log notice "$conf not readable: defaults used"
if [[ ! "$BUDGET_S" =~ ^[0-9]+$ || "$BUDGET_S" -lt 1 ]]; then
  log warning "BUDGET_S='$BUDGET_S' is not a whole number of seconds: 40 used"; BUDGET_S=40
elif (( BUDGET_S > 50 )); then
  log warning "BUDGET_S=$BUDGET_S exceeds what slurmd allows (it kills the check at 60 s): 50 used"; BUDGET_S=50
fi

read -r -a cmd <<< "$FLEETHEALTH"
read -r -a extra <<< "$SELFTEST_ARGS"
if [[ ${#cmd[@]} -eq 0 ]] || ! command -v "${cmd[0]}" >/dev/null 2>&1; then
  fail_open "fleethealth command '${cmd[0]:-}' not found (FLEETHEALTH in $conf, PATH=$PATH)"
fi

args=(selftest --suite quick --device "$DEVICE" --json --node "$node")
[[ -n "$KAFKA" ]] && args+=(--kafka "$KAFKA")
errfile="$(mktemp)"
trap 'rm -f "$errfile"' EXIT
out="$(timeout --kill-after=2 "$BUDGET_S" "${cmd[@]}" "${args[@]}" "${extra[@]}" 2>"$errfile")"
rc=$?
last_error="$(tail -n 1 "$errfile" | sed -E 's/^fleethealth selftest: error: //' | cut -c 1-200)"

case "$rc" in
  0) exit 0 ;;
  1)
    failing="$(printf '%s\n' "$out" \
      | sed -nE 's/.*"test":"([^"]+)","device":"([^"]+)","verdict":"(fail|slow)".*/\1@\2 \3/p' \
      | head -n 5 | paste -sd ',' -)"
    # exit 1 without a failing record is a crash (a traceback exits 1 too), not a verdict on the node
    [[ -n "$failing" ]] || fail_open "fleethealth selftest exited 1 without a verdict: ${last_error:-no output}"
    reason="fleethealth: quick self-test: $failing"
    ;;
  124|137)
    [[ "$DRAIN_ON_HANG" == "yes" ]] || fail_open "quick self-test gave no result within ${BUDGET_S}s (DRAIN_ON_HANG=no)"
    reason="fleethealth: quick self-test hung (no result within ${BUDGET_S}s)"
    ;;
  *) fail_open "fleethealth selftest could not run (exit $rc): ${last_error:-no output}" ;;
esac

reason="$(printf '%s' "$reason" | tr -d '"\n\r' | cut -c 1-200)"
held="$("$SINFO" --noheader --Node --nodes="$node" --format='%T|%E' 2>&1)" || {
  log err "cannot read node $node from Slurm ($held); not draining it for: $reason"; exit 1; }
held="${held%%$'\n'*}"  # a node in several partitions is listed once per partition
state="${held%%|*}" current="${held#*|}"
if [[ "$state" =~ drain|down|fail ]] && [[ "$current" != "none" && "$current" != fleethealth:* ]]; then
  log warning "node $node is $state by another owner (reason '$current'): left alone; would drain for: $reason"
  exit 1
fi
log err "draining $node: $reason"
"$SCONTROL" update "NodeName=$node" State=DRAIN "Reason=$reason" || { log err "scontrol drain of $node failed"; exit 1; }
exit 1
