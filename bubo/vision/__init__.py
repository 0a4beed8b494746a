"""Image input for the Qwen3.5 family: the vision tower, its loader, and the multimodal rope positions."""
