"""The training job: config, optimizer and schedule, the window-per-step loop, evaluation, checkpoints, reports.

`naflexclip train` / `naflexclip eval` are in `naflexclip.train.train_command`; `load_checkpoint_model` in
`naflexclip.train.components` loads a trained model for other commands.
"""
