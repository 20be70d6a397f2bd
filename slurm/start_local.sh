#!/usr/bin/env bash
# Start a real single-machine SLURM: munge, slurmctld and two slurmd (node1, node2) on loopback.
#
#   slurm/start_local.sh            # installs Debian's slurm 22.05 + munge if missing, then starts
#   eval "$(slurm/start_local.sh --env)"   # same, and export SLURM_CONF for this shell
#   slurm/stop_local.sh             # stops what this script started
#
# Two slurmd because a heterogeneous job (learner component + rollout component) never starts on
# one node. Everything lives in $RZ_SLURM_DIR (default /tmp/rz-slurm): config, state, logs, pids.
# Needs root (apt-get, daemons). Idempotent: a running cluster is left as it is (< 1 s).
set -euo pipefail

DIR="${RZ_SLURM_DIR:-/tmp/rz-slurm}"
PORT="${RZ_SLURM_PORT:-16817}"  # slurmctld; node1/node2 slurmd use PORT+1, PORT+2
CONF="$DIR/slurm.conf"
PRINT_ENV=0
[[ "${1:-}" == "--env" ]] && PRINT_ENV=1
log() { echo "[start_local] $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  log "needs root (installs packages, runs munged/slurmctld/slurmd)"; exit 1
fi

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.node1.pid" && alive "$DIR/slurmd.node2.pid" \
   && SLURM_CONF="$CONF" scontrol ping >/dev/null 2>&1; then
  log "already running ($CONF)"
  [[ $PRINT_ENV == 1 ]] && echo "export SLURM_CONF=$CONF"
  exit 0
fi

mkdir -p "$DIR"
# munged that runs now is not ours (a package install may start one: then it is ours to stop).
MUNGED_BEFORE=$(pgrep -x munged || true)
# ---------------------------------------------------------------- install (only when missing)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge (apt)"
  # No systemd here: keep the packages' postinst from trying to start services.
  GUARD=/usr/sbin/policy-rc.d
  MADE_GUARD=0
  if [[ ! -e $GUARD ]]; then printf '#!/bin/sh\nexit 101\n' >$GUARD; chmod 755 $GUARD; MADE_GUARD=1; fi
  trap 'if [[ $MADE_GUARD == 1 ]]; then rm -f '"$GUARD"'; fi' EXIT
  export DEBIAN_FRONTEND=noninteractive
  PKGS="slurmctld slurmd slurm-client munge"
  # Try the package lists we have first; refresh them only if that fails (fresh machines).
  if ! apt-get install -y -q --no-install-recommends $PKGS >"$DIR/apt.log" 2>&1; then
    apt-get update -q >>"$DIR/apt.log" 2>&1
    apt-get install -y -q --no-install-recommends $PKGS >>"$DIR/apt.log" 2>&1 \
      || { log "apt-get install failed; see $DIR/apt.log"; tail -5 "$DIR/apt.log" >&2; exit 3; }
  fi
fi

mkdir -p "$DIR"/state "$DIR"/spool/node1 "$DIR"/spool/node2 "$DIR"/log
# Stale pids from an earlier, half-stopped cluster: stop those daemons first.
for f in "$DIR"/slurmctld.pid "$DIR"/slurmd.node1.pid "$DIR"/slurmd.node2.pid; do
  if alive "$f"; then kill "$(cat "$f")" 2>/dev/null || true; fi
  rm -f "$f"
done

# ---------------------------------------------------------------- munge
if [[ ! -s /etc/munge/munge.key ]]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key 2>/dev/null || true
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  # munged must not run as root; run it as the package's munge user.
  runuser -u munge -- munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || { log "munge does not work"; exit 4; }
if [[ -z "$MUNGED_BEFORE" ]]; then touch "$DIR/munged.ours"; fi  # stop_local.sh ends it

# ---------------------------------------------------------------- config
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
cat >"$CONF" <<EOF
# Written by slurm/start_local.sh: one host, two compute daemons, all traffic on loopback.
ClusterName=rzlocal
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool/%n
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.%n.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.%n.log
# No cgroups in this container: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# No accounting daemon: no sacct. Finished jobs stay in scontrol for MinJobAge seconds.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# A heterogeneous job is started by the backfill scheduler; run it every second.
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
KillWait=10
# A requeued job may start again only after its killed instance's credential expires (slurmd refuses
# the same job id until then: "Job credential revoked"). The default 120 s makes the preemption
# test slow; 10 s is plenty on one host.
AuthInfo=cred_expire=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
SlurmctldDebug=info
SlurmdDebug=info
NodeName=node1 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
NodeName=node2 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

# ---------------------------------------------------------------- daemons
export SLURM_CONF="$CONF"
slurmctld -f "$CONF" -i  # -i: ignore state left by an earlier cluster in $DIR/state
for n in node1 node2; do slurmd -f "$CONF" -N "$n"; done
for _ in $(seq 100); do
  if scontrol ping >/dev/null 2>&1 && [[ $(sinfo -h -o '%t' -N | grep -c -E '^(idle|mix|alloc)') -ge 2 ]]; then
    log "up: $(sinfo -h -N -o '%N %t' | tr '\n' ' ')(SLURM_CONF=$CONF)"
    [[ $PRINT_ENV == 1 ]] && echo "export SLURM_CONF=$CONF"
    exit 0
  fi
  sleep 0.2
done
log "cluster did not come up; logs in $DIR/log"
tail -5 "$DIR"/log/*.log >&2 || true
exit 5
