"""KV on disk, a selected subset in memory: the decode pipeline of the disk policies (pipeline.py) and its stages,
the window of sinks and ring (window.py), a layer's fetch (fetch.py), the reads' threads (io.py), the picks'
attention (attention.py), and, where configured, correction (correction.py) and re-clustering (recluster.py)."""
from .pipeline import OffloadedKV

__all__ = ["OffloadedKV"]
