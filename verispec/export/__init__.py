"""Trained drafters written in the layouts serving engines load (see verispec.export.eagle3)."""

from verispec.export.eagle3 import FORMATS, export_eagle3

__all__ = ["FORMATS", "export_eagle3"]
