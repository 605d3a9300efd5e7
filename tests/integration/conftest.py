"""Real local Triton servers for the integration tests, started once per session.

Other sessions on the same machine run Triton servers too, so leaks are checked by the process
groups this fixture started, never by process name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.local import (
    LocalFleet,
    TritonServer,
    group_members,
    sigterm_raises_exit,
)

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
MODELS = ("simple", "text_encoder", "accel_sim", "text_generator", "accumulator", "sleeper")
FLEET_SIZE = 3
START_TIMEOUT_S = 240


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def triton_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Three local Triton servers with every model in ``model_repository/`` loaded."""
    log_dir = tmp_path_factory.mktemp("triton-logs")
    fleet = LocalFleet(FLEET_SIZE, MODEL_REPOSITORY, MODELS, log_dir)
    # A SIGTERM'd test run still unwinds this fixture and stops the servers.
    with sigterm_raises_exit():
        # Generous: 15 python-backend stubs each import torch, and the CPUs may be shared.
        # A missing Triton fails (no skip): its error says what to install.
        fleet.start(timeout_s=START_TIMEOUT_S)
        try:
            yield fleet
        finally:
            fleet.stop()
            leaked = {pgid: group_members(pgid) for pgid in fleet.started_pgids}
            leaked = {pgid: pids for pgid, pids in leaked.items() if pids}
            assert not leaked, (
                f"processes left in the fleet's process groups: {leaked} (logs in {log_dir})"
            )


@pytest.fixture(autouse=True)
def _revive_crashed_servers(request: pytest.FixtureRequest) -> None:
    """Before each test on the shared fleet, restart a server that died since the last one.

    Triton 2.51 can abort on its own (``ASSERTION FAILED: !byte_buffer->Valid()`` when one gRPC
    stream carries concurrent errors, docs/triton-notes.md); without this, one abort fails
    every later test of the session. The death is reported as a warning with the server's log,
    never hidden: the test that was running when it died has already failed.
    """
    if "triton_fleet" not in request.fixturenames:
        return
    fleet: LocalFleet = request.getfixturevalue("triton_fleet")
    for why in fleet.revive(timeout_s=START_TIMEOUT_S):
        warnings.warn(f"restarted a Triton server of the test fleet: {why}", stacklevel=1)


@pytest.fixture(scope="session")
def triton_servers(triton_fleet: LocalFleet) -> list[TritonServer]:
    return triton_fleet.servers


@pytest.fixture
def triton_server(triton_fleet: LocalFleet) -> TritonServer:
    """The fleet's first server (as it is now: a test may have restarted it)."""
    return triton_fleet.server(0)
