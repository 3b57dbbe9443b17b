"""What runs the stages: the drivers' helpers and the facts of the machine they run on.

    dvc_yaml.py          write a study's dvc.yaml from the stage table
    preload.py           the start-up server: stage processes forked with libraries imported
    run_lock.py          resume a study after a crash while refusing a second live run
    gpu_slots.py         one GPU (or a slot on one) per concurrent job
    slurm_guard.py       SLURM runs fail with one clear line, never hang
    scheduler_timers.py  one pending re-scheduling timer in Snakemake's scheduler
    allocator.py         keep freed memory in the process (glibc malloc settings)
    machine.py           what decides a run's floats on this machine (CPU, libraries)
"""
