"""Objectives beyond the pair loss, one module each, each an `objective.Objective` registered in `registry`: several
captions per image (`multi_positive`), distillation from a frozen teacher (`distillation`), SigLIP 2's recipe
(`siglip2_recipe`: the LocCa decoder, `locca_decoder`, and self-distillation with masked prediction against an EMA
teacher, `self_distillation`, `self_distill_schedule`). Adding one: docs/code_map.md, "Adding an objective"."""
