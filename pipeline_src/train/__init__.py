"""Training: stage `train`, and what a training step is made of.

    trainer.py      stage `train`: one task x cell x seed (the Trainer and its loop)
    batching.py     encoded splits -> padded token-budget batches (evaluation reads them too)
    compiling.py    torch.compile for the training step; the token loss
    optim.py        AdamW (fused on CUDA)
    precision.py    bf16 autocast or fp32
    step_meter.py   step bookkeeping that never waits on the device
    live_log.py     curves while a run trains (log.tsv, TensorBoard)
    state.py        a running run's state on disk, so that a restart continues exactly
    preemption.py   stopping a job on purpose (signals, time budget) and continuing it later
    outputs.py      the files a finished run leaves (metrics, info, cost)
"""
