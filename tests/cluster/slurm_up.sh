#!/usr/bin/env bash
# A real single-node SLURM cluster for tests and CI: installs the Debian packages if missing,
# then starts munged, slurmctld and slurmd by hand (no systemd) with every config, state, socket
# and log file under one directory, so it neither needs nor touches a system-wide SLURM.
#
#   eval "$(tests/cluster/slurm_up.sh)"   # starts it, prints `export SLURM_CONF=...`
#   tests/cluster/slurm_down.sh           # stops the daemons by their PIDs
#
# The node has the machine's CPUs, partitions `cpu` (default) and `gpu`, and declares two GPUs
# as a generic resource backed by stand-in device files: SLURM then schedules `--gpus=1` jobs as on
# a GPU node, which exercises the profile's GPU path on a CPU-only machine (CUDA stays absent, so
# the jobs train on the CPU).
#
# Settings (environment): SLURM_TEST_DIR (default /tmp/pipeline-slurm), SLURM_TEST_PORT
# (slurmctld's port, slurmd takes the next one; default 6817).
set -euo pipefail
DIR=${SLURM_TEST_DIR:-/tmp/pipeline-slurm}
PORT=${SLURM_TEST_PORT:-6817}
HOST=$(hostname -s)
log() { echo "slurm_up: $*" >&2; }
die() { echo "slurm_up: error: $*" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge (apt)"
  SUDO=$( [ "$(id -u)" = 0 ] || echo sudo )
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
[ "$(id -u)" = 0 ] || die "run as root: slurmd must start jobs as the submitting user"

# Idempotent: a cluster left running in DIR is stopped first, then DIR starts clean.
"$(dirname "$0")/slurm_down.sh" >/dev/null 2>&1 || true
rm -rf "$DIR"
mkdir -p "$DIR"/{etc,state,spool,log,munge}
chmod 755 "$DIR"

# munge: a key of our own and a socket in DIR; munged runs as the munge user and refuses
# directories that others can write to.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chown -R munge:munge "$DIR/munge"
chmod 755 "$DIR/munge"  # the socket must be reachable by all; the key stays 0400
chmod 400 "$DIR/munge/munge.key"
runuser -u munge -- munged --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
  --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
  --seed-file="$DIR/munge/munged.seed" || die "munged did not start (see $DIR/munge/munged.log)"

cpus=$(nproc)
cat >"$DIR/etc/slurm.conf" <<EOF
ClusterName=pipeline
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long SLURM holds a requeued job back (120 s by default)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
ReturnToService=2
# Take the node as declared: the profile's memory requests (GBs per job) need not fit this
# machine for the test, and jobs are not memory-limited here.
SlurmdParameters=config_overrides
# Finished jobs stay visible to squeue for 10 minutes. Without slurmdbd, squeue is the only
# status source (sacct fails), and the Snakemake plugin polls it at intervals of up to 180 s;
# it also switches back to sacct unless MinJobAge >= 3 x its initial status-check delay.
MinJobAge=600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=64000 Gres=gpu:2 State=UNKNOWN
PartitionName=cpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$HOST MaxTime=INFINITE State=UP
EOF
# Two GPUs (two cells train at once). slurmd drops a GPU without a device file ("Removing file-less GPU"), so the GRES names
# character devices of our own that are /dev/null (1:3): SLURM schedules and counts them, and
# sets CUDA_VISIBLE_DEVICES in the jobs that get one; nothing ever opens them.
mkdir -p "$DIR/dev"
mknod "$DIR/dev/nvidia0" c 1 3
mknod "$DIR/dev/nvidia1" c 1 3
echo "NodeName=$HOST Name=gpu File=$DIR/dev/nvidia[0-1]" >"$DIR/etc/gres.conf"
export SLURM_CONF="$DIR/etc/slurm.conf"
# Inside a job, Snakemake's jobstep plugin removes every SLURM_* variable (SLURM_CONF too) before
# it calls srun, which then reads the default /etc/slurm/slurm.conf (a site has its config
# there, or configless). So that path is linked to ours; a real config found there is left alone.
SYS_CONF=/etc/slurm/slurm.conf
if [ -e "$SYS_CONF" ] && [ ! -L "$SYS_CONF" ]; then
  die "$SYS_CONF exists and is not ours; this test cluster would replace a real SLURM config"
fi
mkdir -p /etc/slurm
ln -sfn "$SLURM_CONF" "$SYS_CONF"

slurmctld -f "$SLURM_CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
slurmd -f "$SLURM_CONF" || die "slurmd did not start (see $DIR/log/slurmd.log)"

# Ready when the controller answers and the node is idle (bounded: no hang if it never is).
for _ in $(seq 60); do
  state=$(timeout 5 sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
  [ "$state" = idle ] && break
  sleep 1
done
[ "$state" = idle ] || die "node not idle after 60 s (state '${state:-none}'; logs in $DIR/log)"
log "up: node $HOST, $cpus CPUs, gres gpu:2, partitions cpu and gpu (state in $DIR)"
echo "export SLURM_CONF=$SLURM_CONF"
