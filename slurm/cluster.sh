#!/usr/bin/env bash
# The embedded one-node dev cluster: real Slurm 22.05 with real accounting (slurmdbd + MariaDB), as root.
#
#   slurm/cluster.sh up      install packages if missing, write configs, start daemons, wait until ready
#   slurm/cluster.sh down    stop the daemons this script started (by their pid files, never by pattern)
#   slurm/cluster.sh status  one line per daemon, then sinfo
#
# Everything it owns lives under $STATE (default /var/lib/mcorekit-slurm) and $RUN (/run/mcorekit-slurm),
# plus /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf, which it writes only if they are absent or
# carry its own header line. "up" on a running, healthy cluster returns at once.
set -euo pipefail

CLUSTER=${MCOREKIT_CLUSTER_NAME:-mcorekit}
STATE=${MCOREKIT_SLURM_STATE:-/var/lib/mcorekit-slurm}
RUN=${MCOREKIT_SLURM_RUN:-/run/mcorekit-slurm}
DB_PORT=${MCOREKIT_SLURM_DB_PORT:-3307}
# The node advertises more CPUs than the machine has (SlurmdParameters=config_overrides) so that a few
# small test jobs run side by side on a 2-core machine. Jobs are not pinned (task/none), so this only
# affects scheduling.
NODE_CPUS=${MCOREKIT_SLURM_NODE_CPUS:-8}
HEADER="# written by mcorekit slurm/cluster.sh"
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf

log() { echo "cluster: $*" >&2; }
die() { echo "cluster: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "the dev cluster runs its daemons as root; run as root (sudo make cluster-up)"

# --- pid-file bookkeeping: a daemon is "ours and alive" if its pid file names a live process of that name
alive() {  # alive NAME PIDFILE
  local pid
  [ -s "$2" ] || return 1
  pid=$(cat "$2")
  [ -d "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

healthy() {
  sinfo -h -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)' && sacct -n -X -S now-1minutes >/dev/null 2>&1
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  command -v mariadbd >/dev/null || missing+=(mariadb-server)
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]} (a minute or two)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the packages from starting their own services; we start ours below.
  apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server >/dev/null
}

check_owned() {  # refuse to overwrite a config this script did not write
  if [ -e "$1" ] && ! head -n1 "$1" | grep -qxF "$HEADER"; then
    die "$1 exists and was not written by mcorekit; move it aside (this dev cluster must not replace a real cluster's config)"
  fi
}

