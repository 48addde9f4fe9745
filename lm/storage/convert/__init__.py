"""Converting models between lm and other frameworks (Hugging Face: `lm.storage.convert.hf`)."""
