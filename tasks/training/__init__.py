"""Distributed training and prediction over a cohort store, on Dask (DESIGN §4).

Modules, one responsibility each:

- :mod:`~tasks.training.blocks` — partitions read as engine blocks (scaling, hold-outs, device);
- :mod:`~tasks.training.preprocess` — feature standardisation and the k-means sample before a fit;
- :mod:`~tasks.training.placement` — device and persist/stream choice from the cluster's workers;
- :mod:`~tasks.training.executor` — one iteration's map → tree-sum on the cluster;
- :mod:`~tasks.training.checkpoint` — the only serialisation of training state;
- :mod:`~tasks.training.early_stopping` — validation bag-AUC on the workers;
- :mod:`~tasks.training.fit` — :func:`fit_cohort`, checkpointed and resumable;
- :mod:`~tasks.training.predict` — :func:`predict_cohort`, :func:`read_predictions`.
"""

from tasks.training.blocks import FeatureScaling
from tasks.training.executor import DaskExecutor
from tasks.training.fit import TrainingSummary, fit_cohort
from tasks.training.predict import predict_cohort, read_predictions

__all__ = ["DaskExecutor", "FeatureScaling", "TrainingSummary", "fit_cohort", "predict_cohort", "read_predictions"]
