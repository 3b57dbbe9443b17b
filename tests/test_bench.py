"""Smoke runs of the benchmarks (--quick): they call the pipeline's own functions, so an API
change that breaks them should fail here, not on the next run on a GPU. Figures are not checked."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from project_copy import checkout_env

ROOT = Path(__file__).resolve().parent.parent
MIRROR = Path(os.environ.get("PIPELINE_DATA_MIRROR", ROOT.parent / "shared" / "datasets"))


@pytest.mark.parametrize("bench,record", [("bench_train_step.py", "train_step.json"), ("bench_decode.py", "decode.json"),
                                          ("bench_compile.py", "compile_warmup.json"),
                                          pytest.param("bench_real_cell.py", "real_cell.json", marks=pytest.mark.skipif(
                                              not (MIRROR / "multi30k").is_dir(), reason="needs the mirror's Multi30k")),
                                          pytest.param("bench_data.py", "data.json", marks=pytest.mark.skipif(
                                              not (MIRROR / "multi30k").is_dir(), reason="needs the mirror's Multi30k")),
                                          pytest.param("bench_pipeline.py", "pipeline.json"),
                                          pytest.param("bench_demo.py", "demo.json"),
                                          pytest.param("bench_cpu_cell.py", "cpu_cell.json", marks=pytest.mark.skipif(
                                              not (MIRROR / "multi30k").is_dir(), reason="needs the mirror's Multi30k")),
                                          pytest.param("bench_decode_articles.py", "decode_articles.json",
                                                       marks=pytest.mark.skipif(not (MIRROR / "cnn_dailymail").is_dir(),
                                                                                reason="needs the mirror's CNN/DailyMail"))])
def test_benchmark_quick_run_writes_its_record(bench, record, tmp_path):
    env = checkout_env()
    # The smallest run that still goes through every code path of the benchmark:
    extra = {"bench_compile.py": ["--variants", "layers/auto", "--shapes", "2"],  # one compiled variant, two shapes
             "bench_pipeline.py": ["--cells", "2", "--seeds", "2"],  # a 2 x 2 grid instead of 12 x 4
             # 1 s of training per cell, not 15; 16 test sentences decoded, not 100
             "bench_real_cell.py": ["--budget-s", "1", "--test-sentences", "16"]}.get(bench, [])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--quick", "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / record).read_text())
    assert data["benchmark"] and data["versions"]
    if bench == "bench_decode.py":  # every beam-search implementation decodes the same hypotheses
        assert {r["impl"] for r in data["beam_implementations"]} >= {"host", "static"}
        assert all(r["identical_to_host"] == 1.0 for r in data["beam_implementations"])
    if bench == "bench_decode_articles.py":  # the evaluate stage's decoder, every implementation, full summaries
        assert [r["impl"] for r in data["results"]] == ["host", "static"] and data["articles"] == 24
        assert all(r["identical_to_host"] == 1.0 and r["summary_lengths"] == [8] for r in data["results"])
    if bench == "bench_compile.py":  # both runs of the variant compiled its regions and stepped every shape
        (result,) = data["results"]
        assert result["cold"]["graphs_compiled"] > 0 and len(result["warm_cache"]["shapes"]) == 2
    if bench == "bench_cpu_cell.py":  # both precisions stepped; the real cell trained under both allocators, same bytes
        assert all(r["fp32_ms"] > 0 and r["bf16_ms"] > 0 for r in data["isolated_steps"])
        assert {c["allocator"] for c in data["real_cell"]} == {"glibc-keep", "system"}
        assert data["same_metrics_either_allocator"] is True
    if bench == "bench_real_cell.py":  # the real train + evaluate stages ran on the mirror's Multi30k
        assert data["steps"] > 0 and data["decode_sentences"] > 0 and data["cost"]["tokens_per_s"] > 0
