"""The jobs: pretraining, generation, GLUE fine-tuning, lm-eval-harness evaluation and scaling laws. Each hands the
one training loop (`lm.train`) or the assembled model its data, loss and callbacks; `lm.commands` gives each its
command line."""
