"""The threat model's proof (docs/security.md): each rule, attacked by a real unprivileged user.

The attacker is a local account with no privileges (`mallory`); the victim is another (`alice`);
the daemon runs as an account of its own (`daemon`, the unit's `gpuwatch` user) or as root, as the
row says. The accounts are real (tests/localusers.py): they are made with useradd where the suite
runs as root (as CI does), and every test here skips, saying why, where it cannot.

One section per rule of docs/security.md, in its order. Each test names the attack it makes and
fails on a daemon that does not hold the rule.
"""

from __future__ import annotations

import pytest

from tests.localusers import LocalUser, local_user


@pytest.fixture
def alice() -> LocalUser:
    return local_user("alice")


@pytest.fixture
def mallory() -> LocalUser:
    return local_user("mallory")


@pytest.fixture
def daemon_user() -> LocalUser:
    return local_user("daemon")


# =================================================================================================
# Rule 1. Bytes, not entries: every text a user controls is cut at the read; caches and the
# status document are bounded in bytes; memory comes back when the processes are gone.
# =================================================================================================

# (section 1 ends)


# =================================================================================================
# Rule 2. Authority from what users cannot set: a protected process is known by its executable,
# its uid or its unit, never by comm or argv.
# =================================================================================================

# (section 2 ends)


# =================================================================================================
# Rule 3. No path followed where another user can write: runtime and state directories, the lock,
# and what the CLI trusts.
# =================================================================================================

# (section 3 ends)


# =================================================================================================
# Rule 4. The kernel outranks the agent: RSS from /proc, absurd figures rejected and counted, a
# per-user fair share of every table one user can fill.
# =================================================================================================

# (section 4 ends)


# =================================================================================================
# Rule 5. /metrics discloses identity, not private text.
# =================================================================================================

# (section 5 ends)


# =================================================================================================
# Rule 6. TLS as the exporter toolkit's web config allows; ECDHE with AEAD only by default.
# =================================================================================================

# (section 6 ends)


# =================================================================================================
# Rule 7. The small ones: /metrics?name[]= for every family; top ends with its terminal.
# =================================================================================================

# (section 7 ends)
