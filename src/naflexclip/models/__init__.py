"""The model side: our CLIP model (`naflex_clip`), its locked towers (`lock`), a run folder's weights as a model
(`run_weights`), autocast (`precision`). It imports no pretrained family: `naflexclip.families`, which builds these
models, holds `create_model`/`export_model` (`factory`) and `naflexclip export` (`export_command`)."""
