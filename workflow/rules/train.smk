# One job per task x cell x seed. `gpu=1`: with `--resources gpu=N`, at most N run at once, and
# each claims a free GPU of its own (pipeline_src/gpu_slots.py) rather than all piling onto GPU 0;
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
