#!/usr/bin/env bash
# A multi-host test bed on one machine: network namespaces NAME0..NAME(N-1) joined by a bridge
# NAMEb, each with its own address SUBNET.1K (K = 0..N-1; the machine itself is SUBNET.1 on the
# bridge), its own loopback and no route anywhere but the bridge's /24. Needs root and iproute2.
#   bash scripts/testbed/netns_testbed.sh up NAME SUBNET N     # e.g. up m3a1b2c3 10.77.0 2
#   bash scripts/testbed/netns_testbed.sh run NAME K CMD...    # CMD on host K, hostname nodeK, the
#                                                      # machine's mounts kept (nsenter --net)
#   bash scripts/testbed/netns_testbed.sh down NAME N          # stops every process left in the
#                                                      # namespaces, deletes them and the bridge
# `up` tears down what it made if a step fails; `down` is safe to repeat. NAME is at most 10
# characters (link names are NAMEb, NAMEvK, NAMEpK; the kernel allows 15). Only the private
# addresses given here are touched.
set -euo pipefail
action="${1:?up|run|down}"; name="${2:?NAME}"
[[ "$name" =~ ^[a-z0-9]{1,10}$ ]] || { echo "netns_testbed: NAME is 1-10 of [a-z0-9]" >&2; exit 2; }

down() {
    local n="$1" k pids
    for ((k = 0; k < n; k++)); do
        ip link del "${name}v$k" 2>/dev/null || true  # its pair goes with it
        ip netns list | grep -qw "${name}$k" || continue
        # processes started in the namespace (ip netns del would leave them running)
        pids="$(ip netns pids "${name}$k" || true)"
        if [ -n "$pids" ]; then
            kill -TERM $pids 2>/dev/null || true
            for _ in $(seq 20); do [ -z "$(ip netns pids "${name}$k")" ] && break; sleep 0.5; done
            pids="$(ip netns pids "${name}$k" || true)"
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "${name}$k"
    done
    ip link del "${name}b" 2>/dev/null || true
    # a namespace's veth goes away shortly after the namespace: wait for it
    for _ in $(seq 20); do
        ip -o link | grep -q "${name}" || break
        sleep 0.25
    done
}

up() {
    local subnet="${1:?SUBNET (three octets)}" n="${2:?N}" k
    [[ "$subnet" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "netns_testbed: SUBNET is 10.X.Y" >&2; exit 2; }
    trap 'down "$n"' ERR
    ip link add "${name}b" type bridge
    ip link set "${name}b" up
    ip addr add "$subnet.1/24" dev "${name}b"
    for ((k = 0; k < n; k++)); do
        ip netns add "${name}$k"
        ip link add "${name}v$k" type veth peer name "${name}p$k"
        ip link set "${name}p$k" netns "${name}$k"
        ip link set "${name}v$k" master "${name}b"
        ip link set "${name}v$k" up
        ip netns exec "${name}$k" ip addr add "$subnet.1$k/24" dev "${name}p$k"
        ip netns exec "${name}$k" ip link set "${name}p$k" up
        ip netns exec "${name}$k" ip link set lo up
    done
    trap - ERR
}

case "$action" in
    up) up "${3:-}" "${4:-}" ;;
    down) down "${3:?N}" ;;
    run)
        k="${3:?K}"; shift 3
        exec nsenter --net="/var/run/netns/${name}$k" unshare --uts \
            sh -c 'hostname "$0"; exec "$@"' "node$k" "$@" ;;
    *) echo "netns_testbed: unknown action $action" >&2; exit 2 ;;
esac
