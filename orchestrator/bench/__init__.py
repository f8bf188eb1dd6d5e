"""Benchmarking: public serving traces (``traces``) and the ``dyad bench`` replay client (``runner``)."""
