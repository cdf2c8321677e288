"""The training run's settings: `TrainConfig` and its cross-setting checks, the `train` flags generated from it and
OpenCLIP's flags, how a setting is shown, and the ranks' agreement on them. The declarations themselves are
`naflexclip.settings`'s `setting()`; the resume policy that reads them is `train.resume`."""
