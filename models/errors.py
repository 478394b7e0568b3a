"""The error every checkpoint problem raises, shared by the config and weight readers."""


class CheckpointError(ValueError):
    """A checkpoint folder Kiln cannot build from; the message says what is wrong and what to do."""
