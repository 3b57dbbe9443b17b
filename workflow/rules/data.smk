rule download:
    input:
        stage_inputs("download"),
    output:
        **stage_outputs("download"),
    params:
        cmd=stage_command("download"),
        params_hash=stage_params_hash("download"),
    log:
        stage_log("download", "{dataset}"),
    benchmark:
        stage_benchmark("download", "{dataset}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule filter:
    input:
        stage_inputs("filter"),
    output:
        **stage_outputs("filter"),
    params:
        cmd=stage_command("filter"),
        params_hash=stage_params_hash("filter"),
    log:
        stage_log("filter", "{task}-{filter_variant}"),
    benchmark:
        stage_benchmark("filter", "{task}-{filter_variant}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule bpe:
    input:
        stage_inputs("bpe"),
    output:
        **stage_outputs("bpe"),
    params:
        cmd=stage_command("bpe"),
        params_hash=stage_params_hash("bpe"),
    log:
        stage_log("bpe", "{task}-{filter_variant}-{bpe_variant}"),
    benchmark:
        stage_benchmark("bpe", "{task}-{filter_variant}-{bpe_variant}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
