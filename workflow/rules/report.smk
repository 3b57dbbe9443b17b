rule aggregate:
    input:
        stage_inputs("aggregate"),
    output:
        **stage_outputs("aggregate"),
    params:
        cmd=stage_command("aggregate"),
        params_hash=stage_params_hash("aggregate"),
    log:
        stage_log("aggregate", "aggregate"),
    benchmark:
        stage_benchmark("aggregate", "aggregate")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule figures:
    input:
        stage_inputs("figures"),
    output:
        **stage_outputs("figures"),
    params:
        cmd=stage_command("figures"),
        params_hash=stage_params_hash("figures"),
    log:
        stage_log("figures", "figures"),
    benchmark:
        stage_benchmark("figures", "figures")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule tables:
    input:
        stage_inputs("tables"),
    output:
        **stage_outputs("tables"),
    params:
        cmd=stage_command("tables"),
        params_hash=stage_params_hash("tables"),
    log:
        stage_log("tables", "tables"),
    benchmark:
        stage_benchmark("tables", "tables")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule report:
    input:
        stage_inputs("report"),
    output:
        **stage_outputs("report"),
    params:
        cmd=stage_command("report"),
        params_hash=stage_params_hash("report"),
    log:
        stage_log("report", "report"),
    benchmark:
        stage_benchmark("report", "report")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
