#!/usr/bin/env bash
# Topic ACLs for fleethealth on a Kafka cluster without Strimzi: the same principals and operations
# as deploy/k8s/components/kafka-auth/users.yaml (tests/deploy/test_kafka_auth.py checks they agree).
#
#   BOOTSTRAP=kafka-0:9093 COMMAND_CONFIG=/etc/kafka/admin.properties deploy/kafka/acls.sh
#   deploy/kafka/acls.sh --dry-run        # print the kafka-acls.sh commands, run nothing
#   deploy/kafka/acls.sh --help           # this text
#
# The cluster needs an authorizer (KRaft: authorizer.class.name=org.apache.kafka.metadata.authorizer.
# StandardAuthorizer) and allow.everyone.if.no.acl.found=false, so a principal with no ACL here can do
# nothing. Create each user's SCRAM credential first, e.g.
#   kafka-configs.sh --bootstrap-server "$BOOTSTRAP" --command-config "$COMMAND_CONFIG" --alter \
#     --entity-type users --entity-name fh-probe-gpu --add-config "SCRAM-SHA-512=[password=$(cat pw)]"
# PROBE_USERS names the probes' principals (one per node pool, or one per node), default fh-probe-gpu.
set -euo pipefail

KAFKA_ACLS=${KAFKA_ACLS:-kafka-acls.sh}
BOOTSTRAP=${BOOTSTRAP:-localhost:9093}
PROBE_USERS=${PROBE_USERS:-fh-probe-gpu}
DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  -h|--help)  # the header above, and nothing run
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0 ;;
  *) echo "acls.sh: unknown argument ${1} (try --help)" >&2; exit 2 ;;
esac

# acl PRINCIPAL RESOURCE-TYPE NAME OPERATION...        (the resource named exactly)
# PATTERN=prefixed acl PRINCIPAL RESOURCE-TYPE PREFIX OPERATION...   (every resource whose name starts so)
acl() {
  local principal=$1 type=$2 name=$3
  shift 3
  local cmd=("$KAFKA_ACLS" --bootstrap-server "$BOOTSTRAP")
  [[ -n "${COMMAND_CONFIG:-}" ]] && cmd+=(--command-config "$COMMAND_CONFIG")
  cmd+=(--add --allow-principal "User:$principal" --resource-pattern-type "${PATTERN:-literal}" "--$type" "$name")
  for op in "$@"; do cmd+=(--operation "$op"); done
  if (( DRY_RUN )); then printf '%s\n' "${cmd[*]}"; else "${cmd[@]}"; fi
}

for probe in $PROBE_USERS; do   # a node produces its inputs, and reads one topic: recommendations
  acl "$probe" topic fh.telemetry Write Describe
  acl "$probe" topic fh.steps Write Describe
  acl "$probe" topic fh.events Write Describe
  # the rollback relay (probe.rollback_relay, on by default) reads fh.recommendations in its node's
  # group fh-rollback-NODE, to hand a rollback to the training processes on that node
  acl "$probe" topic fh.recommendations Read Describe
  PATTERN=prefixed acl "$probe" group fh-rollback- Read Describe
done

# the detectors: read the inputs in group fh-detect (or, run as stages, fh-detect-node, -job, -policy),
# write findings, recommendations, dead letters; the stages also write and read fh.nodestate and
# fh.snapshots (snapshot_to = "bus"; no other principal may read or write it), read
# fh.findings (the job stage's table, the policy's input) and write fh.events (derived interruptions);
# Create because `fleethealth detect` makes any topic that is missing
acl fh-detect topic fh.telemetry Read Describe Create
acl fh-detect topic fh.steps Read Describe Create
acl fh-detect topic fh.events Read Write Describe Create
acl fh-detect topic fh.findings Read Write Describe Create
acl fh-detect topic fh.nodestate Read Write Describe Create
acl fh-detect topic fh.snapshots Read Write Describe Create   # detector snapshots: detector replicas only
acl fh-detect topic fh.recommendations Write Describe Create
acl fh-detect topic fh.deadletter Write Describe Create
for group in fh-detect fh-detect-node fh-detect-job fh-detect-policy; do
  acl fh-detect group "$group" Read Describe
done

# the adapter: reads recommendations, reports outcomes on fh.events (group fh-act-SCHEDULER)
acl fh-act topic fh.recommendations Read Describe
acl fh-act topic fh.events Write Describe
acl fh-act topic fh.deadletter Write Describe
for group in fh-act-kubernetes fh-act-slurm; do   # act --scheduler kubernetes | slurm
  acl fh-act group "$group" Read Describe
done

# the sweep: self-test results
acl fh-sweep topic fh.events Write Describe
