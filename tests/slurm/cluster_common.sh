# Sourced by start_local_cluster.sh and start_two_node_cluster.sh: the Debian packages and munge, which both
# clusters share (munged only authenticates a uid; one daemon serves every slurmctld and slurmd on the machine).
# Written against Debian 12's slurm-wlm 22.05 and munge 0.5.15; no systemd (containers): daemons start directly.

install_slurm_packages() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
            || ! command -v sbatch >/dev/null; then
        log "installing munge, slurmctld, slurmd, slurm-client from the Debian packages"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null
    fi
}

start_munge() {
    # The key is made by the package's postinst; make one if an image stripped it.
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "starting munged"
        runuser -u munge -- /usr/sbin/munged
        for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
        munge -n | unmunge >/dev/null || { log "munged does not answer"; exit 3; }
    fi
}

pid_alive() {
    # The daemon whose pid file is $1 runs (by pid file, not by name: two clusters run the same daemons); a zombie
    # (killed, not yet reaped by init) does not, nor another program holding the pid of a stale file (after a
    # reboot, /run/slurmctld.pid can name any live process): the process must be a slurm daemon.
    local pid
    pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
        ! grep -q '^State:.*zombie' "/proc/$pid/status" 2>/dev/null &&
        grep -Eq '^(slurmctld|slurmd)$' "/proc/$pid/comm" 2>/dev/null
}
