"""tokenprobe.contract: what every room agrees on, importing nothing of the project.

Today it holds the tenant rule (tenant.py); table and figure definitions join it.
"""
