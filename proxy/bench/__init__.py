"""The load generator behind ``triton-proxy bench``.

Scenario file -> fixed open-loop schedule (:mod:`.scenario`) -> arms run on it one after the
other (:mod:`.compare`, :mod:`.runner`, :mod:`.haproxy`) -> figures (:mod:`.results`) ->
table, JSON, PNG (:mod:`.report`).
"""
