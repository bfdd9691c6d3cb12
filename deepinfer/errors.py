"""Errors the engine reports to users as one line (the CLI exits with status 2)."""


class DeepInferError(Exception):
    """A user-facing error: its message names the problem and the fix."""


class PluginError(DeepInferError):
    """An unknown, unavailable, broken or incompatible plugin."""


class ConfigError(DeepInferError):
    """An invalid configuration value."""


class CheckpointError(DeepInferError):
    """A model directory, checkpoint, tokenizer or config file that cannot be loaded."""


class ChatFormatError(DeepInferError, ValueError):
    """A conversation that cannot be formatted: a malformed message, an unsupported option, or no chat format."""


class RankFailure(DeepInferError):
    """A rank of an expert-parallel group died or stopped answering; every rank has been stopped."""
