"""mil_core: the numerical engine of gpmil (knows nothing of Zarr, Dask or Prefect).

Sparse Gaussian-process multiple-instance learning written as map → sum → small solve:
partition steps over blocks of whole bags return summable statistics; a global update solves
an M×M system. See ``mil_core.engine`` and ``DESIGN.md``.
"""

from .engine import BagBlock, GaussianQ, SerialExecutor, SparseGP, optimise
from .kernels import RBF
from .likelihoods import GammaMixture, HyperbolicSecant, Psi, ThetaFunction
from .vgpmil import GVGPMIL, VGPMIL, PsiVGPMIL
from .probit import VGPMILPR, VGPMILPRI
from .gibbs import VGPMILPRGibbs
from .vwsgp import VWSGP
from .absmil import AbSMIL

__all__ = [
    "RBF",
    "Psi",
    "HyperbolicSecant",
    "GammaMixture",
    "ThetaFunction",
    "VGPMIL",
    "GVGPMIL",
    "PsiVGPMIL",
    "VGPMILPR",
    "VGPMILPRI",
    "VGPMILPRGibbs",
    "VWSGP",
    "AbSMIL",
    "BagBlock",
    "GaussianQ",
    "SparseGP",
    "SerialExecutor",
    "optimise",
]
