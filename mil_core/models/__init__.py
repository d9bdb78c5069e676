"""The GP-MIL estimators (scikit-learn style) and their partition updates.

Each model module holds one family: its :class:`~mil_core.engine.PartitionUpdates` and its
estimators on the shared :class:`~mil_core.models.base.SparseGPMILBase`; ``hyper`` and
``ising_hyper`` learn hyper-parameters between closed-form sweeps. The numerics they use live
one level up, in :mod:`mil_core`.
"""

from .absmil import AbSMIL
from .gibbs import VGPMILPRGibbs
from .probit import VGPMILPR, VGPMILPRI
from .vgpmil import GVGPMIL, VGPMIL, PsiVGPMIL
from .vwsgp import VWSGP

__all__ = ["VGPMIL", "GVGPMIL", "PsiVGPMIL", "VGPMILPR", "VGPMILPRI", "VGPMILPRGibbs", "VWSGP", "AbSMIL"]
