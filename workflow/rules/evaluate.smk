rule evaluate:
    input:
        stage_inputs("evaluate"),
    output:
        **stage_outputs("evaluate"),
    params:
        cmd=stage_command("evaluate"),
        params_hash=stage_params_hash("evaluate"),
    resources:
        gpu=1,
    log:
        stage_log("evaluate", "{task}-{cell}-s{seed}"),
    benchmark:
        stage_benchmark("evaluate", "{task}-{cell}-s{seed}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
