"""Offline regression suite and upstream patch series for nnsight encoders on NDIF.

Importing this package pulls in nothing heavy: the parts that need torch,
transformers or nnsight (``models``, ``checks``) are imported only inside the
environment they run in.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
