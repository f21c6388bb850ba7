"""The one error type a bad checkpoint raises."""


class CheckpointError(ValueError):
    """A checkpoint folder, config or weights file that cannot be loaded.

    The message always names the file and, where it applies, the tensor or config key.
    """
