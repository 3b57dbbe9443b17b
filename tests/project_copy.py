"""A copy of the project as shipped (tracked and untracked-but-not-ignored files; what a study run
wrote over its views is left out), for tests that run Snakemake, DVC or git on a repository of their own
without touching the checkout; and the environment for tests that run this checkout's stages in a
subprocess."""
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# What a run of a study writes into files git keeps or would pick up: the studies' DVC views
# (reports/<study>/metrics, reports/<study>/plots) and DVC's lock files. The copy has them as
# committed, so that a test sees the studies as shipped even after `make demo` ran in this checkout.
RUN_OUTPUTS = re.compile(r"reports/[^/]+/(metrics|plots)/.*|(.*/)?dvc\.lock")


def copy_project(dest: Path) -> Path:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    for f in git("ls-files", "-co", "--exclude-standard").split():
        if not RUN_OUTPUTS.fullmatch(f) and (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    # run outputs git keeps: copied as staged, not as a run left them; untracked ones not at all
    committed = [f for f in git("ls-files").split() if RUN_OUTPUTS.fullmatch(f)]
    if committed:
        git("checkout-index", f"--prefix={dest}/", "--", *committed)
    return dest


def without_shipped_pipelines(repo: Path, keep: tuple[str, ...] = ()) -> Path:
    """Remove the shipped studies' dvc.yaml files (but those in `keep`) from a copy whose tests
    drive DVC on a study of their own: `dvc repro`, `dvc exp` and `dvc plots` parse every
    dvc.yaml in the repository (about 6,000 lines for the shipped studies), which is much of a
    small command's time and none of what is tested."""
    for path in [repo / "dvc.yaml", *repo.glob("workflow/studies/*/dvc.yaml")]:
        if path.relative_to(repo).as_posix() not in keep:
            path.unlink()
    return repo


def checkout_env(**extra) -> dict:
    """os.environ with this checkout first on PYTHONPATH. The caller's entries stay after it: on a GPU
    node run from a bundle they hold the bundle's packages (workflow/node/node.sh)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, PIPELINE_QUIET="1", **extra)
