"""The GP-MIL estimators (scikit-learn style) and their partition updates.

Each model module holds one family: its :class:`~mil_core.engine.PartitionUpdates` and its
estimators on the shared :class:`~mil_core.models.base.SparseGPMILBase`; ``hyper`` and
``ising_hyper`` learn hyper-parameters between closed-form sweeps. The numerics they use live
one level up, in :mod:`mil_core`.
"""

from ..persist import allow_types
from .absmil import AbSMIL, AbSMILState
from .attention_mil import ABMIL
from .embedded import EmbeddedGPMIL
from .gibbs import GibbsChain, GibbsState, VGPMILPRGibbs
from .probit import VGPMILPR, VGPMILPRI
from .probit_updates import ProbitLocal, ProbitQ
from .vgpmil import GVGPMIL, VGPMIL, PsiVGPMIL
from .hyper import HyperState
from .ising_hyper import LamLocal, LamState
from .vwsgp import VWSGP

__all__ = ["VGPMIL", "GVGPMIL", "PsiVGPMIL", "VGPMILPR", "VGPMILPRI", "VGPMILPRGibbs", "VWSGP", "AbSMIL", "ABMIL", "EmbeddedGPMIL"]

# What a saved model or a training checkpoint may hold (mil_core.persist builds nothing else).
allow_types(VGPMIL, GVGPMIL, PsiVGPMIL, VGPMILPR, VGPMILPRI, VGPMILPRGibbs, VWSGP, AbSMIL, ABMIL, EmbeddedGPMIL,
            HyperState, LamState, LamLocal, AbSMILState, GibbsState, GibbsChain, ProbitQ, ProbitLocal)
