"""Distributed training and prediction over a cohort store, on Dask (DESIGN §4)."""

from tasks.training.executor import *  # noqa: F401,F403  (temporary: split into modules in the next commit)
from tasks.training.executor import FeatureScaling  # noqa: F401
