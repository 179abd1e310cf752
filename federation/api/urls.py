"""REST management API v1. Each domain registers its routes on a router in its own
``api/urls.py``; this module mounts them and one browsable root that lists them all."""

from django.urls import include, path
from rest_framework.routers import APIRootView

from federation.core.api.urls import router as core_router
from federation.inventory.api.urls import router as inventory_router
from federation.routing.api.urls import router as routing_router
from federation.tenancy.api.urls import router as tenancy_router

_root = {
    prefix: f"{basename}-list"
    for router in (inventory_router, tenancy_router, core_router, routing_router)
    for prefix, _viewset, basename in router.registry
}

urlpatterns = [
    path("", APIRootView.as_view(api_root_dict=_root), name="api-root"),
    path("", include("federation.inventory.api.urls")),
    path("", include("federation.tenancy.api.urls")),
    path("", include("federation.core.api.urls")),
    path("", include("federation.routing.api.urls")),
]
