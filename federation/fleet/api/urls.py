from django.urls import URLPattern, path

from federation.fleet.api.views import PlacementApplyView, PlacementPlanView

urlpatterns: list[URLPattern] = [
    path("placement/plan/", PlacementPlanView.as_view(), name="placement-plan"),
    path("placement/apply/", PlacementApplyView.as_view(), name="placement-apply"),
]
