"""The errors a bad checkpoint raises: at load (CheckpointError), or when its weights overflow
the arithmetic on some input (NonFiniteError)."""


class CheckpointError(ValueError):
    """A checkpoint folder, config or weights file that cannot be loaded.

    The message always names the file and, where it applies, the tensor or config key.
    """


class NonFiniteError(ValueError):
    """A forward whose output is not finite (NaN or inf): the weights overflow the
    arithmetic for this input. The message names the first layer whose output is not finite."""
