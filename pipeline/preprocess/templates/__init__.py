"""Chat templates shipped as package data (Qwen2-VL, Qwen3)."""
