"""The HTML status page in a real headless Chromium: a screenshot, and the DOM the browser built
shows each rank's delivered and acknowledged step."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from obs_helpers import JOB, ranks_stopped_at_known_steps, served
from PIL import Image
from support.waiting import wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1200,800"]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=90, check=True)


class RankCells(HTMLParser):
    """rank -> {cell class: text} from the `table.ranks` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, str]] = {}
        self._rank: int | None = None
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("data-rank") is not None:
            self._rank = int(a["data-rank"])
            self.rows[self._rank] = {}
        elif tag == "td" and self._rank is not None:
            self._cell = (a.get("class") or "").split()[0]

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None
        elif tag == "tr":
            self._rank = None

    def handle_data(self, data: str) -> None:
        if self._rank is not None and self._cell:
            self.rows[self._rank][self._cell] = self.rows[self._rank].get(self._cell, "") + data


def test_status_page_in_headless_chromium(tmp_path: Path) -> None:
    with served() as (svc, port), ranks_stopped_at_known_steps(svc) as (_, acked, delivered):
        rt = svc.runtimes[JOB]
        wait_for(lambda: [rt.state.acked(i) for i in range(2)] == acked
                 and [rt.ranks[i].delivered for i in range(2)] == delivered,
                 what="acks and deliveries")
        url = f"http://127.0.0.1:{port}/status?refresh=60"
        shot = tmp_path / "status.png"
        chromium(tmp_path, f"--screenshot={shot}", url)
        print(f"status page screenshot: {shot}")
        dom = chromium(tmp_path, "--dump-dom", url).stdout
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    with Image.open(shot) as img:
        assert img.size == (1200, 800)
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 10  # not blank
    cells = RankCells()
    cells.feed(dom)
    assert sorted(cells.rows) == [0, 1], dom[:2000]
    for i in range(2):
        assert cells.rows[i]["delivered"] == str(delivered[i])
        assert cells.rows[i]["acked"] == str(acked[i])
        assert cells.rows[i]["connected"] == "yes"
    assert f'data-job="{JOB}"' in dom and "odb-pipeline status" in dom
