#!/usr/bin/env bash
# Stops the cluster that slurm_up.sh started: slurmd, slurmctld and munged, each by the PID in
# its pid file under SLURM_TEST_DIR (default /tmp/pipeline-slurm); nothing else is signalled.
# Also removes the /etc/slurm/slurm.conf link to the test config.
set -uo pipefail
DIR=${SLURM_TEST_DIR:-/tmp/pipeline-slurm}
rc=0
# All three are asked to stop at once (each took up to ~2 s to go, one after another ~6 s).
names=() pids=()
for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill -0 "$pid" 2>/dev/null || continue
  kill -TERM "$pid" && names+=("$(basename "$pidfile" .pid)") && pids+=("$pid")
done
for i in "${!pids[@]}"; do
  pid=${pids[i]}
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "slurm_down: ${names[i]} (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null
    rc=1
  fi
  echo "slurm_down: stopped ${names[i]} (pid $pid)" >&2
done
# The default-path link slurm_up.sh made, if it points into DIR.
link=/etc/slurm/slurm.conf
if [ -L "$link" ] && [ "$(readlink "$link")" = "$DIR/etc/slurm.conf" ]; then rm -f "$link"; fi
exit $rc
