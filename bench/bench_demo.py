"""End-to-end demo study: wall time per stage (sum and max over each rule's jobs) and in total.

Reads Snakemake benchmark files (`benchmark:` directives, tab-separated, first column `s`) from
logs/<study>/bench/<rule>/<job>.tsv (a flat logs/<study>/bench/<job>.tsv is also accepted: the
rule is then the file name's first word, matched against the rule names). Unless --parse-only,
it first runs the whole study from scratch in a throw-away copy of the repository:

    snakemake --cores 2 --config params=workflow/studies/demo/params.yaml --forceall --keep-going

timing it; rules of the copy that lack a `benchmark:` directive get one injected (the copy only;
the repository's rules are left alone), so per-job times always come from Snakemake itself.
Target (README): the demo finishes in under 5 minutes on 2 CPU cores.
--quick times the tests' tiny study (tests/fixtures/params/valid_tiny.yaml) the same way (a smoke
run, whose jobs fork from the start-up server when it runs under one, as the tests do);
--parse-only reads the existing benchmark files of this repository, or says there are none.

    python bench/bench_demo.py [--quick | --parse-only] [--study demo] [--cores 2]
"""
from __future__ import annotations

import argparse
import csv
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

from common import BIN, OUT_DIR, REPO, copy_repo, md_table, timed_run, write_report

TARGET_S = 300.0
RULES = ("download", "filter", "bpe", "train", "evaluate", "promote", "aggregate", "figures", "tables", "claims",
         "report")


def inject_benchmarks(rules_dir: Path) -> int:
    """Add `benchmark: logs/<study>/bench/<rule>/<log pattern>.tsv` to each rule that has none."""
    n = 0
    for smk in rules_dir.glob("*.smk"):
        text = smk.read_text()
        blocks = re.split(r"(?m)^(?=rule )", text)
        for i, block in enumerate(blocks):
            m = re.search(r'(?m)^    log:\n        stage_log\("(\w+)", "([^"]+)"\),\n', block)
            if not block.startswith("rule ") or "benchmark:" in block or not m:
                continue
            stage, pattern = m.groups()
            escaped = pattern.replace("{", "{{").replace("}", "}}")   # wildcards survive the f-string
            directive = f'    benchmark:\n        f"logs/{{STUDY.name}}/bench/{stage}/{escaped}.tsv",\n'
            blocks[i] = block[:m.end()] + directive + block[m.end():]
            n += 1
        smk.write_text("".join(blocks))
    return n


