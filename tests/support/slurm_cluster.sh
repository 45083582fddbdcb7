#!/usr/bin/env bash
# One-node SLURM test cluster on this machine (munged + slurmctld + slurmd, all as root).
#
#   slurm_cluster.sh install  install slurm-wlm and munge with apt-get when missing (root; .ci/run
#                             calls it, bounded in time)
#   slurm_cluster.sh start    write config, start daemons, wait until the node is idle; exit 0
#                             (also when already up); fails, naming them, when the packages are
#                             missing
#   slurm_cluster.sh status   exit 0 when the cluster answers and the node is usable
#   slurm_cluster.sh stop     cancel jobs, stop the daemons, remove the state directory
#   slurm_cluster.sh env      print `export SLURM_CONF=...` (for eval)
#
# Environment (all optional):
#   AE_SLURM_DIR        state/config/log directory            (default /tmp/ae-slurm)
#   AE_SLURM_CPUS       CPUs the node advertises               (default: real count; may be larger,
#                       no binding is done, so e.g. 8 lets `srun -n8` run on a 2-core box)
#   AE_SLURM_KILLWAIT   seconds between SIGTERM and SIGKILL on scancel/time limit (default 30)
#   AE_SLURM_CTLD_PORT / AE_SLURM_SLURMD_PORT                  (default 6817 / 6818)
#   AE_SLURM_TIMEOUT    seconds to wait for the node to become idle (default 30)
#   AE_SLURM_NO_ETC=1   do not link /etc/slurm/slurm.conf (clients then need SLURM_CONF)
#
# Clients find the config via /etc/slurm/slurm.conf (a symlink to $AE_SLURM_DIR/etc/slurm.conf
# that `start` creates unless a foreign file is already there) or via SLURM_CONF.
set -uo pipefail

DIR="${AE_SLURM_DIR:-/tmp/ae-slurm}"
CONF="$DIR/etc/slurm.conf"
ETC_CONF=/etc/slurm/slurm.conf
TIMEOUT="${AE_SLURM_TIMEOUT:-30}"
KILLWAIT="${AE_SLURM_KILLWAIT:-30}"
CTLD_PORT="${AE_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${AE_SLURM_SLURMD_PORT:-6818}"
MUNGE_SOCK="$DIR/munge/munge.socket.2"
MARK="AE_SLURM_CLUSTER_DIR=$DIR"    # put in the daemons' environment to find them (and slurmstepd)
export SLURM_CONF="$CONF"

log() { echo "slurm_cluster: $*" >&2; }
STARTING=0
die() {
  echo "slurm_cluster: ERROR: $*" >&2
  if [ "$STARTING" = 1 ]; then   # leave nothing half-running; keep $DIR/log for a post-mortem
    STARTING=0; stop_daemons >/dev/null 2>&1
    echo "slurm_cluster: daemons stopped; logs kept in $DIR/log" >&2
  fi
  exit 1
}
show_logs() {  # tail the named daemons' log and stderr files
  local n f
  for n in "$@"; do for f in "$DIR/log/$n.log" "$DIR/log/$n.out"; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
  done; done
}
now() { date +%s.%N; }

