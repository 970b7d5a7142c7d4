"""The liveness contract's names exist in the code, exactly as the fault suite uses them
(tests/liveness/contract.py): config fields, client options and the Heartbeat message. The
scenarios leave out a name the code lacks (so they fail for the missing liveness, not on an
unknown option); this test says which are missing."""

from __future__ import annotations

from liveness.contract import missing_names


def test_every_name_of_the_liveness_contract_exists():
    missing = missing_names()
    assert not missing, missing
