"""Downstream evaluation through lm-eval-harness: its tasks, prompts and metrics; lm's model and engine."""
