"""Usage dead letters (admins and operators): documents refused at ingestion, newest first,
each with a button to replay it through the checks as the edge that sent it."""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from console.access import STAFF, console_view
from federation.metering.models import UsageDeadLetter
from federation.metering.selectors import usage_dead_letters
from federation.metering.services import usage_dead_letter_replay
from federation.routing.services import routing_tables_schedule_budget_release

LETTERS_PER_PAGE = 50
#: How much of a document the page shows.
PREVIEW_BYTES = 600


@console_view(*STAFF)
def dead_letter_list(request: HttpRequest) -> HttpResponse:
    page = Paginator(usage_dead_letters(), LETTERS_PER_PAGE).get_page(request.GET.get("page"))
    rows = [
        (letter, bytes(letter.document[:PREVIEW_BYTES]).decode("utf-8", "replace"))
        for letter in page
    ]
    return render(request, "console/dead_letters.html", {"page": page, "rows": rows})


@require_POST
@console_view(*STAFF)
def dead_letter_replay(request: HttpRequest, pk: int) -> HttpResponse:
    letter = get_object_or_404(UsageDeadLetter, pk=pk)
    result = usage_dead_letter_replay(actor=request.user, letter=letter)
    if result.refused:
        messages.error(request, f"Still refused: {'; '.join(result.refused)[:300]}")
    else:
        messages.success(request, f"Replayed: {result.accepted} record(s) stored.")
    if result.accepted:
        routing_tables_schedule_budget_release()
    return redirect("console:dead-letters")
