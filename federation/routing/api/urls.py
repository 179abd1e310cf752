from django.urls import path
from rest_framework.routers import SimpleRouter

from federation.routing.api import views
from federation.routing.api.longpoll import long_poll

router = SimpleRouter()
router.register("routing-tables", views.RoutingTableOverviewViewSet, basename="routing-table")

urlpatterns = [
    path(
        "edges/<str:region>/routing-table",
        long_poll(views.RoutingTableView.as_view()),
        name="edge-routing-table",
    ),
    path(
        # Any segment reaches the view: a malformed id is its JSON 404, not the resolver's HTML.
        "edges/<str:pk>/rotate-credential",
        views.EdgeCredentialRotateView.as_view(),
        name="edge-rotate-credential",
    ),
    *router.urls,
]
