"""Every Lua file is a script that loads, under the name it is called by; includes resolve."""

from __future__ import annotations

from importlib import resources

from pipeline.coordinator import refill_scripts, scripts
from pipeline.coordinator.scripts import Script, lua_source


def _script_files() -> set[str]:
    folder = resources.files("pipeline.coordinator") / "lua"
    return {p.name[:-4] for p in folder.iterdir() if p.name.endswith(".lua")}


def _loaded() -> dict[str, Script]:
    return {name: obj for mod in (scripts, refill_scripts) for name, obj in vars(mod).items()
            if isinstance(obj, Script)}


def test_every_lua_file_is_loaded_by_one_script_and_compiles(redis_client) -> None:
    files = _script_files()
    by_source = {lua_source(name): name for name in files}
    loaded = _loaded()
    assert len(loaded) == len(files)
    assert {by_source[s.source] for s in loaded.values()} == files
    for s in loaded.values():
        assert "--! include" not in s.source
        assert redis_client.script_load(s.source) == s.sha
