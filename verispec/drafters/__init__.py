"""Drafters, one file each: they propose tokens and rewind their own state (base.Drafter).

Which method runs which drafter, with what defaults, is the registry's (verispec.methods).
"""
