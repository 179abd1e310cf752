from django.urls import URLPattern, path

from federation.metering.api.reports import PoolCostReportView, UsageReportView
from federation.metering.api.views import EdgeUsageView

urlpatterns: list[URLPattern] = [
    path("edges/<str:name>/usage", EdgeUsageView.as_view(), name="edge-usage"),
    path("usage/", UsageReportView.as_view(), name="usage-report"),
    path("costs/", PoolCostReportView.as_view(), name="pool-cost-report"),
]
