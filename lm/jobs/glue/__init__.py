"""GLUE fine-tuning: tasks, data, metrics, the fine-tuning loop and leaderboard files."""
