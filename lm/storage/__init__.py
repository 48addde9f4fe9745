"""What a run keeps and reads: the run-directory layout (`run_dir`), orbax checkpoints (`checkpoint`), Hugging Face
import and export (`convert`), and the one way to open a model from any of them."""
