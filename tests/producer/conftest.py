"""The `JobState` contract fixtures (every implementation: memory and Redis) for the producer's
part of the contract."""

from jobstate.conftest import env, make_env  # noqa: F401 (fixtures)
