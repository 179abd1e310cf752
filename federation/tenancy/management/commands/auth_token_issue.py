"""``fedinfer auth_token_issue <username>``: issue an API token for a user without a password
(automation, fuzzing). Prints ``Generated token <token> for user <username>``."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser

from federation.tenancy import services


class Command(BaseCommand):
    help = "Issue an API token (valid FEDINFER_TOKEN_TTL_HOURS) for a user; prints it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            user = User.objects.get(username=options["username"])
        except User.DoesNotExist:
            raise CommandError(f"No user {options['username']!r}.") from None
        issued = services.auth_token_issue(user=user)
        self.stdout.write(f"Generated token {issued.plaintext} for user {user.username}")
