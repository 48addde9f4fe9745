"""Chat fine-tuning: supervised (`sft`) and preference (`dpo`) tuning on chat data."""
