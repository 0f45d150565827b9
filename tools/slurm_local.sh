#!/usr/bin/env bash
# A real SLURM cluster on this machine, one node or several, to try configs/cluster/slurm.sbatch before a cluster queue
# (and for tests/distributed/test_slurm_real.py and test_two_nodes.py). Debian/Ubuntu, as root; nothing is
# installed as a service and nothing is written outside the folder given to `start`. docs/scaling.md.
#   tools/slurm_local.sh install                # apt-get install munge, slurmctld, slurmd, slurm-client when missing
#   tools/slurm_local.sh start DIR              # key, slurm.conf, munged + slurmctld + slurmd, all in DIR; waits for the node
#   tools/slurm_local.sh start DIR --nodes 2    # two nodes: one slurmd per node (`slurmd -N name`), each on its own port
#   export SLURM_CONF=DIR/slurm.conf            # then sbatch, squeue, scontrol ... talk to it
#   tools/slurm_local.sh stop DIR               # stops the daemons by the process ids in DIR/*.pid
# Every node has as many CPUs as this machine, no GPUs. Ports: free ones, chosen at start (SLURM_LOCAL_PORTS="ctld d"
# to fix them; with N nodes "ctld d0 ... dN-1"). Several nodes need a slurmd built with --enable-multiple-slurmd
# (Debian's is: `scontrol show config` says MULTIPLE_SLURMD = Yes). Their names are this machine's short host name,
# then NAME-1, NAME-2 ...: a job on all of them lists NAME first, and Lightning's SLURMEnvironment takes a job's first
# node name as MASTER_ADDR, so that one must resolve (it does, to this machine); the others need not (SLURM reaches
# every slurmd at 127.0.0.1).
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

free_ports() {  # $1 of them
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
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
  local dir=$1 nodes=$2 host cpus ctld_port d_ports names=() nodelines="" slurmd_files="slurmd" i
  dir=$(mkdir -p "${dir}" && cd "${dir}" && pwd)
  host=$(hostname -s)
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the machine's CPUs (nproc would honour the OMP limits)
  read -r ctld_port d_ports <<< "${SLURM_LOCAL_PORTS:-$(free_ports $((nodes + 1)))}"
  read -r -a d_ports <<< "${d_ports}"
  [ ${#d_ports[@]} = "${nodes}" ] || die "SLURM_LOCAL_PORTS: give the slurmctld port and ${nodes} slurmd port(s)"
  if [ "${nodes}" = 1 ]; then
    names=("${host}")
    nodelines="NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} State=UNKNOWN"
  else
    # One slurmd per node on this host: each its own port, pid file, log and spool folder (%n: the node's name).
    slurmd_files="slurmd-%n"
    for ((i = 0; i < nodes; i++)); do
      names+=("${host}$([ "${i}" = 0 ] || echo "-${i}")")
      nodelines+="NodeName=${names[i]} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${d_ports[i]} CPUs=${cpus} State=UNKNOWN"$'\n'
    done
  fi
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
SlurmdPort=${d_ports[0]}
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
SlurmdPidFile=${dir}/${slurmd_files}.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/${slurmd_files}.log
SelectType=select/cons_tres
# Cores are what jobs are given (memory is not counted), and a job that asks (sbatch --oversubscribe) may share them
# with other such jobs: tests/distributed/test_slurm_real.py runs its four two-task jobs side by side on a small machine.
SelectTypeParameters=CR_Core
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
${nodelines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  export SLURM_CONF="${dir}/slurm.conf"
  # -i: ignore state a previous slurmctld may have left (there is none: StateSaveLocation is new).
  slurmctld -i
  wait_for "scontrol ping | grep -q UP" 60 || die "slurmctld did not start: ${dir}/log/slurmctld.log"
  if [ "${nodes}" = 1 ]; then
    slurmd
  else
    for name in "${names[@]}"; do slurmd -N "${name}"; done
  fi
  wait_for "[ \$(sinfo -h -N -t idle -o %N | wc -l) = ${nodes} ]" 60 || die "nodes ${names[*]} not idle: ${dir}/log"
  echo "slurm_local: running in ${dir}; export SLURM_CONF=${dir}/slurm.conf" >&2
}

stop() {
  local dir=$1 name pid
  if [ -f "${dir}/slurmctld.pid" ] && kill -0 "$(cat "${dir}/slurmctld.pid")" 2> /dev/null; then
    # Jobs still there end first, so that no job process outlives the daemons.
    SLURM_CONF="${dir}/slurm.conf" scancel --full --user=root 2> /dev/null || true
    SLURM_CONF="${dir}/slurm.conf" wait_for "[ -z \"\$(squeue -h -t running,completing)\" ]" 60 || true
  fi
  for name in "${dir}"/slurmd*.pid "${dir}/slurmctld.pid" "${dir}/munged.pid"; do  # nodes first, munge last
    [ -f "${name}" ] || continue
    pid=$(cat "${name}")
    kill "${pid}" 2> /dev/null || continue
    wait_for "! kill -0 ${pid}" 30 || kill -9 "${pid}" 2> /dev/null || true
  done
}

case "${1:-}" in
  install) install ;;
  start)
    if [ $# = 2 ]; then
      nodes=1
    elif [ $# = 4 ] && [ "$3" = --nodes ] && [[ "$4" =~ ^[1-9][0-9]*$ ]]; then
      nodes=$4
    else
      die "usage: $0 start DIR [--nodes N]"
    fi
    install
    start "$2" "${nodes}"
    ;;
  stop) [ $# = 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR [--nodes N] | stop DIR" ;;
esac
