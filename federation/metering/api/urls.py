from django.urls import URLPattern, path

from federation.metering.api.views import EdgeUsageView

urlpatterns: list[URLPattern] = [
    path("edges/<str:name>/usage", EdgeUsageView.as_view(), name="edge-usage"),
]