# ---------------------------------------------------------------------------------------------
install_packages() {
  local need=()
  command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
  command -v munged >/dev/null 2>&1 || need+=(munge)
  [ ${#need[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need root to install ${need[*]} (or install slurm-wlm and munge first)"
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install slurm-wlm and munge by hand"
  # slurm-wlm is the metapackage for slurmctld + slurmd + slurm-client; install those directly.
  need=(slurm-wlm slurmctld slurmd slurm-client munge)
  log "installing ${need[*]} (apt-get)..."
  # Keep the packages' maintainer scripts from starting system services (no init here anyway).
  local prc=/usr/sbin/policy-rc.d made_prc=0
  if [ ! -e "$prc" ]; then printf '#!/bin/sh\nexit 101\n' > "$prc"; chmod 755 "$prc"; made_prc=1; fi
  local apt=(apt-get -y -q -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=120 --no-install-recommends)
  export DEBIAN_FRONTEND=noninteractive
  local out rc
  out="$("${apt[@]}" install "${need[@]}" 2>&1)"; rc=$?
  if [ $rc -ne 0 ]; then
    log "apt-get install failed (rc=$rc); running apt-get update once and retrying"
    apt-get -q -o DPkg::Lock::Timeout=120 update >/dev/null 2>&1 || log "apt-get update failed"
    out="$("${apt[@]}" install "${need[@]}" 2>&1)"; rc=$?
  fi
  [ $made_prc = 1 ] && rm -f "$prc"
  if [ $rc -ne 0 ]; then
    echo "$out" | tail -20 >&2
    die "could not install ${need[*]} with apt-get (rc=$rc)"
  fi
  for b in slurmctld slurmd sbatch munged; do
    command -v "$b" >/dev/null 2>&1 || die "$b still missing after installing packages"
  done
}

# ---------------------------------------------------------------------------------------------
# PIDs of the processes this cluster started: exe is one of ours and the environment has $MARK.
our_pids() {  # $1: regex of exe basenames (default: all)
  local want="${1:-munged|slurmctld|slurmd|slurmstepd}" p exe
  for p in /proc/[0-9]*; do
    exe="$(readlink "$p/exe" 2>/dev/null)" || continue
    [[ "$(basename "$exe")" =~ ^($want)(-wlm)?$ ]] || continue   # Debian: /usr/sbin/slurmd-wlm
    grep -zqxF "$MARK" "$p/environ" 2>/dev/null && echo "${p#/proc/}"
  done
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -1; }

cluster_up() {  # controller answers and the node is usable
  [ -f "$CONF" ] || return 1
  [ -n "$(our_pids slurmctld)" ] && [ -n "$(our_pids slurmd)" ] || return 1
  timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' || return 1
  case "$(node_state)" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

# ---------------------------------------------------------------------------------------------
write_config() {
  local host cpus mem topo=""
  host="$(uname -n)"; host="${host%%.*}"
  [ -n "$host" ] || die "cannot determine this host's name"
  if [ -n "${AE_SLURM_CPUS:-}" ]; then
    [[ "$AE_SLURM_CPUS" =~ ^[1-9][0-9]*$ ]] || { log "ERROR: AE_SLURM_CPUS=$AE_SLURM_CPUS is not a positive integer"; return 1; }
    cpus="$AE_SLURM_CPUS"           # virtual CPU count: Sockets=cpus, 1 core, 1 thread each
  else
    cpus="$(nproc --all 2>/dev/null || getconf _NPROCESSORS_ONLN)"
    # The hardware's own layout, so slurmd does not log "Node configuration differs".
    topo="$(slurmd -C 2>/dev/null | head -1 | grep -oE '(Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=[0-9]+' | tr '\n' ' ')"
    local c; c="$(slurmd -C 2>/dev/null | head -1 | grep -oE 'CPUs=[0-9]+' | cut -d= -f2)"
    [ -n "$c" ] && [ "$c" = "$cpus" ] || topo=""
  fi
  # Advertise a little less memory than MemTotal so the node is never drained for "Low RealMemory".
  mem=$(( $(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo) * 95 / 100 ))
  mkdir -p "$DIR"/{etc,state,spool,log,run,munge}
  chmod 755 "$DIR"
  cat > "$CONF" <<EOF
# Written by slurm_cluster.sh: one-node test cluster ($host, $cpus CPUs, ${mem} MB)
ClusterName=ae-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long SLURM holds a requeued job (default 120 s) before it may start again
# (slurmd refuses the job until its revoked credential expires); short, for the requeue test,
# and still ample for a credential, which slurmd checks within a second of its making.
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A requeued job becomes eligible once its credential expires (EligibleTime), but starts only at
# the next scheduling pass that looks at it: the main scheduler's, every 60 s by default (the
# backfill pass, every 30 s, runs only after a change of state, and time passing is none): the
# requeue test waited up to ~45 s instead of cred_expire. One node, a few jobs: a pass a second
# costs nothing.
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
# Reject at submit time what can never run here (e.g. -n3 on 2 CPUs) instead of pending forever
# with Reason=PartitionConfig.
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=$KILLWAIT
InactiveLimit=0
MinJobAge=300
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus ${topo}RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  if [ "${AE_SLURM_NO_ETC:-0}" != 1 ]; then
    if [ -L "$ETC_CONF" ] || [ ! -e "$ETC_CONF" ]; then
      mkdir -p /etc/slurm && ln -sfn "$CONF" "$ETC_CONF"
    elif ! cmp -s "$ETC_CONF" "$CONF"; then
      log "note: $ETC_CONF exists and is not ours; clients need SLURM_CONF=$CONF"
    fi
  fi
  echo "$host"
}

start_munge() {
  if [ -n "$(our_pids munged)" ] && timeout 5 munge -n --socket="$MUNGE_SOCK" 2>/dev/null \
       | timeout 5 unmunge --socket="$MUNGE_SOCK" >/dev/null 2>&1; then
    return 0
  fi
  local key="$DIR/munge/munge.key"
  chmod 755 "$DIR/munge"   # the socket must be reachable by job users; the key itself is 0400
  if [ ! -s "$key" ]; then
    dd if=/dev/urandom of="$key" bs=1024 count=1 status=none || die "cannot write $key"
    chmod 400 "$key"
  fi
  env "$MARK" munged --force --key-file="$key" --socket="$MUNGE_SOCK" \
      --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
      --seed-file="$DIR/munge/munged.seed" >>"$DIR/log/munged.out" 2>&1 \
    || { show_logs munged; die "munged failed to start"; }
  local i
  for i in $(seq 50); do
    munge -n --socket="$MUNGE_SOCK" 2>/dev/null | unmunge --socket="$MUNGE_SOCK" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  show_logs munged
  die "munged started but munge/unmunge does not work (socket $MUNGE_SOCK)"
}

port_busy() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q . ; }

cmd_start() {
  local t0; t0=$(now)
  local b
  for b in slurmctld slurmd sbatch munged; do
    command -v "$b" >/dev/null 2>&1 \
      || die "$b not found: install slurm-wlm and munge (as root: $0 install)"
  done
  if cluster_up; then log "already up ($(node_state))"; print_env; return 0; fi
  # Half-up (e.g. one daemon died): restart everything from a clean state.
  if [ -n "$(our_pids)" ]; then log "partially running; restarting"; stop_daemons; fi
  for p in "$CTLD_PORT" "$SLURMD_PORT"; do
    port_busy "$p" && die "port $p is in use by another process (set AE_SLURM_CTLD_PORT/AE_SLURM_SLURMD_PORT)"
  done
  STARTING=1
  local host; host="$(write_config)" || die "could not write $CONF"
  start_munge
  env "$MARK" slurmctld -c -f "$CONF" >>"$DIR/log/slurmctld.out" 2>&1 \
    || { show_logs slurmctld; die "slurmctld failed to start (config $CONF, logs in $DIR/log)"; }
  env "$MARK" slurmd -f "$CONF" -N "$host" >>"$DIR/log/slurmd.out" 2>&1 \
    || { show_logs slurmd; die "slurmd failed to start (config $CONF, logs in $DIR/log)"; }
  local deadline st
  deadline=$(( $(date +%s) + TIMEOUT ))
  while :; do
    st="$(node_state)"
    case "$st" in
      idle) break ;;
      down*|drain*|drained*|fail*)
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "node state after ${TIMEOUT}s: '${st:-no answer}'"
      scontrol show node "$host" 2>&1 | grep -i -E 'state|reason' >&2
      show_logs slurmctld slurmd
      die "cluster did not come up within ${TIMEOUT}s (logs in $DIR/log)"
    fi
    [ -n "$(our_pids slurmctld)" ] || { show_logs slurmctld; die "slurmctld exited (logs in $DIR/log)"; }
    [ -n "$(our_pids slurmd)" ] || { show_logs slurmd; die "slurmd exited (logs in $DIR/log)"; }
    sleep 0.2
  done
  log "up: node $host idle, $(sinfo -h -N -o '%c CPUs, %m MB') ($(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')s)"
  print_env
}

