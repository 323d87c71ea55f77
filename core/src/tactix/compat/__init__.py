"""Drop-in names for users of other libraries (FlashInfer)."""
