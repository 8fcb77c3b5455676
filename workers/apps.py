from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import tasks  # noqa: F401  (registers the Celery tasks that services enqueue by name)
