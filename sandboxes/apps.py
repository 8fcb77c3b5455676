from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accounts.hooks import images_register
        from cache.hooks import SandboxHooks, sandbox_hooks_register

        from .handles import env_check_project, env_fingerprint_material, service_images

        sandbox_hooks_register(
            SandboxHooks(fingerprint_material=env_fingerprint_material, grants_check=env_check_project)
        )
        images_register(service_images)
