"""The training job: config, optimizer and schedule, the window-per-step loop, evaluation, checkpoints, reports.

`naflexclip train` / `naflexclip eval` are in `naflexclip.train.train_command`; a run's checkpoint is loaded as a
model for other commands by `naflexclip.models.run_weights.load_checkpoint_model`.
"""
