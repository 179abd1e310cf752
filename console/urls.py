from django.urls import path

from console.views import audit, auth, catalog, dead_letters, fleet, reports, routing, tenants

app_name = "console"

urlpatterns = [
    path("", auth.home, name="home"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("overview/", fleet.overview, name="overview"),
    path("regions/", fleet.region_list, name="regions"),
    path("regions/<slug:code>/", fleet.region_detail, name="region"),
    path("regions/<slug:code>/evacuate/", fleet.region_evacuate, name="region-evacuate"),
    path("regions/<slug:code>/restore/", fleet.region_restore, name="region-restore"),
    path("pools/<int:pk>/cordon/", fleet.pool_cordon, name="pool-cordon"),
    path("pools/<int:pk>/uncordon/", fleet.pool_uncordon, name="pool-uncordon"),
    path("instances/<slug:name>/drain/", fleet.instance_drain, name="instance-drain"),
    path("instances/<slug:name>/undrain/", fleet.instance_undrain, name="instance-undrain"),
    path("models/", catalog.model_matrix, name="models"),
    path("routing/", routing.routing_index, name="routing"),
    path("routing/inspect/", routing.inspect, name="inspect"),
    path("routing/<slug:code>/", routing.region_table, name="routing-table"),
    path("routing/<slug:code>/diff/", routing.table_diff, name="routing-diff"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/<slug:slug>/", tenants.tenant_detail, name="tenant"),
    path("tenants/<slug:slug>/keys/new/", tenants.key_create, name="key-create"),
    path("keys/<int:pk>/revoke/", tenants.key_revoke, name="key-revoke"),
    path("keys/<int:pk>/rotate/", tenants.key_rotate, name="key-rotate"),
    path("usage/", reports.usage, name="usage"),
    path("costs/", reports.costs, name="costs"),
    path("dead-letters/", dead_letters.dead_letter_list, name="dead-letters"),
    path(
        "dead-letters/<int:pk>/replay/",
        dead_letters.dead_letter_replay,
        name="dead-letter-replay",
    ),
    path("audit/", audit.audit_log, name="audit"),
    path("users/", audit.user_list, name="users"),
]
