"""Objectives beyond the pair loss, one module each: distillation from a frozen teacher (`distillation`), the LocCa
decoder of SigLIP 2's recipe (`locca_decoder`), self-distillation and masked prediction with an EMA teacher
(`self_distillation`) and the recipe that combines them (`siglip2_recipe`)."""
