"""The `JobState` contract fixtures (memory and Redis) for the reconfiguration tests here."""

from jobstate.conftest import env, make_env  # noqa: F401 (fixtures)
