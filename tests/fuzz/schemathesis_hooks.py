"""Schemathesis hooks: authenticate as the fuzzing admin, and again whenever a 401 says the
token is gone (the fuzzer itself may log out through ``DELETE /auth/token/``)."""

from __future__ import annotations

import os
import subprocess
import sys

import schemathesis

FUZZ_USER = os.environ.get("FUZZ_USER", "fuzz-admin")


@schemathesis.auth(refresh_interval=None, retry_on=[401])
class FreshToken:
    def get(self, case: schemathesis.Case, context: schemathesis.AuthContext) -> str:
        # A management command, not the API: the fuzzer may have changed the password.
        result = subprocess.run(
            [sys.executable, "-m", "federation.cli", "drf_create_token", FUZZ_USER],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"could not issue a token for {FUZZ_USER}: {result.stderr[-2000:]}")
        return result.stdout.split()[2]

    def set(self, case: schemathesis.Case, data: str, context: schemathesis.AuthContext) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Token {data}"}
