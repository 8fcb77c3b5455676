from django.apps import AppConfig


class CacheConfig(AppConfig):
    name = "cache"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accounts.hooks import request_counter_register

        from .ledger import request_add

        request_counter_register(request_add)  # the ledger writes a project's request counts