def read_benchmarks(bench_dir: Path) -> dict[str, list[dict]]:
    """rule -> [{job, s, max_rss_mb, cpu_time}] from Snakemake benchmark TSVs."""
    per_rule: dict[str, list[dict]] = defaultdict(list)
    for f in sorted(bench_dir.rglob("*.tsv")) + sorted(bench_dir.rglob("*.txt")):
        rel = f.relative_to(bench_dir)
        rule = rel.parts[0] if len(rel.parts) > 1 else next(
            (r for r in RULES if re.match(rf"{r}\b", f.stem)), f.stem.split("-")[0])
        with f.open() as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if not rows or "s" not in rows[0]:
            continue
        s = sum(float(r["s"]) for r in rows) / len(rows)   # repeated benchmarks: mean
        rss = [float(r["max_rss"]) for r in rows if r.get("max_rss", "-") not in ("-", "NA", "")]
        cpu = [float(r["cpu_time"]) for r in rows if r.get("cpu_time", "-") not in ("-", "NA", "")]
        per_rule[rule].append({"job": rel.with_suffix("").as_posix(), "s": s,
                               "max_rss_mb": max(rss) if rss else None, "cpu_s": sum(cpu) / len(cpu) if cpu else None})
    return dict(per_rule)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="time the tests' tiny study instead (smoke test)")
    ap.add_argument("--parse-only", action="store_true", help="only parse benchmark files of this repository")
    ap.add_argument("--study", default="demo", help="the study whose params/benchmark files to use")
    ap.add_argument("--params", help="params file (default workflow/studies/<study>/params.yaml; one outside "
                    "the repository is copied into the temporary copy); sets the study name")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--keep", action="store_true", help="keep the temporary repository copy")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    if args.quick:
        args.params = str(REPO / "tests" / "fixtures" / "params" / "valid_tiny.yaml")
    params = args.params or f"workflow/studies/{args.study}/params.yaml"
    if args.params:
        args.study = yaml.safe_load(Path(params).read_text())["study"]
    run_info: dict = {}
    if args.parse_only:
        bench_dir = REPO / "logs" / args.study / "bench"
        if not any(bench_dir.rglob("*.tsv")):
            print(f"bench_demo: no Snakemake benchmark files under {bench_dir.relative_to(REPO)}; nothing to "
                  f"report (add `benchmark:` directives and run the demo, or run without --quick to time "
                  f"a fresh run in a temporary copy).")
            return
        source = f"existing benchmark files in {bench_dir.relative_to(REPO)}"
        per_rule = read_benchmarks(bench_dir)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_demo."))
        try:
            copy_repo(work)
            if Path(params).is_absolute():
                shutil.copy(params, work / "params.bench.yaml")
                params = "params.bench.yaml"
            injected = inject_benchmarks(work / "workflow" / "rules")
            cmd = [str(BIN / "snakemake"), "--cores", str(args.cores), "--config", f"params={params}",
                   "--forceall", "--keep-going"]
            wall, cpu, out = timed_run(cmd, work, timeout=args.timeout, check=False, keep_server=args.quick)
            ok = "steps (100%) done" in out and "Error" not in out
            failed = sorted(set(re.findall(r"Error in rule (\w+)", out)))
            per_rule = read_benchmarks(work / "logs" / args.study / "bench")
            run_info = {"wall_s": wall, "cpu_s": cpu, "succeeded": ok, "failed_rules": failed,
                        "benchmark_directives_injected": injected, "command": " ".join(["snakemake", *cmd[1:]])}
            if not ok:
                print(out[-4000:])
        finally:
            if args.keep:
                print(f"kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        source = f"fresh run in a temporary copy: `{run_info['command']}`"

    order = [r for r in RULES if r in per_rule] + sorted(set(per_rule) - set(RULES))
    rows, summary = [], {}
    for rule in order:
        jobs = per_rule[rule]
        times = [j["s"] for j in jobs]
        rss = [j["max_rss_mb"] for j in jobs if j["max_rss_mb"] is not None]
        summary[rule] = {"jobs": len(jobs), "sum_s": sum(times), "max_s": max(times), "mean_s": sum(times) / len(jobs),
                         "max_rss_mb": max(rss) if rss else None}
        rows.append([rule, len(jobs), f"{sum(times):.1f}", f"{max(times):.1f}", f"{sum(times) / len(jobs):.1f}",
                     f"{max(rss):.0f}" if rss else None])
    total_jobs = sum(s["sum_s"] for s in summary.values())
    rows.append(["**all jobs**", sum(s["jobs"] for s in summary.values()), f"{total_jobs:.1f}", "", "", ""])
    lines = [f"Source: {source}.", ""]
    if run_info:
        met = run_info["wall_s"] <= TARGET_S and run_info["succeeded"]
        failed = "" if run_info["succeeded"] else f"; RUN FAILED (rules: {', '.join(run_info['failed_rules']) or '?'})"
        lines += [f"**Total wall time {run_info['wall_s']:.1f} s** on {args.cores} cores (CPU {run_info['cpu_s']:.0f} s);"
                  f" target ≤ {TARGET_S:.0f} s: {'met' if met else 'NOT met'}{failed}.", ""]
    lines += [md_table(["rule", "jobs", "sum s", "max s", "mean s", "max RSS MB"], rows)]
    write_report("demo", f"End-to-end {args.study} study: wall time per stage",
                 {"study": args.study, "params": params, "source": source, "run": run_info, "target_s": TARGET_S,
                  "per_rule": summary, "jobs": per_rule}, "\n".join(lines), quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
