from django.urls import path

from . import api

urlpatterns = [
    path("tasks/<slug:task_id>/rollouts/<str:rollout_id>/calls", api.RolloutCallView.as_view()),
    path("tasks/<slug:task_id>/rollouts/<str:rollout_id>", api.RolloutView.as_view()),
    path("tasks/<slug:task_id>/sandboxes", api.TaskSandboxesView.as_view()),
    path("tasks/<slug:task_id>/branches", api.BranchesView.as_view()),
    path("steps", api.StepsView.as_view()),
    path("pools", api.PoolsView.as_view()),
]
