"""Models for running and testing SSD: the default real pair (fetch + convert), tiny and synthetic pairs.

Nothing in the engine (`hf_ssd/*.py`) imports from here.
"""
