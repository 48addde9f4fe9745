"""Converting models between lm and other frameworks (Hugging Face: `lm.convert.hf`)."""
