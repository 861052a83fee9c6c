"""paraloom: Megatron-style 3D parallel training for PyTorch, every communication on the record."""

from .config import ModelConfig, ParallelConfig
from .ledger import Ledger, recording
from .mesh import ParallelMesh
from .utils import divide

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ModelConfig", "ParallelMesh", "Ledger", "recording", "divide",
           "__version__"]
