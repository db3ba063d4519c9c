#!/usr/bin/env bash
# Install a single-node Slurm (Debian's slurmctld, slurmd, slurm-client) and munge, for the
# tests in tests/test_slurm.py. Idempotent: does nothing when the daemons and client are present.
# Quiet and non-interactive; exits non-zero (with a message) when it cannot install.
set -euo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_slurm.sh: need root to apt-get install ${need[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: apt-get not available; install ${need[*]} by hand" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The postinst scripts try to start services; there is no systemd/init here, so forbid that.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "install_slurm.sh: installed ${need[*]}"
