# report(): what `snakemake --report report.html` carries (categories: per task, per ablation family,
# the study); captions in workflow/report/.
rule aggregate:
    input:
        stage_inputs("aggregate"),
    output:
        **stage_outputs("aggregate", shown={
            **{name: dict(caption="../report/csv.rst", category=views.STUDY_CATEGORY, subcategory="Results (CSV)",
                          labels={"file": f"{name}.csv"})
               for name in ("results", "summary", "significance")},
            "headline": dict(patterns=["{task}/{cell}.json"], caption="../report/headline.rst",
                             category="{task}",
                             subcategory=lambda wc: views.report_group(STUDY, "headline", f"{wc.task}/{wc.cell}")[1],
                             labels={"cell": "{cell}"}),
        }),
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
        **stage_outputs("figures", shown={
            "figures": dict(patterns=["{figure}.png"], caption="../report/figure.rst",
                            category=report_group("figures", "figure", 0),
                            subcategory=report_group("figures", "figure", 1), labels={"figure": "{figure}"}),
        }),
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
        **stage_outputs("tables", shown={
            "tables": dict(patterns=["{table}.tex"], caption="../report/table.rst",
                           category=report_group("tables", "table", 0),
                           subcategory=report_group("tables", "table", 1), labels={"table": "{table}"}),
        }),
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


rule claims:
    input:
        stage_inputs("claims"),
    output:
        **stage_outputs("claims"),
    params:
        cmd=stage_command("claims"),
        params_hash=stage_params_hash("claims"),
    log:
        stage_log("claims", "claims"),
    benchmark:
        stage_benchmark("claims", "claims")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"


rule report:
    input:
        stage_inputs("report"),
    output:
        **stage_outputs("report", shown={
            "pdf": dict(caption="../report/pdf.rst", category=views.STUDY_CATEGORY, subcategory="Report (PDF)",
                        labels={"file": "report.pdf"}),
        }),
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


# Two-stage screening: ranks stage one's families, records which stage two trains (pipeline_src/study/screening.py).
rule promote:
    input:
        stage_inputs("promote"),
    output:
        **stage_outputs("promote"),
    params:
        cmd=stage_command("promote"),
        params_hash=stage_params_hash("promote"),
    log:
        stage_log("promote", "{screen}"),
    benchmark:
        stage_benchmark("promote", "{screen}")
    conda:
        "../envs/pipeline.yaml"
    shell:
        "{params.cmd} 2> {log}"
