"""The model side: our CLIP model (`naflex_clip`), its locked towers (`lock`), `create_model`/`export_model`
(`factory`), a run folder's weights as a model (`run_weights`) and `naflexclip export` (`export_command`)."""
