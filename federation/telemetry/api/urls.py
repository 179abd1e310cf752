from django.urls import URLPattern, path

from federation.telemetry.api.views import EdgeHeartbeatView

urlpatterns: list[URLPattern] = [
    path("edges/<str:name>/heartbeat", EdgeHeartbeatView.as_view(), name="edge-heartbeat"),
]
