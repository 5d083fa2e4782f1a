"""The learned part of ProxyKV: the proxy's attention features (:mod:`.proxy`), the :class:`HybridAxialMapper` that
maps them to target scores (:mod:`.model`) and its :class:`MapperConfig` (:mod:`.config`), the checkpoint format
(:mod:`.checkpoint`), finding and publishing checkpoints (:mod:`.hub`), and the bundled checkpoints
(``checkpoints/``)."""

from .config import MapperConfig
from .model import HybridAxialMapper

__all__ = ["HybridAxialMapper", "MapperConfig"]
