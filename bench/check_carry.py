"""Check the carried wheels' requirements against what a lent GPU machine really has.

bench/gpu_carry.sh carries the .venv's versions of the packages that machine lacks, but not numpy,
pandas or pyarrow: those are the image's own (pyarrow alone would not fit the 64 MiB a call sends).
A carried package whose requirement the image does not meet imports fine and fails later, inside a
stage (datasets 5 needs pyarrow >= 24), so bench/device.sh runs this first and the call's log says
which package wants which version:

    python bench/check_carry.py /tmp/site     # the folder the carried wheels were installed into

It only warns (exit 0): a mismatch may be harmless, and a lent GPU is too rare to give up on one.
"""
import sys
from importlib.metadata import PackageNotFoundError, distributions, version

from packaging.requirements import Requirement


def unmet_requirements(site_dir: str) -> list[str]:
    """One line per requirement of a package installed under site_dir that the interpreter's
    importable packages (site_dir first, then the image's) do not satisfy."""
    problems = []
    for dist in sorted(distributions(path=[site_dir]), key=lambda d: d.metadata["Name"].lower()):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's or another platform's
            who = f"{dist.metadata['Name']} {dist.version} needs {req}"
            try:
                have = version(req.name)
            except PackageNotFoundError:
                problems.append(f"{who}: not installed on this machine")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{who}: this machine has {req.name} {have}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/check_carry.py SITE_DIR", file=sys.stderr)
        return 2
    problems = unmet_requirements(argv[0])
    for line in problems:
        print(f"!! carried wheels: {line}")
    if not problems:
        print("carried wheels: every requirement met on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
