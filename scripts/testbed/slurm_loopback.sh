#!/usr/bin/env bash
# A two-node Slurm cluster on 127.0.0.1 (Debian's slurm-wlm + munge), for the Slurm launcher test
# and CI. No systemd: the daemons are started by hand, and clients need SLURM_CONF.
#   bash scripts/testbed/slurm_loopback.sh start DIR   # writes DIR/slurm.conf, starts munged (if not
#                                              # running), slurmctld and two slurmd (n1, n2)
#   bash scripts/testbed/slurm_loopback.sh stop DIR    # stops the daemons this script started (pid files;
#                                              # munged only if this script started it)
# MpiDefault=none (no PMIx here); proctrack/cgroup, because linuxproc loses vLLM's engines,
# which start their own sessions; cgroup v1 on this machine. Needs root (slurmd, cgroups).
# Two CPUs per node (this machine's two cores): a set's task takes one, so a sweep array task
# can run beside the set. KillWait=30 (Slurm's default): a task the step ends gets SIGTERM and that
# long to stop its server and publish its record before SIGKILL.
set -euo pipefail
action="${1:?start|stop}"; dir="$(realpath -m "${2:?DIR}")"
conf="$dir/slurm.conf"

start() {
    mkdir -p "$dir"/{state,spool,log,run}
    cat > "$conf" <<CONF
ClusterName=m3loop
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=16821 CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=16822 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=loop Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
    printf 'CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\n' > "$dir/cgroup.conf"
    if ! pgrep -x munged > /dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
        su munge -s /bin/sh -c /usr/sbin/munged
        for _ in $(seq 20); do [ -s /run/munge/munged.pid ] && break; sleep 0.5; done
        cp /run/munge/munged.pid "$dir/run/munged.pid"  # ours to stop; one already running is not
    fi
    export SLURM_CONF="$conf"
    slurmctld -f "$conf"
    slurmd -f "$conf" -N n1
    slurmd -f "$conf" -N n2
    for _ in $(seq 60); do
        [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u)" = "idle" ] && { echo "$conf"; return 0; }
        sleep 1
    done
    echo "slurm_loopback: nodes not idle after 60 s; see $dir/log" >&2
    return 1
}

stop() {  # and wait: a start right after must not find them still exiting (SIGKILL after 15 s)
    local pidfile pid
    for pidfile in "$dir"/run/slurmd-n1.pid "$dir"/run/slurmd-n2.pid "$dir"/run/slurmctld.pid \
                   "$dir"/run/munged.pid; do
        [ -s "$pidfile" ] || continue
        pid="$(cat "$pidfile")"
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    done
}

"$action"
