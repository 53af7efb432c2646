"""locomm: a peer-to-peer training client (NoLoCo, GASLoC, DiLoCo, SparseLoCo)."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
