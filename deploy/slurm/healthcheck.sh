#!/usr/bin/env bash
# Slurm HealthCheckProgram: run the fleethealth quick self-test on this node and drain the node,
# with the failing tests as the reason, when it computes a wrong answer, is slow, or cannot run.
#
#   slurm.conf:  HealthCheckProgram=/opt/fleethealth/deploy/slurm/healthcheck.sh
#                HealthCheckInterval=3600
#                HealthCheckNodeState=IDLE          # test idle nodes only; never steal a running job's GPUs
#
# A drained node stays out until an operator resumes it or a passing full suite releases it from
# quarantine (fleethealth sweep). Exit status: 0 healthy, 1 drained (or drain failed).
# Environment (all optional):
#   FLEETHEALTH        command that starts fleethealth        (default: fleethealth)
#   FH_SUITE           quick | full                            (default: quick)
#   FH_DEVICE          cpu | cuda:N | all                      (default: all)
#   FH_TIMEOUT         seconds before the test counts as hung  (default: 300)
#   FH_KAFKA           bus DSN; results are published there    (default: $FLEETHEALTH_KAFKA, else none)
#   FH_SELFTEST_ARGS   extra selftest arguments, split on spaces
#   FH_DRAIN_ON_ERROR  1: also drain when the suite cannot run (no GPU visible, …)  (default: 1)
#   FH_NODE            node name  (default: fleethealth's rule, `fleethealth config get node.name`:
#                      $FLEETHEALTH_NODE, else the short host name, or the FQDN with FLEETHEALTH_NODE_NAMING=fqdn)
#   SCONTROL           the scontrol program                    (default: scontrol)
set -uo pipefail

read -r -a cmd <<< "${FLEETHEALTH:-fleethealth}"
read -r -a extra <<< "${FH_SELFTEST_ARGS:-}"
node="${FH_NODE:-}"
[[ -n "$node" ]] || node="$("${cmd[@]}" config get node.name 2>/dev/null)"
[[ -n "$node" ]] || node="$(hostname -s)"
suite="${FH_SUITE:-quick}"
device="${FH_DEVICE:-all}"
limit="${FH_TIMEOUT:-300}"
kafka="${FH_KAFKA:-${FLEETHEALTH_KAFKA:-}}"
scontrol="${SCONTROL:-scontrol}"

if [[ ! "$node" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ ]]; then
  echo "healthcheck: refusing odd node name '$node'" >&2
  exit 1
fi

args=(selftest --suite "$suite" --device "$device" --json --node "$node")
[[ -n "$kafka" ]] && args+=(--kafka "$kafka")
errfile="$(mktemp)"
trap 'rm -f "$errfile"' EXIT

out="$(timeout "$limit" "${cmd[@]}" "${args[@]}" "${extra[@]}" 2>"$errfile")"
rc=$?

case "$rc" in
  0) exit 0 ;;
  1)
    failing="$(printf '%s\n' "$out" \
      | sed -nE 's/.*"test":"([^"]+)","device":"([^"]+)","verdict":"(fail|slow)".*/\1@\2 \3/p' \
      | head -n 5 | paste -sd ',' -)"
    reason="fleethealth selftest: ${failing:-failed}"
    ;;
  124) reason="fleethealth selftest hung (no result in ${limit}s)" ;;
  *)
    [[ "${FH_DRAIN_ON_ERROR:-1}" == "1" ]] || exit 0
    reason="fleethealth selftest could not run: $(tail -n 1 "$errfile" | sed -E 's/^fleethealth selftest: error: //')"
    ;;
esac

reason="$(printf '%s' "$reason" | tr -d '"\n\r' | cut -c 1-200)"
echo "healthcheck: draining $node: $reason" >&2
"$scontrol" update "NodeName=$node" State=DRAIN "Reason=$reason" || exit 1
exit 1
