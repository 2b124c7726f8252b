"""The alert rules (dashboards/gpuwatch-alerts.yml) through Prometheus's own promtool: the file
is valid, and every alert fires with the expected labels and annotations where it must and stays
quiet where it must not (tests/alerts/*.test.yml).

Skipped only where promtool is absent and we are not in CI; CI installs Debian's `prometheus`
package (`make test-deps`), so there it always runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "dashboards" / "gpuwatch-alerts.yml"
RULE_TESTS = sorted((Path(__file__).resolve().parent / "alerts").glob("*.test.yml"))

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("CI"),
    reason="promtool is not installed (make test installs Debian's prometheus package)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_rule_file() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "17 rules found" in done.stdout


@needs_promtool
@pytest.mark.parametrize("rule_test", RULE_TESTS, ids=lambda p: p.name)
def test_alerts_behave_as_their_unit_tests_say(rule_test: Path) -> None:
    done = promtool("test", "rules", str(rule_test))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_test_where_it_fires_and_one_where_it_must_not() -> None:
    alerts = re.findall(r"^      - alert: (\w+)$", RULES.read_text(), re.M)
    text = "\n".join(p.read_text() for p in RULE_TESTS)
    checks = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    fires = {name for name, empty in checks if not empty}
    quiet = {name for name, empty in checks if empty}
    assert len(alerts) == 17
    assert set(alerts) - fires == set(), "alerts never shown firing"
    assert set(alerts) - quiet == set(), "alerts never shown quiet"
    assert (fires | quiet) <= set(alerts), "tests of alerts that do not exist"