# ---------------------------------------------------------------------------------------------
stop_daemons() {
  local pids p i
  if [ -n "$(our_pids slurmctld)" ] && [ -f "$CONF" ]; then
    # Kill all jobs first so no slurmstepd/task outlives the cluster.
    timeout 5 scancel --full --signal=KILL --state=RUNNING -u "$(id -un)" >/dev/null 2>&1
    timeout 5 scancel -u "$(id -un)" >/dev/null 2>&1
    for i in $(seq 25); do
      [ -z "$(timeout 3 squeue -h -t R,CG,S 2>/dev/null)" ] && break; sleep 0.2
    done
  fi
  for what in slurmd slurmctld slurmstepd munged; do
    pids="$(our_pids "$what")"; [ -n "$pids" ] || continue
    kill -TERM $pids 2>/dev/null
    for i in $(seq 50); do [ -z "$(our_pids "$what")" ] && break; sleep 0.1; done
    pids="$(our_pids "$what")"; [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  done
  for i in $(seq 20); do [ -z "$(our_pids)" ] && break; sleep 0.1; done
  [ -z "$(our_pids)" ]
}

cmd_stop() {
  stop_daemons || log "warning: some processes survived: $(our_pids | tr '\n' ' ')"
  if [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ]; then rm -f "$ETC_CONF"; fi
  case "$DIR" in /|"") ;; *) rm -rf "$DIR" ;; esac
  log "stopped"
}

cmd_status() {
  if cluster_up; then
    echo "up: $(sinfo -h -N -o '%N %T %c CPUs %m MB'); conf $CONF"
    echo "pids: $(our_pids | tr '\n' ' ')"
    return 0
  fi
  echo "down$( [ -n "$(our_pids)" ] && echo " (stray pids: $(our_pids | tr '\n' ' '))")"
  return 1
}

print_env() { echo "export SLURM_CONF=$CONF"; }

case "${1:-}" in
  install) install_packages ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) print_env ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
