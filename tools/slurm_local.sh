#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, to try configs/cluster/slurm.sbatch before a cluster queue (and for
# tests/distributed/test_slurm_real.py). Debian/Ubuntu, as root; nothing is installed as a service and nothing is written outside
# the folder given to `start`. docs/scaling.md.
#   tools/slurm_local.sh install        # apt-get install munge, slurmctld, slurmd, slurm-client when missing
#   tools/slurm_local.sh start DIR      # key, slurm.conf, munged + slurmctld + slurmd, all in DIR; waits for the node
#   export SLURM_CONF=DIR/slurm.conf    # then sbatch, squeue, scontrol ... talk to it
#   tools/slurm_local.sh stop DIR       # stops the three daemons by the process ids in DIR/*.pid
# The node has as many CPUs as this machine, no GPUs. Ports: free ones, chosen at start (SLURM_LOCAL_PORTS="ctld d"
# to fix them).
set -euo pipefail

die() { echo "slurm_local: $*" >&2; exit 1; }

install() {
  local missing=()
  command -v munged > /dev/null || missing+=(munge)
  command -v slurmctld > /dev/null || missing+=(slurmctld)
  command -v slurmd > /dev/null || missing+=(slurmd)
  command -v sbatch > /dev/null || missing+=(slurm-client)
  [ ${#missing[@]} = 0 ] && return
  command -v apt-get > /dev/null || die "needs ${missing[*]} and there is no apt-get to install them"
  [ "$(id -u)" = 0 ] || die "needs ${missing[*]}: run as root to install them"
  echo "slurm_local: installing ${missing[*]}" >&2
  apt-get update -q > /dev/null
  # policy-rc.d-less machines would start the packaged services: nothing here uses them, `start` runs its own.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null
}

free_ports() {
  python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
}

# Waits up to $2 seconds for the command $1 to succeed.
wait_for() {
  local deadline=$((SECONDS + $2))
  until eval "$1" > /dev/null 2>&1; do
    [ "${SECONDS}" -lt "${deadline}" ] || return 1
    sleep 0.5
  done
}

start() {
  local dir host cpus ctld_port d_port
  dir=$(mkdir -p "$1" && cd "$1" && pwd)
  host=$(hostname -s)
  cpus=$(nproc)
  read -r ctld_port d_port <<< "${SLURM_LOCAL_PORTS:-$(free_ports)}"
  mkdir -p "${dir}/munge" "${dir}/state" "${dir}/spool" "${dir}/log"
  chmod 700 "${dir}/munge"

  # munge authenticates every message between the daemons and the commands; its key never leaves DIR.
  head -c 1024 /dev/urandom > "${dir}/munge/munge.key"
  chmod 400 "${dir}/munge/munge.key"
  # --force: as root, with DIR under a world-writable /tmp.
  munged --force --socket="${dir}/munge/munge.socket" --key-file="${dir}/munge/munge.key" \
    --pid-file="${dir}/munged.pid" --log-file="${dir}/log/munged.log" --seed-file="${dir}/munge/munged.seed"
  wait_for "munge --socket='${dir}/munge/munge.socket' -n < /dev/null" 30 || die "munged did not start: ${dir}/log"

  cat > "${dir}/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again after cred_expire seconds (default 120), and pending jobs are looked at every
# sched_interval seconds (default 60): short, so that a requeued job restarts at once.
AuthInfo=socket=${dir}/munge/munge.socket,cred_expire=5
SchedulerParameters=sched_interval=1
CredType=cred/munge
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
SelectType=select/cons_tres
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
ReturnToService=2
# Finished jobs stay visible to scontrol for an hour (there is no accounting database for sacct).
MinJobAge=3600
# Job ids of two local clusters differ: Lightning derives the ranks' rendezvous port from the job id.
FirstJobId=$((RANDOM % 9000 + 1000))
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="${dir}/slurm.conf"
  # -i: ignore state a previous slurmctld may have left (there is none: StateSaveLocation is new).
  slurmctld -i
  wait_for "scontrol ping | grep -q UP" 60 || die "slurmctld did not start: ${dir}/log/slurmctld.log"
  slurmd
  wait_for "sinfo -h -N -o %t | grep -qx idle" 60 || die "node ${host} not idle: ${dir}/log/slurmd.log"
  echo "slurm_local: running in ${dir}; export SLURM_CONF=${dir}/slurm.conf" >&2
}

stop() {
  local dir=$1 name pid
  if [ -f "${dir}/slurmctld.pid" ] && kill -0 "$(cat "${dir}/slurmctld.pid")" 2> /dev/null; then
    # Jobs still there end first, so that no job process outlives the daemons.
    SLURM_CONF="${dir}/slurm.conf" scancel --full --user=root 2> /dev/null || true
    SLURM_CONF="${dir}/slurm.conf" wait_for "[ -z \"\$(squeue -h -t running,completing)\" ]" 60 || true
  fi
  for name in slurmd slurmctld munged; do  # the node first, munge last: the others use it to the end
    [ -f "${dir}/${name}.pid" ] || continue
    pid=$(cat "${dir}/${name}.pid")
    kill "${pid}" 2> /dev/null || continue
    wait_for "! kill -0 ${pid}" 30 || kill -9 "${pid}" 2> /dev/null || true
  done
}

case "${1:-}" in
  install) install ;;
  start) [ $# = 2 ] || die "usage: $0 start DIR"; install; start "$2" ;;
  stop) [ $# = 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
