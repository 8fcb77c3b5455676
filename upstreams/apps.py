from django.apps import AppConfig


class UpstreamsConfig(AppConfig):
    name = "upstreams"
    default_auto_field = "django.db.models.BigAutoField"
