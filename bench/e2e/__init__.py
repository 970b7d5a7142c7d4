"""Helpers of bench/e2e_bench.py (end-to-end training throughput, stalls, scaling, alignment)."""
