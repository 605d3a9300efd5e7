"""Operator tooling: Grafana dashboards generated from Python, rendered without Grafana."""
