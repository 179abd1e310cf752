from django.urls import URLPattern, path

from federation.metering.api.reports import PoolCostReportView, StatementView, UsageReportView

urlpatterns: list[URLPattern] = [
    path("usage/", UsageReportView.as_view(), name="usage-report"),
    path("usage/statement/", StatementView.as_view(), name="usage-statement"),
    path("costs/", PoolCostReportView.as_view(), name="pool-cost-report"),
]
