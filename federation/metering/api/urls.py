from django.urls import URLPattern, path

from federation.metering.api.dead_letters import DeadLetterReplayView, DeadLettersView
from federation.metering.api.reports import PoolCostReportView, StatementView, UsageReportView
from federation.metering.api.usage import EdgeUsageView

urlpatterns: list[URLPattern] = [
    path("usage/", UsageReportView.as_view(), name="usage-report"),
    path("usage/statement/", StatementView.as_view(), name="usage-statement"),
    path("usage/dead-letters/", DeadLettersView.as_view(), name="usage-dead-letters"),
    path(
        "usage/dead-letters/<str:pk>/replay/",
        DeadLetterReplayView.as_view(),
        name="usage-dead-letter-replay",
    ),
    path("costs/", PoolCostReportView.as_view(), name="pool-cost-report"),
    path("edges/<str:name>/usage", EdgeUsageView.as_view(), name="edge-usage"),
]
