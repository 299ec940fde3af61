#!/usr/bin/env bash
# Start a real single-node Slurm cluster on this host (slurmctld + slurmd, munge auth) for the Slurm launcher tests.
# Needs root and Debian's packages; installs them when missing. Idempotent: a running cluster is left as it is.
# The node advertises more CPUs than the machine has (SlurmdParameters=config_overrides), so a test can run its
# server steps, its trainer step and its controller side by side on a 2-core machine.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "start_slurm: needs root" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
  echo "start_slurm: already running"; exit 0
fi

host=$(hostname -s)
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)

# munge: a key readable only by the munge user
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --force >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
fi
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "/usr/sbin/munged"

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=areal
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=${host} CPUs=16 RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
cat > /etc/slurm/cgroup.conf <<CONF
CgroupPlugin=autodetect
IgnoreSystemd=yes
CONF

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 1 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)$'; then
    sinfo
    exit 0
  fi
  sleep 0.5
done
echo "start_slurm: the node did not come up idle" >&2
sinfo -N -l >&2 || true
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
