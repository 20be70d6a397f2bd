#!/usr/bin/env bash
# Stop the single-machine SLURM that slurm/start_local.sh started (same RZ_SLURM_DIR): cancel its
# jobs, then end slurmd x2 and slurmctld (pids in $RZ_SLURM_DIR) and munged if it started it.
set -uo pipefail

DIR="${RZ_SLURM_DIR:-/tmp/rz-slurm}"
CONF="$DIR/slurm.conf"
log() { echo "[stop_local] $*" >&2; }

if [[ ! -f "$CONF" ]]; then log "nothing to stop ($CONF missing)"; exit 0; fi
export SLURM_CONF="$CONF"

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Jobs first, so their processes end with them (slurmd would leave running steps behind).
if alive "$DIR/slurmctld.pid" && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
  scancel --full $(squeue -h -o %A | sort -u) 2>/dev/null
  for _ in $(seq 50); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.2; done
fi

stop() {  # pidfile name
  local f="$DIR/$1"
  if alive "$f"; then
    local pid; pid=$(cat "$f")
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    log "stopped $1 ($pid)"
  fi
  rm -f "$f"
}
stop slurmd.node1.pid
stop slurmd.node2.pid
stop slurmctld.pid
if [[ -f "$DIR/munged.ours" ]]; then  # start_local.sh started this munged
  munged --stop >/dev/null 2>&1 && log "stopped munged"
  rm -f "$DIR/munged.ours"
fi
exit 0
