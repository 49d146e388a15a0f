"""The DeepSpeed side of training: the only package that imports deepspeed, one part per concern.

    runtime.py     `import_deepspeed()` (the one way the parts import it, on first use), the
                   process group DeepSpeed shares with the job, the accelerator it picked
    config.py      a run's DeepSpeed config (`build_ds_config`) and what it means (`zero_stage`,
                   `zero_settings`)
    target.py      the frozen target inside the job: its dtype check, loading (partition by
                   partition under ZeRO-3), its optimizer-less ZeRO-3 engine
    drafter.py     `DrafterEngine`: the drafter built (inside zero.Init under ZeRO-3) and
                   wrapped by `deepspeed.initialize`
    optimizer.py   `train.optimizer: muon`: DeepSpeed's Muon over the drafter's matrices, AdamW
                   for the rest, in groups that match torch's Muon step
    checkpoint.py  save / load of an engine's tag, the universal checkpoint (another world size),
                   fp32 weights of a tag or of the live drafter (export)
    probes.py      the ZeRO tuner's: DeepSpeed's memory estimators, engines and CPU Adam around
                   stand-ins, NVMe offload's I/O

Each user imports the part it needs; importing a part does not import deepspeed.
"""
