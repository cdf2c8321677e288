"""Objectives beyond the pair loss, one module each, each owning the modules it trains or reads and its term of the
window objective (`naflexclip.window.Term`): distillation from a frozen teacher (`distillation`), the LocCa decoder of
SigLIP 2's recipe (`locca_decoder`), self-distillation and masked prediction with an EMA teacher
(`self_distillation`) and the recipe that decides which of them a run trains, with which weights
(`siglip2_recipe.Recipe.terms`)."""
