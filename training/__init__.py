"""Offline, deterministic training of the bundled tiny DeepSeek-V4 checkpoint (``python -m training.train_tiny``)."""
