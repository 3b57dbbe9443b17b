"""Run a command on this machine's cores slowed to a fraction of their speed.

    python3 .ci/slow_cores.py --speed 0.4 -- bash .ci/run

To see how long CI or the demo would take on a slower runner with the same number of cores,
without one at hand. One real-time process per core (SCHED_FIFO, pinned) takes that core for
(1 - speed) of every 10 ms and sleeps for the rest; a real-time process runs before every
ordinary one, so the command's processes get `speed` of each core, however many of them share
it. Time spent waiting (sleeps, the network, a scheduler's queue) is not stretched, as on a
slower machine. What it cannot imitate: another instruction set (kernels chosen for this CPU
still run, faster per cycle than elsewhere), other cache and memory speeds, and the latency of
up to (1 - speed) x 10 ms that a woken process may wait for its core.

The busy column of `.ci/run`'s timing table counts these processes too. Needs root (real-time
priority) and is for rehearsals only: nothing in CI or the pipeline uses it.

A VM's own speed drifts from hour to hour, and "a fraction S of this machine" with it. With
`--probe REF` the fraction is set against a fixed speed instead: `.ci/speed_probe.py` is timed
first, at full speed, and the command gets S x (probe now / REF), where REF is the probe's time
when S was calibrated (.ci/README.md). A machine faster now than then is slowed more.

    python3 .ci/slow_cores.py --speed 0.570 --probe 6.73 --python .venv/bin/python -- bash .ci/run
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PERIOD_S = 0.010


def occupy_core(cpu: int, busy_s: float, idle_s: float) -> None:
    """Spin for busy_s, sleep for idle_s, forever, on one core at real-time priority."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    clock = time.monotonic
    while True:
        until = clock() + busy_s
        while clock() < until:
            pass
        time.sleep(idle_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, required=True,
                        help="fraction of each core left to the command, e.g. 0.4")
    parser.add_argument("--probe", type=float, metavar="REF_S",
                        help="scale --speed by (speed_probe.py's seconds now / REF_S): REF_S is the probe's "
                             "time when --speed was calibrated")
    parser.add_argument("--python", default="python3",
                        help="an interpreter with torch, for the probe (default: python3)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if args.probe is not None:
        probe = str(Path(__file__).resolve().parent / "speed_probe.py")
        times = [float(subprocess.run([args.python, probe], check=True, capture_output=True, text=True).stdout)
                 for _ in range(3)]
        now = sorted(times)[1]  # the median of three
        speed = args.speed * now / args.probe
        print(f"slow_cores: probe {now:.2f} s now (runs: {', '.join(f'{t:.2f}' for t in times)}) against "
              f"{args.probe:.2f} s when --speed {args.speed} was calibrated: speed {speed:.3f}", flush=True)
        args.speed = speed
    if not 0.05 <= args.speed <= 0.95:
        parser.error(f"--speed {args.speed}: must be between 0.05 and 0.95")
    busy_s = (1.0 - args.speed) * PERIOD_S
    occupiers = []
    for cpu in sorted(os.sched_getaffinity(0)):
        pid = os.fork()
        if pid == 0:
            try:
                occupy_core(cpu, busy_s, args.speed * PERIOD_S)
            finally:
                os._exit(1)
        occupiers.append(pid)
    time.sleep(0.1)
    for pid in occupiers:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            print("slow_cores: could not take a core at real-time priority (root needed)",
                  file=sys.stderr)
            for other in occupiers:
                os.kill(other, signal.SIGKILL)
            return 1
    child = subprocess.Popen(command)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: child.send_signal(s))
    try:
        return child.wait()
    finally:
        for pid in occupiers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    sys.exit(main())
