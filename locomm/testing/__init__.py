"""Rigs for tests and benchmarks (network namespaces, tc, NAT, the subprocess-peer launcher).

Runtime code never imports this package (an import-linter contract says so).
"""
