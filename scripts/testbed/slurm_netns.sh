#!/usr/bin/env bash
# A two-node Slurm cluster across network namespaces (Debian's slurm-wlm + munge), for the Slurm
# launcher test and CI: one slurmd per namespace of the test bed (scripts/testbed/netns_testbed.sh),
# each with NodeAddr set to its namespace's address and its own hostname; slurmctld on the
# machine at the bridge's address. No systemd: the daemons are started by hand, and clients need
# SLURM_CONF.
#   bash scripts/testbed/slurm_netns.sh start DIR BED SUBNET   # writes DIR/slurm.conf, starts munged (if
#                                                      # not running), slurmctld and slurmd n1 in
#                                                      # namespace BED0 (SUBNET.10), n2 in BED1
#   bash scripts/testbed/slurm_netns.sh stop DIR               # stops the daemons this script started
#                                                      # (pid files; munged only if it started it)
# munged's socket is a file, so every namespace shares the one munged. slurmd is started with
# nsenter --net (not `ip netns exec`, which remounts /sys and hides the cgroup tree slurmd needs).
# MpiDefault=none (no PMIx here); proctrack/cgroup, because linuxproc loses vLLM's engines,
# which start their own sessions; cgroup v1 on this machine. Needs root (slurmd, cgroups).
# Two CPUs per node (this machine's two cores): a set's task takes one, so a sweep array task
# can run beside the set. KillWait=30 (Slurm's default): a task the step ends gets SIGTERM and that
# long to stop its server and publish its record before SIGKILL.
set -euo pipefail
action="${1:?start|stop}"; dir="$(realpath -m "${2:?DIR}")"
conf="$dir/slurm.conf"
bed="${3:-}"; subnet="${4:-}"

start() {
    [ -n "$bed" ] && [ -n "$subnet" ] || { echo "slurm_netns: start DIR BED SUBNET" >&2; return 2; }
    mkdir -p "$dir"/{state,spool,log,run}
    cat > "$conf" <<CONF
ClusterName=m3netns
SlurmctldHost=$(hostname)($subnet.1)
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
NodeName=n1 NodeHostname=n1 NodeAddr=$subnet.10 Port=16821 CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$subnet.11 Port=16821 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=netns Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
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
    for k in 1 2; do
        nsenter --net="/var/run/netns/$bed$((k - 1))" unshare --uts \
            sh -c 'hostname "$0"; exec slurmd -f "$1" -N "$0"' "n$k" "$conf"
    done
    for _ in $(seq 60); do
        [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u)" = "idle" ] && { echo "$conf"; return 0; }
        sleep 1
    done
    echo "slurm_netns: nodes not idle after 60 s; see $dir/log" >&2
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
