"""`odb-pipeline demo`: the whole system on one machine, with real trainer ranks."""
