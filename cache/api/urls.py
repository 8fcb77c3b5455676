from django.urls import path

from . import views

urlpatterns = [
    path("tasks", views.TaskListView.as_view()),
    path("tasks/<slug:task_id>", views.TaskView.as_view()),
    path("tasks/<slug:task_id>/lookup", views.LookupView.as_view()),
    path("tasks/<slug:task_id>/record", views.RecordView.as_view()),
    path("tasks/<slug:task_id>/claims/release", views.ClaimReleaseView.as_view()),
    path("tasks/<slug:task_id>/file-times", views.FileTimesView.as_view()),
    path("tasks/<slug:task_id>/stats", views.TaskStatsView.as_view()),
    path("tasks/<slug:task_id>/graph", views.GraphView.as_view()),
    path("tasks/<slug:task_id>/tree", views.TreeView.as_view()),
    path("tasks/<slug:task_id>/nodes/<int:node_id>/snapshots", views.SnapshotRegisterView.as_view()),
    path("tasks/<slug:task_id>/nodes/<int:node_id>/audit", views.NodeAuditView.as_view()),
    path("tasks/<slug:task_id>/flush", views.TaskFlushView.as_view()),
    path("tasks/<slug:task_id>/nodes/<int:node_id>/evict", views.NodeEvictView.as_view()),
    path("tasks/<slug:task_id>/nodes/<int:node_id>/pin", views.NodePinView.as_view()),
    path("leases/<str:lease_id>", views.LeaseView.as_view()),
]
