# One job per stage kind: the hashes of the code files the kind's jobs run (pipeline_src/study/code_manifest.py).
# Every job of the kind depends on this file instead of on each code file. It hashes a few files,
# so it runs where Snakemake runs, not as a cluster job.
rule code:
    input:
        stage_inputs("code"),
    output:
        **stage_outputs("code"),
    params:
        cmd=stage_command("code"),
        params_hash=stage_params_hash("code"),
    localrule: True
    log:
        stage_log("code", "{kind}"),
    benchmark:
        stage_benchmark("code", "{kind}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
