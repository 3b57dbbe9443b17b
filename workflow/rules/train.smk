# One job per task x cell x seed. `gpu=1`: with `--resources gpu=N`, at most N run at once, and
# each claims a free GPU of its own (pipeline_src/runtime/gpu_slots.py) rather than all piling onto GPU 0;
# PIPELINE_JOBS_PER_GPU=K gives each GPU K slots (then --resources gpu=GPUs*K).
rule train:
    input:
        stage_inputs("train"),
    output:
        **stage_outputs("train"),
    params:
        cmd=stage_command("train"),
        params_hash=stage_params_hash("train"),
    resources:
        gpu=1,
    log:
        stage_log("train", "{task}-{cell}-s{seed}"),
    benchmark:
        stage_benchmark("train", "{task}-{cell}-s{seed}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


# A cell's peak lr chosen on validation by short trial runs before its runs (cells with train.lr_grid).
rule tune:
    input:
        stage_inputs("tune"),
    output:
        **stage_outputs("tune"),
    params:
        cmd=stage_command("tune"),
        params_hash=stage_params_hash("tune"),
    resources:
        gpu=1,
    log:
        stage_log("tune", "{task}-{cell}"),
    benchmark:
        stage_benchmark("tune", "{task}-{cell}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


# Adaptive seeds: after the first round, which cells run the seeds beyond it (pipeline_src/study/seed_plan.py).
rule plan:
    input:
        stage_inputs("plan"),
    output:
        **stage_outputs("plan"),
    params:
        cmd=stage_command("plan"),
        params_hash=stage_params_hash("plan"),
    log:
        stage_log("plan", "plan"),
    benchmark:
        stage_benchmark("plan", "plan")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
