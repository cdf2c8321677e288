"""What a model reads, shared by the data pipeline and the model side: NaFlex patching and tokenising
(`naflex_transform`), the LocCa decoder's tokens (`decoder_tokens`) and each example's view seed (`view_seeds`)."""
