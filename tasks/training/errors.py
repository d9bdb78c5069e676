"""The error of a cohort that cannot be trained on, resumed or predicted as asked."""

__all__ = ["CohortError"]


class CohortError(ValueError):
    """A cohort store (or its training checkpoint) that does not fit the model or the run: one
    class of labels, another feature width or extractor, a checkpoint of another configuration.
    The message names the store and what to do; the command line prints it without a traceback."""
