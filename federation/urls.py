"""The URL tree. Each domain registers its REST routes on a router in its own ``api/urls.py``;
they are mounted under ``/api/v1/`` with one browsable root that lists them all."""

from django.contrib import admin
from django.urls import URLPattern, URLResolver, include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import APIRootView

from federation.core.api.urls import router as core_router
from federation.core.health import healthz, readyz
from federation.core.metrics import metrics_view
from federation.inventory.api.urls import router as inventory_router
from federation.routing.api.urls import router as routing_router
from federation.tenancy.api.urls import router as tenancy_router

_api_root = {
    prefix: f"{basename}-list"
    for router in (inventory_router, tenancy_router, core_router, routing_router)
    for prefix, _viewset, basename in router.registry
}

api_v1: list[URLPattern | URLResolver] = [
    path("", APIRootView.as_view(api_root_dict=_api_root), name="api-root"),
    path("", include("federation.inventory.api.urls")),
    path("", include("federation.tenancy.api.urls")),
    path("", include("federation.core.api.urls")),
    path("", include("federation.routing.api.urls")),
    path("", include("federation.telemetry.api.urls")),
    path("", include("federation.metering.api.urls")),
    path("", include("federation.fleet.api.urls")),
]

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="console:home"), name="home"),
    path("console/", include("console.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view loads its init script from a URL: the CSP runs no inline script.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", metrics_view, name="metrics"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
]
