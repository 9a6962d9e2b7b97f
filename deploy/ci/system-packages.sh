#!/usr/bin/env bash
# Debian packages the test suite uses (with FH_IMAGES=1: what deploy/ci/images.sh needs instead): a real single-node Slurm (slurmctld + slurmd + munge) for
# the Slurm adapter tests. Skipped quietly where apt is unavailable; those tests then skip with a reason.
set -uo pipefail
if [[ "${FH_IMAGES:-0}" == 1 ]]; then   # deploy/ci/images.sh: buildah and debootstrap, required
  command -v buildah >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 && exit 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq buildah debootstrap >/dev/null
  exit $?
fi
if command -v sinfo >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then exit 0; fi
command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: Slurm tests will be skipped" >&2; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null \
  || echo "could not install slurm-wlm/munge: Slurm tests will be skipped" >&2
exit 0
