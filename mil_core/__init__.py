"""mil_core: the numerical engine of gpmil (knows nothing of Zarr, Dask or Prefect).

Sparse Gaussian-process multiple-instance learning written as map → sum → small solve:
partition steps over blocks of whole bags return summable statistics; a global update solves
an M×M system. See ``mil_core.engine`` and ``DESIGN.md``.

Layout: the estimators (and their partition updates and hyper-parameter steps) live in
:mod:`mil_core.models`; the numerics they share — engine, kernels, likelihoods, bag reductions,
truncated normals, orthant probabilities, the Ising/CAR coupling, predictive formulas, features'
relevance to the bag labels — are modules of this package and never import a model.
"""

from .engine import BagBlock, GaussianQ, SerialExecutor, SparseGP, optimise
from .kernels import RBF
from .likelihoods import GammaMixture, HyperbolicSecant, Psi, ThetaFunction
from .models import ABMIL, EmbeddedGPMIL, GVGPMIL, VGPMIL, VGPMILPR, VGPMILPRI, VWSGP, AbSMIL, PsiVGPMIL, VGPMILPRGibbs

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
    "ABMIL",
    "EmbeddedGPMIL",
    "BagBlock",
    "GaussianQ",
    "SparseGP",
    "SerialExecutor",
    "optimise",
]