write_configs() {
  local node host mem
  check_owned "$CONF"; check_owned "$DBD_CONF"
  host=$(hostname -s)
  node=$(slurmd -C | head -n1)
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
  mkdir -p /etc/slurm "$STATE"/{ctld,spool,log} "$RUN"
  cat > "$CONF" <<EOF
$HEADER
ClusterName=$CLUSTER
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=30
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups in this sandbox: track processes by parent pid and do not bind tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
# Short waits so that timeouts and cancellations resolve quickly in tests.
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
JobCompType=jobcomp/none
NodeName=$host CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  if [ ! -s "$STATE/db.password" ]; then
    (umask 077; head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' > "$STATE/db.password")
  fi
  (umask 077; cat > "$DBD_CONF" <<EOF
$HEADER
AuthType=auth/munge
DbdHost=$host
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE/db.password")
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DBD_CONF"
  # slurmctld refuses a state directory made under another ClusterName; it is ours, so start it afresh.
  if [ -f "$STATE/ctld/clustername" ] && [ "$(cat "$STATE/ctld/clustername")" != "$CLUSTER" ]; then
    rm -rf "${STATE:?}/ctld" && mkdir -p "$STATE/ctld"
  fi
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local secs=$1 what=$2; shift 2
  for _ in $(seq $((secs * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "$what did not come up within ${secs}s; see the logs under $STATE/log"
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged is already serving (ours or the system's)
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null)
    chown munge:munge /etc/munge/munge.key
  fi
  mkdir -p "$RUN/munge" && chown munge:munge "$RUN/munge"
  touch "$STATE/log/munged.log" && chown munge:munge "$STATE/log/munged.log"
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --pid-file="$RUN/munge/munged.pid" --log-file="$STATE/log/munged.log"
  wait_for 20 munged sh -c 'munge -n </dev/null | unmunge'
}

mysql_cmd() { mariadb --protocol=socket --socket="$RUN/mysql/mysqld.sock" -u root "$@"; }

start_mariadb() {
  local datadir=$STATE/mysql
  mkdir -p "$RUN/mysql" && chown mysql:mysql "$RUN/mysql"
  if ! alive mariadbd "$RUN/mysql/mysqld.pid"; then
    if [ ! -d "$datadir/mysql" ]; then
      log "initialising MariaDB data directory $datadir"
      mkdir -p "$datadir" && chown mysql:mysql "$datadir"
      mariadb-install-db --user=mysql --datadir="$datadir" --auth-root-authentication-method=socket \
        --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $STATE/log/mariadb-install.log"
    fi
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    touch "$STATE/log/mariadb.log" && chown mysql:mysql "$STATE/log/mariadb.log"
    setsid /usr/sbin/mariadbd --user=mysql --datadir="$datadir" --socket="$RUN/mysql/mysqld.sock" \
      --pid-file="$RUN/mysql/mysqld.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
      --log-error="$STATE/log/mariadb.log" --innodb-buffer-pool-size=64M --skip-log-bin \
      </dev/null >/dev/null 2>&1 &
    wait_for 60 MariaDB mysql_cmd -e 'SELECT 1'
  fi
  local pw; pw=$(cat "$STATE/db.password")
  mysql_cmd <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
}

start_slurmdbd() {
  if ! alive slurmdbd "$RUN/slurmdbd.pid"; then
    log "starting slurmdbd"
    slurmdbd
    wait_for 60 slurmdbd sacctmgr -n list cluster
  fi
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
}

start_slurmctld() {
  alive slurmctld "$RUN/slurmctld.pid" && return 0
  log "starting slurmctld"
  slurmctld
  wait_for 60 slurmctld scontrol ping
}

start_slurmd() {
  local host; host=$(hostname -s)
  if ! alive slurmd "$RUN/slurmd.pid"; then
    log "starting slurmd"
    slurmd
  fi
  wait_for 60 "node $host (idle)" sh -c "sinfo -h -n '$host' -o '%T' | grep -Eq '^(idle|mixed|allocated)'"
  # A node left DOWN/DRAINED by an earlier unclean stop is ours to resume.
  if sinfo -h -n "$host" -o '%T' | grep -Eq 'down|drain'; then
    scontrol update nodename="$host" state=resume
  fi
}

up() {
  if [ -f "$CONF" ] && head -n1 "$CONF" | grep -qxF "$HEADER" && healthy; then
    log "already up ($(sinfo -h -o '%n %T' | head -n1))"
    return 0
  fi
  install_packages
  write_configs
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurmctld
  start_slurmd
  wait_for 60 "sacct" sacct -n -X -S now-1minutes
  log "up: cluster $CLUSTER, node $(sinfo -h -o '%n %c CPUs %T' | head -n1), accounting via slurmdbd"
}

stop_one() {  # stop_one NAME PIDFILE
  local pid
  if alive "$1" "$2"; then
    pid=$(cat "$2")
    log "stopping $1 (pid $pid)"
    kill "$pid"
    for _ in $(seq 120); do [ -d "/proc/$pid" ] || break; sleep 0.25; done
    [ -d "/proc/$pid" ] && { log "$1 did not stop in 30s; sending SIGKILL"; kill -9 "$pid"; }
  fi
  rm -f "$2"
}

down() {
  stop_one slurmd "$RUN/slurmd.pid"
  stop_one slurmctld "$RUN/slurmctld.pid"
  stop_one slurmdbd "$RUN/slurmdbd.pid"
  stop_one mariadbd "$RUN/mysql/mysqld.pid"
  stop_one munged "$RUN/munge/munged.pid"
  log "down"
}

status() {
  local name file
  for pair in munged:"$RUN/munge/munged.pid" mariadbd:"$RUN/mysql/mysqld.pid" slurmdbd:"$RUN/slurmdbd.pid" \
              slurmctld:"$RUN/slurmctld.pid" slurmd:"$RUN/slurmd.pid"; do
    name=${pair%%:*}; file=${pair#*:}
    if alive "$name" "$file"; then echo "$name: running (pid $(cat "$file"))"; else echo "$name: not running (no live pid in $file)"; fi
  done
  if healthy; then sinfo; echo "accounting: sacct answers"; return 0; fi
  echo "cluster: not ready"; return 1
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
