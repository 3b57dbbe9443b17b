#!/usr/bin/env bash
# The CPU summarisation study in one command, from the repository root (after `make install`):
#
#   bash workflow/studies/cnndm/run.sh [--fresh]
#
# The same runner as the CPU study (workflow/studies/cpu/run.sh: timed sittings, the same command
# continues a stopped run, products copied and the check run recorded), for this study's params
# file; its products go to reports/reference/cnndm/. The run CI re-checks is a shortened copy of the
# baseline (check.yaml), made once after the study.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export STUDY_PARAMS=${STUDY_PARAMS:-workflow/studies/cnndm/params.yaml}
export REFERENCE_OUT=${REFERENCE_OUT:-reports/reference/cnndm}
export CHECK_RUN=${CHECK_RUN:-"cnndm baseline 0"}
export CHECK_PARAMS=${CHECK_PARAMS:-workflow/studies/cnndm/check.yaml}  # a shortened baseline run that fits CI
exec bash workflow/studies/cpu/run.sh "$@"
