from django.contrib.auth import views as auth_views
from django.urls import path

from . import access, api, controls, views  # noqa: F401 (access registers the taskkey converter)

app_name = "dashboard"

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="registration/login.html", redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="/login/"), name="logout"),
    path("", views.overview, name="overview"),
    path("tasks/<taskkey:task_id>/", views.task, name="task"),
    path("tasks/<taskkey:task_id>/graph/", views.graph, name="graph"),
    path("tasks/<taskkey:task_id>/tree/", views.tree, name="tree"),
    path("tasks/<taskkey:task_id>/nodes/<int:node_id>/", views.node, name="node"),
    path("pools/", views.pools, name="pools"),
    path("projects/<slug:name>/", views.project, name="project"),
    path("audit/", views.audit, name="audit"),
    # Staff controls: GET confirms, POST (CSRF) acts.
    path("tasks/<taskkey:task_id>/nodes/<int:node_id>/<str:action>/", controls.control, name="node-control"),
    path("tasks/<taskkey:task_id>/control/<str:action>/", controls.control, name="task-control"),
    path("pools/control/<str:action>/", controls.control, name="pool-control"),
    # JSON for the graph browser (session auth).
    path("dashboard-api/tasks/<taskkey:task_id>/graph", api.graph, name="api-graph"),
    path("dashboard-api/tasks/<taskkey:task_id>/nodes", api.nodes, name="api-nodes"),
    path("dashboard-api/tasks/<taskkey:task_id>/search", api.search, name="api-search"),
    path("dashboard-api/tasks/<taskkey:task_id>/reveal/<int:node_id>", api.reveal, name="api-reveal"),
]
