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
    shell:
        "{params.cmd} 2> {log}"
