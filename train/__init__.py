"""raywright training: a GPT trained by Ray Train workers running DeepSpeed ZeRO."""
