"""``drf_create_token``, the name of DRF's authtoken command, kept for scripts written against
it (tests/fuzz): the same output, a token of ours (``auth_token_issue``)."""

from federation.tenancy.management.commands.auth_token_issue import Command as AuthTokenIssue


class Command(AuthTokenIssue):
    pass
