"""The console's forms: they parse and check what people type; the services decide. A
service's own refusal (``ValidationError`` by field, ``Conflict``) is shown on the form by
:func:`add_service_errors`, so a refused write shows why and leaves nothing behind."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any, cast

from django import forms
from django.core.exceptions import ValidationError

from federation.core.errors import Conflict
from federation.metering.models import DIMENSIONS
from federation.tenancy.models import ApiKey
from federation.tenancy.services import MAX_ROTATION_GRACE_SECONDS

#: The longest ranges the usage API serves (``federation.metering.api.reports.MAX_RANGE``).
MAX_DAYS = {"hour": 31, "day": 400}
METRICS = (
    ("price_usd", "Price (USD)"),
    ("requests", "Requests"),
    ("prompt_tokens", "Prompt tokens"),
    ("completion_tokens", "Completion tokens"),
    ("cached_tokens", "Cached prompt tokens"),
)
STAFF_METRICS = (*METRICS, ("cost_usd", "Cost (USD)"), ("margin_usd", "Margin (USD)"))


def add_service_errors(form: forms.Form, exc: ValidationError | Conflict) -> None:
    """Put a service's refusal on ``form``: field errors on their fields (when the form has
    them), everything else at the top."""
    if isinstance(exc, Conflict):
        form.add_error(None, str(exc))
        return
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc)
        return
    for name, errors in exc.message_dict.items():
        form.add_error(name if name in form.fields else None, errors)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. 'production'.")
    scopes = forms.MultipleChoiceField(
        choices=ApiKey.Scope.choices,
        initial=[ApiKey.Scope.INFERENCE],
        widget=forms.CheckboxSelectMultiple,
    )
    expires_at = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="UTC. Empty: the key does not expire.",
    )


class ApiKeyRotateForm(forms.Form):
    grace_seconds = forms.IntegerField(
        min_value=0,
        max_value=MAX_ROTATION_GRACE_SECONDS,
        initial=0,
        help_text="How long the old secret keeps working, so clients can switch over.",
    )


def _day_start(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=UTC)


class RangeForm(forms.Form):
    """A range of whole UTC days (the end day included) and a time bucket."""

    start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="Included.")
    bucket = forms.ChoiceField(choices=(("day", "Day"), ("hour", "Hour")), initial="day")

    @classmethod
    def defaults(cls, today: date, days: int = 30) -> dict[str, Any]:
        return {"start": today - timedelta(days=days - 1), "end": today, "bucket": "day"}

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, end, bucket = data.get("start"), data.get("end"), data.get("bucket")
        if start is None or end is None or bucket is None:
            return data
        if end < start:
            self.add_error("end", "The end day must not be before the start day.")
        elif (end - start).days + 1 > MAX_DAYS[bucket]:
            self.add_error("end", f"A report by {bucket} covers at most {MAX_DAYS[bucket]} days.")
        else:
            data["start_at"] = _day_start(start)
            data["end_at"] = _day_start(end + timedelta(days=1))
        return data


class UsageForm(RangeForm):
    group_by = forms.ChoiceField(choices=[(d, d.title()) for d in DIMENSIONS], initial="model")
    metric = forms.ChoiceField(choices=METRICS, initial="price_usd")
    tenant = forms.CharField(required=False, max_length=63, help_text="A tenant's slug.")
    model = forms.CharField(required=False, max_length=128)
    region = forms.CharField(required=False, max_length=63)
    pool = forms.CharField(required=False, max_length=130, help_text="'<region>/<pool>'.")

    def __init__(self, *args: Any, staff: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if staff:
            cast(forms.ChoiceField, self.fields["metric"]).choices = STAFF_METRICS
        else:
            # A tenant viewer's report is its own tenant's, always.
            del self.fields["tenant"]

    @classmethod
    def defaults(cls, today: date, days: int = 30) -> dict[str, Any]:
        return {**super().defaults(today, days), "group_by": "model", "metric": "price_usd"}


class AuditFilterForm(forms.Form):
    actor = forms.CharField(required=False, max_length=150, help_text="Username, or 'system'.")
    action = forms.CharField(required=False, max_length=64, help_text="e.g. region.evacuate")
    object_type = forms.CharField(required=False, max_length=64, help_text="e.g. inventory.region")
    since = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), help_text="Included."
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        since, until = data.get("since"), data.get("until")
        if since and until and until < since:
            self.add_error("until", "The last day must not be before the first.")
        return data


class InspectForm(forms.Form):
    tenant = forms.CharField(max_length=63, help_text="The tenant's slug.")
    model = forms.ChoiceField(choices=())
    origin = forms.ChoiceField(choices=(), label="Edge region", help_text="Where it arrives.")
    session = forms.CharField(
        required=False, max_length=256, help_text="x-session-id, if the client sends one."
    )
    prompt = forms.CharField(
        required=False, max_length=20_000, widget=forms.Textarea(attrs={"rows": 3})
    )

    def __init__(self, *args: Any, models: list[str], regions: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["model"]).choices = [(m, m) for m in models]
        cast(forms.ChoiceField, self.fields["origin"]).choices = [(r, r) for r in regions]


class TableDiffForm(forms.Form):
    old = forms.IntegerField(min_value=1, label="From version")
    new = forms.IntegerField(min_value=1, label="To version")
